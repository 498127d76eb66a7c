"""Actors that misbehave on purpose, for the node daemon's supervision tests."""

import asyncio
import os
import time

from miles.runtime import Actor


class LongLineDriver(Actor):
    """Prints one 1 MB line, then keeps running (and heart-beating) for a while."""

    async def run(self) -> int:
        print("A" * 1_000_000 + "|end", flush=True)
        await asyncio.sleep(float(self.options.get("stay_s", 4.0)))
        print("still alive after the long line", flush=True)
        return 0


class Waiter(Actor):
    """A main actor that waits until the job is ended by someone else."""

    async def run(self) -> int:
        print("waiting", flush=True)
        await asyncio.sleep(3600)
        return 0


class FailsOnStart(Actor):
    async def on_start(self) -> None:
        print(f"starting incarnation {self.incarnation} pid {os.getpid()}", flush=True)
        raise RuntimeError("the reward module is missing")


class CrashesLater(Actor):
    """Registers, then exits with a different code each incarnation (not a crash loop)."""

    async def run(self) -> int:
        await asyncio.sleep(0.5)
        print(f"crashing, incarnation {self.incarnation}", flush=True)
        os._exit(10 + self.incarnation)


class Freezes(Actor):
    """Registers, then blocks its event loop: no more heartbeats."""

    async def on_start(self) -> None:
        asyncio.get_running_loop().call_later(1.0, self._freeze)

    def _freeze(self) -> None:
        print("about to block the event loop", flush=True)
        time.sleep(3600)


class SlowStart(Actor):
    """An on_start that waits long (as one waiting for engines does)."""

    async def on_start(self) -> None:
        print("waiting in on_start", flush=True)
        await asyncio.sleep(3600)
