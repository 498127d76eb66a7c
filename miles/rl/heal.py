"""Healing a killed trainer rank from the in-memory snapshots (`loop.snapshot`), without a job
restart: what the driver does when a call to a trainer rank fails with `ActorDied`.

    wait for every rank's new incarnation      (the node daemon restarts a dead rank's group)
    ask each which train calls it holds        (its snapshot file: the newest, or one older)
    restore the newest one every rank holds
    train the retained batch again if the snapshot is one call older (the step in flight)
    re-send the call that failed               (a TrainStep already made answers with its metrics)

Design decisions:
- The driver numbers its train calls (`TrainStep.train_call`) and keeps the last one's messages
  (one batch), so the step in flight, and only it, can be trained again. The trainer copies its
  state after it answered a call, so a rank killed before the copy finished holds the call
  before (its other slot); one killed after it holds the call itself and answers its re-send
  with the recorded metrics. Either way the batch was confirmed to the buffer once and the
  weights took its update once: nothing is trained twice, nothing is lost.
- Anything the snapshots cannot give (no keeper directory, `loop.snapshot = false`, ranks that
  hold no common call, a call older than the one in flight, a rank on a node whose daemon did not
  restart it) falls back to the job restart from the newest disk checkpoint (`TrainerDied`,
  exit code 75), saying why in one line.
- Each heal is one `heal` record in metrics.jsonl: when the death was seen (wall clock, so a
  chaos bench can subtract its kill time), the restart, the restore, the redone call and the
  re-sent one, in seconds.
"""

from __future__ import annotations

import asyncio
import time

from miles.runtime import ActorDied
from miles.wire.messages import RestoreSnapshot, TrainStep
from miles.wire.snapshot import common_step

MAX_HEALS_PER_CALL = 3  # a call whose rank dies again while it is healed is healed again, so far


class TrainerDied(ActorDied):
    """A trainer rank died and could not be healed: the job restarts from its disk checkpoint."""


class Healer:
    """The driver's side of healing: numbers train calls, keeps the last, heals the ranks."""

    def __init__(self, driver):
        self.driver = driver
        self.train_call = 0
        self.retained: list[TrainStep] | None = None   # the last train call's messages
        self.heals = 0

    def stamp(self, msgs: list[TrainStep]) -> list[TrainStep]:
        """Number a new train call and keep its messages until the next one."""
        self.train_call += 1
        for m in msgs:
            m.train_call = self.train_call
        self.retained = msgs
        return msgs

    async def heal(self, error: ActorDied, doing: str) -> dict:
        """Bring every rank back at the last train call (see the module docstring), or raise
        `TrainerDied`. Returns the heal record's fields."""
        d, r = self.driver, self.driver.recipe
        seen_at, t0 = time.time(), time.monotonic()
        if not r.loop.snapshot:
            raise TrainerDied(f"{error} (loop.snapshot = false)") from None
        print(f"[driver] {error} during {doing}: healing the trainer ranks from their in-memory "
              f"snapshots (train call {self.train_call})", flush=True)
        try:
            await asyncio.gather(*(t.wait_restarted(r.cluster.start_timeout_s) for t in d.trainers))
        except Exception as e:  # noqa: BLE001 - every way of not coming back ends the same
            raise TrainerDied(f"{error}; a trainer rank did not come back within "
                              f"cluster.start_timeout_s = {r.cluster.start_timeout_s} s ({e})") from None
        restarted = time.monotonic()
        held = await self._all(RestoreSnapshot(train_call=-1))
        calls = [h.train_calls for h in held]
        target = common_step(calls)
        oldest_ok = max(0, self.train_call - 1)
        if target is None or target < oldest_ok:
            why = "; ".join(f"trainer/{i}: {h.detail or h.train_calls}" for i, h in enumerate(held))
            raise TrainerDied(f"{error}; no in-memory snapshot of train call {oldest_ok} or "
                              f"{self.train_call} on every rank ({why}): falling back to the disk "
                              "checkpoint") from None
        restored = await self._all(RestoreSnapshot(train_call=target))
        t_restored = time.monotonic()
        redone = 0
        if target < self.train_call and self.retained is not None:
            await self._all(self.retained)  # the step in flight, trained once more from its start
            redone = 1
        self.heals += 1
        record = {"heal/seen_at": round(seen_at, 3), "heal/train_call": target,
                  "heal/restart_s": round(restarted - t0, 3),
                  "heal/restore_s": round(max(s.restore_s for s in restored), 3),
                  "heal/restore_wall_s": round(t_restored - restarted, 3),
                  "heal/redo_s": round(time.monotonic() - t_restored, 3),
                  "heal/redone_calls": redone, "heal/count": self.heals}
        print(f"[driver] trainer ranks healed from train call {target} in "
              f"{time.monotonic() - t0:.1f} s (restart {record['heal/restart_s']:.1f} s, restore "
              f"{record['heal/restore_wall_s']:.1f} s, redone {redone} call); re-sending the "
              f"{doing}", flush=True)
        return record

    async def _all(self, msg) -> list:
        d = self.driver
        msgs = msg if isinstance(msg, list) else [msg] * len(d.trainers)
        try:
            return await gather_or_cancel([t.call(m, timeout_s=d.recipe.loop.timeout_s)
                                           for t, m in zip(d.trainers, msgs)])
        except ActorDied as e:
            raise TrainerDied(f"a trainer rank died again while it was healed: {e}") from None


async def gather_or_cancel(coros) -> list:
    """`asyncio.gather`, but the first failure cancels the other calls (a rank blocked in a
    collective with a dead one would otherwise wait for its timeout)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
