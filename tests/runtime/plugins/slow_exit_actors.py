"""An actor whose process takes a while to exit after it has closed its connections (like a
process tearing down torch), for the registry's disconnect-vs-liveness test."""

import asyncio
import atexit
import time

from miles.runtime import Actor


class SlowExitDriver(Actor):
    async def run(self) -> int:
        await asyncio.sleep(5.0)  # outlive the liveness timeout, heart-beating
        atexit.register(time.sleep, 2.0)  # silent, but for less than the timeout
        print("done, exiting slowly", flush=True)
        return 0
