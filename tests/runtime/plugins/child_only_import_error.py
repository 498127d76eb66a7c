"""Imports in the daemon (which checks class paths) but not in an actor process: the way a module
missing on one node, or a dependency that fails only under the actor's environment, looks."""

import os

from miles.runtime import Actor

if os.environ.get("MILES_ACTOR_NAME"):
    import no_such_module_in_actor_processes  # noqa: F401


class Sink(Actor):
    pass
