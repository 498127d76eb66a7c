"""An actor module that takes long to import (as torch does), to be interrupted meanwhile."""

import time

from miles.runtime import Actor

print("importing", flush=True)
time.sleep(60)


class Slow(Actor):
    pass
