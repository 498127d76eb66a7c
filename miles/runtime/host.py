"""The process that hosts one actor: `python -m miles.runtime.host` (started by the node daemon).

Everything it needs comes from the environment the daemon sets:
MILES_ACTOR_NAME, MILES_ACTOR_CLASS (`module:Class`), MILES_ACTOR_ROLE, MILES_REGISTRY,
MILES_RECIPE (path of the resolved recipe as JSON), MILES_NODE_RANK, MILES_HOST, MILES_INCARNATION.

If the actor class defines `async def run(self) -> int | None`, the process exits when it returns
(the exit code is its value, 0 for None); otherwise it serves until told to shut down. Because an
actor is an ordinary process, `breakpoint()` works in it when it is run in the foreground
(`miles run --foreground role`).

Design decisions:
- SIGTERM and SIGINT stop it quietly (exit code 143 for an actor whose `run` was cut short, 0
  for one that only serves): the daemon stops every actor at once, so errors that peers going
  away cause meanwhile are expected, and are neither raised nor logged as tracebacks. A Ctrl-C
  before the event loop runs (during imports) exits with 130, also without a traceback.
- A warm spare (MILES_SPARE_GO, `restart.spare`) imports its actor's modules and waits for the
  daemon's go before it starts as the next incarnation (`wait_as_spare`).
- A failure prints its traceback and then, as the last line, `error: <Type>: <first line>`: the
  daemon quotes that line as the cause, and compares it between incarnations to spot a crash
  loop. A bad class path is a message, not a traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from miles import plugins
from miles.runtime.actor import Actor
from miles.runtime.refs import Runtime, run_event_loop
from miles.config import recipe_from_json

log = logging.getLogger(__name__)


def load_class(path: str, role: str = "<role>") -> type:
    """Import `module:Class`, checked against the `actors.<role>.class` contract."""
    return plugins.load(f"actors.{role}.class", path)


async def host(actor: Actor, runtime: Runtime, bind_host: str) -> int:
    loop = asyncio.get_running_loop()
    stopping = False

    def on_signal() -> None:
        nonlocal stopping
        stopping = True
        loop.set_exception_handler(_quiet)
        starting.cancel()  # an on_start may wait minutes (for engines): stop means now
        actor.stop()

    starting = asyncio.ensure_future(actor.start(runtime, host=bind_host))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    code, failure = 0, None
    try:
        await starting
        if type(actor).run is not Actor.run:
            run_task = asyncio.create_task(actor.run())
            stop_task = asyncio.create_task(actor.serve_forever())
            await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if run_task.done() and not run_task.cancelled() and run_task.exception() is not None:
                # A peer stopped by the same shutdown can fail our call before our own signal
                # is handled: give that signal a moment before calling this a failure.
                await asyncio.wait({stop_task}, timeout=0.5)
            stop_task.cancel()
            if stopping or not run_task.done():
                run_task.cancel()
                await asyncio.gather(run_task, return_exceptions=True)
                code = 143
            else:
                code = int(run_task.result() or 0)
        else:
            await actor.serve_forever()
    except asyncio.CancelledError:
        if not stopping:
            raise
        code = 143
    except Exception as e:  # caught here, so its traceback starts at the actor's own frames
        failure = e
    finally:
        await _close(actor, quiet=stopping or failure is not None)
        runtime.close()
    if failure is not None:
        _report(failure)
        return 1
    return code


def _report(e: BaseException) -> None:
    traceback.print_exception(e, file=sys.stdout)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"error: {type(e).__name__}" + (f": {first}" if first else ""), flush=True)


def _quiet(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Once stopping, errors of tasks left behind are the shutdown's, not news."""
    log.debug("while stopping: %s", context.get("exception") or context.get("message"))


async def _close(actor: Actor, quiet: bool) -> None:
    if getattr(actor, "server", None) is None:  # start() failed before binding
        return
    try:
        await actor.close()
    except Exception as e:  # one line: a failure to stop must not hide why we stopped
        if not quiet:
            print(f"{actor.name}: error while stopping: {type(e).__name__}: {e}", flush=True)


def wait_as_spare(cls: type, go: Path) -> None:
    """A warm spare (`restart.spare`): import what the actor's start needs (`cls.preload`), then
    wait until the node daemon hands this process the next incarnation by creating `go`. The
    daemon starts a spare while the actor serves, so a restart skips Python's start and the
    imports (seconds of CPU for torch and transformers)."""
    for module in getattr(cls, "preload", ()):
        importlib.import_module(module)
    Path(f"{go}.ready").touch()  # for the daemon's log line and the chaos bench
    while not go.exists():
        time.sleep(0.05)
    go.unlink(missing_ok=True)
    Path(f"{go}.ready").unlink(missing_ok=True)


def main() -> int:
    env = os.environ
    name, cls_path = env["MILES_ACTOR_NAME"], env["MILES_ACTOR_CLASS"]
    try:
        logging.basicConfig(level=env.get("MILES_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            stream=sys.stdout)
        try:
            cls = load_class(cls_path, env.get("MILES_ACTOR_ROLE") or name)
        except ValueError as e:
            print(f"error: {e}", flush=True)
            return 1
        if env.get("MILES_SPARE_GO"):
            wait_as_spare(cls, Path(env["MILES_SPARE_GO"]))
        actor = cls(name=name)
        recipe_path = env.get("MILES_RECIPE")
        if recipe_path:
            actor.recipe = recipe_from_json(Path(recipe_path).read_bytes())
            actor.spec = actor.recipe.actors.get(env.get("MILES_ACTOR_ROLE", ""))
            actor.heartbeat_interval_s = actor.recipe.cluster.heartbeat_interval_s
        runtime = Runtime(registry=env.get("MILES_REGISTRY"), name=name,
                          node_rank=int(env.get("MILES_NODE_RANK", "0")))
        return run_event_loop(host(actor, runtime, env.get("MILES_HOST", "127.0.0.1")))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Exception as e:
        _report(e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
