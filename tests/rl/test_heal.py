"""The driver's side of healing a killed trainer rank (miles/rl/heal.py) against fake ranks that
keep a double-buffered snapshot the way the trainer does: the step in flight is redone at most
once, a re-sent call the snapshot already holds is not trained twice, and whatever the snapshots
cannot serve ends the job for a restart from disk, saying why."""

from __future__ import annotations

import pytest

from miles.config import load_recipe
from miles.loop import LoopDriver
from miles.rl.heal import Healer, TrainerDied
from miles.runtime import ActorDied
from miles.wire.messages import RestoreSnapshot, SnapshotState, TrainResult, TrainStep


class FakeRank:
    """A trainer rank: `trained` is its model's state (the train calls applied, in order);
    `slots` the train calls its snapshot file holds (the newest two); `die_on` kills it on
    receiving that message kind, once (after training, if `after` is set)."""

    def __init__(self, die_on: str = "", after: bool = False, keeper: bool = True, snapshot_done: bool = True):
        self.trained, self.slots, self.alive, self.restarts = [], [], True, 0
        self.die_on, self.after, self.keeper, self.snapshot_done = die_on, after, keeper, snapshot_done
        self.name = "trainer/0"

    async def call(self, msg, timeout_s=60.0, retries=0):
        if not self.alive:
            raise ActorDied(f"actor {self.name!r} is gone")
        kind = type(msg).__name__
        if kind == self.die_on and not self.after:
            return self._die()
        if isinstance(msg, TrainStep):
            if msg.train_call == (self.trained[-1] if self.trained else 0):
                return TrainResult(metrics={"loss": -1.0})       # the recorded metrics
            self.trained.append(msg.train_call)
            if self.keeper and (self.snapshot_done or kind != self.die_on):
                self.slots = [*self.slots, msg.train_call][-2:]
            if kind == self.die_on:
                return self._die()
            return TrainResult(metrics={"loss": float(msg.train_call)})
        if isinstance(msg, RestoreSnapshot):
            if msg.train_call < 0:
                return SnapshotState(train_calls=sorted(self.slots, reverse=True),
                                     detail="" if self.keeper else "no snapshot keeper")
            self.trained = list(range(1, msg.train_call + 1))   # the state after that call
            return SnapshotState(train_calls=self.slots, restored=msg.train_call, restore_s=0.01)
        return "ok"

    def _die(self):
        self.alive, self.die_on = False, ""
        raise ActorDied(f"actor {self.name!r} died")

    async def wait_restarted(self, timeout_s=60.0):
        self.alive, self.restarts = True, self.restarts + 1
        self.trained = []                                   # a new process: the state is gone
        return self.restarts


def _driver(rank, snapshot=True):
    d = LoopDriver("driver")
    d.recipe = load_recipe("recipes/chaos_cpu.toml", [f"loop.snapshot={str(snapshot).lower()}"])
    d.trainers, d.healer, d.log = [rank], None, None
    d.healer = Healer(d)
    return d


async def _steps(d, n):
    for _ in range(n):
        msgs = d.healer.stamp([TrainStep(samples=[])])
        await d.on_all_trainers(msgs)


@pytest.mark.parametrize("after,snapshot_done", [(False, True), (True, False), (True, True)])
async def test_a_rank_killed_during_a_train_call_is_healed_and_the_call_applied_once(after, snapshot_done):
    """Killed before training (snapshot of the call before), after training but before its copy
    finished (the same), or after the copy (the snapshot holds the call itself)."""
    rank = FakeRank(die_on="", after=after, snapshot_done=snapshot_done)
    d = _driver(rank)
    await _steps(d, 2)
    rank.die_on = "TrainStep"
    await _steps(d, 1)
    await _steps(d, 1)
    assert rank.trained == [1, 2, 3, 4] and rank.restarts == 1 and d.healer.heals == 1


async def test_a_rank_killed_while_publishing_redoes_the_step_its_snapshot_missed():
    rank = FakeRank(snapshot_done=True)
    d = _driver(rank)
    await _steps(d, 2)
    rank.slots = [1]                  # the copy of call 2 was cut by the kill (a torn slot)
    rank.die_on = "PublishWeights"
    from miles.wire.messages import PublishWeights
    await d.on_all_trainers(PublishWeights(version=3))
    assert rank.trained == [1, 2] and d.healer.heals == 1


async def test_no_snapshot_to_heal_from_ends_the_job_for_a_restart_from_disk():
    rank = FakeRank(keeper=False)
    d = _driver(rank)
    await _steps(d, 2)
    rank.die_on = "TrainStep"
    with pytest.raises(TrainerDied, match="no in-memory snapshot of train call 2 or 3.*no snapshot "
                                          "keeper.*falling back to the disk checkpoint"):
        await _steps(d, 1)


async def test_snapshots_off_end_the_job_at_once():
    rank = FakeRank(die_on="TrainStep")
    d = _driver(rank, snapshot=False)
    with pytest.raises(TrainerDied, match=r"loop.snapshot = false"):
        await _steps(d, 1)
    assert rank.restarts == 0
