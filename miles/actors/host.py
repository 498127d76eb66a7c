"""The process that hosts one actor: `python -m miles.actors.host` (started by the node daemon).

Everything it needs comes from the environment the daemon sets:
MILES_ACTOR_NAME, MILES_ACTOR_CLASS (`module:Class`), MILES_ACTOR_ROLE, MILES_REGISTRY,
MILES_RECIPE (path of the resolved recipe as JSON), MILES_NODE_RANK, MILES_HOST, MILES_INCARNATION.

If the actor class defines `async def run(self) -> int | None`, the process exits when it returns
(the exit code is its value, 0 for None); otherwise it serves until told to shut down. SIGTERM and
SIGINT stop it cleanly. Because an actor is an ordinary process, `breakpoint()` works in it when
it is run in the foreground (`miles run --foreground role`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
from pathlib import Path

from miles.actors.base import Actor, Runtime, run_event_loop
from miles.config import recipe_from_json


def load_class(path: str, base: type = Actor) -> type:
    """Import `module:Class` and check it subclasses `base`; errors name the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"class path {path!r}: expected 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"class path {path!r}: cannot import module {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"class path {path!r}: module {module_name!r} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"class path {path!r}: {obj!r} is not a subclass of {base.__name__}")
    return obj


async def host(actor: Actor, runtime: Runtime, bind_host: str) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, actor.stop)
    await actor.start(runtime, host=bind_host)
    code = 0
    try:
        if type(actor).run is not Actor.run:
            run_task = asyncio.create_task(actor.run())
            stop_task = asyncio.create_task(actor.serve_forever())
            done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if run_task in done:
                code = int(run_task.result() or 0)
            else:
                run_task.cancel()
                code = 143
        else:
            await actor.serve_forever()
    finally:
        await actor.close()
        runtime.close()
    return code


def main() -> int:
    env = os.environ
    name, cls_path = env["MILES_ACTOR_NAME"], env["MILES_ACTOR_CLASS"]
    logging.basicConfig(level=env.get("MILES_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    cls = load_class(cls_path)
    actor = cls(name=name)
    recipe_path = env.get("MILES_RECIPE")
    if recipe_path:
        actor.recipe = recipe_from_json(Path(recipe_path).read_bytes())
        actor.spec = actor.recipe.actors.get(env.get("MILES_ACTOR_ROLE", ""))
        actor.heartbeat_interval_s = actor.recipe.cluster.heartbeat_interval_s
    runtime = Runtime(registry=env.get("MILES_REGISTRY"), name=name,
                      node_rank=int(env.get("MILES_NODE_RANK", "0")))
    return run_event_loop(host(actor, runtime, env.get("MILES_HOST", "127.0.0.1")))


if __name__ == "__main__":
    sys.exit(main())
