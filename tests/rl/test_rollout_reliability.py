"""The rollout worker against a fake engine and an in-process buffer: back-off while the gateway
is down (no spinning through prompts), partial tokens of an aborted request counted, missing
log-probs left None, synchronous rewards off the event loop, retries regenerated in their slot
(issue 15, items 1, 2 and 13)."""

import asyncio
import inspect
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.actors.buffer import Buffer
from miles.actors.rollout import RolloutWorker
from miles.config import load_recipe
from miles.engines.client import EngineUnavailable, FinishReason, GenerateResult

sys.path.insert(0, str(Path(__file__).parent / "plugins"))
from user_plugins import CountingSource  # noqa: E402


class FakeEngine:
    """The gateway: down (connection refused) while `down`; `abort_first` ends the first request
    after 3 tokens the way a dying engine does."""

    def __init__(self, down=False, abort_first=False, logprobs=True):
        self.down, self.abort_first, self.logprobs = down, abort_first, logprobs
        self.calls = 0

    async def generate(self, ids, params, **kw):
        self.calls += 1
        await asyncio.sleep(0.001)
        if self.down:
            raise EngineUnavailable("/generate: ClientConnectorError: connection refused")
        if self.abort_first and self.calls == 1:
            return GenerateResult(rid="r", output_ids=[5, 6, 7], finish_reason=FinishReason(type="abort"))
        return GenerateResult(rid="r", output_ids=[4, 2], finish_reason=FinishReason(type="stop"),
                              output_logprobs=[-0.1, -0.2] if self.logprobs else None)

    async def health(self):
        return not self.down

    async def close(self):
        pass


class LocalRef:
    """A buffer ref that calls the handlers in-process (what the socket would)."""

    def __init__(self, actor):
        self.actor = actor

    async def call(self, msg, timeout_s=60.0, retries=0):
        out = self.actor._handlers[type(msg)](self.actor, msg)
        return await out if inspect.iscoroutine(out) else out


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def worker(engine, reward="first_answer", sets=()):
    recipe = load_recipe(text="", overrides=["rollout.n_samples_per_prompt=2", *sets])
    w = RolloutWorker()
    w.recipe, w.cfg, w.seed = recipe, recipe.rollout, 0
    w.client, w.tokenizer, w.source = engine, Tok(), CountingSource(recipe)
    from miles import plugins
    w.reward_fn = plugins.load("rollout.reward", reward)
    w.semaphore = asyncio.Semaphore(8)
    w.tokenize_prompt = lambda prompt: [1, 2, 3]
    b = Buffer()
    b.configure(groups_per_step=2, max_staleness=0)
    w.buffer = LocalRef(b)
    w._resumed.set()
    return w, b


async def test_gateway_down_pauses_admission_instead_of_burning_prompts():
    """Regression: with the gateway killed the worker started ~15,000 groups a minute; now each
    request backs off and no new group starts until the gateway answers again."""
    engine = FakeEngine(down=True)
    w, b = worker(engine, sets=["rollout.engine_retry_s=0.6", "rollout.max_retries=1"])
    w._begin([], [], "the test")
    await asyncio.sleep(3.0)
    started = w.counts["groups_started"]
    assert started <= 4, w.counts                    # the first slots, nothing more
    assert w.source.position <= 4                    # no prompts burned
    assert w.counts["requests_retried"] > 0 and not w._engines_up.is_set()
    engine.down = False                              # the gateway is back
    for _ in range(100):
        if b.queue:
            break
        await asyncio.sleep(0.1)
    assert b.queue, (w.counts, b.slot_table())
    assert w.admission_paused_s > 0
    await w._stop()


async def test_aborted_request_is_retried_from_the_prompt_and_its_tokens_counted():
    w, _ = worker(FakeEngine(abort_first=True))
    from miles.wire.messages import Sample
    import numpy as np
    s = Sample(tokens=np.array([1, 2, 3], np.int32), metadata={})
    out = await w._generate_retrying(s, seed=7)
    assert out.status == "completed" and out.tokens.tolist() == [1, 2, 3, 4, 2]  # no partial tokens
    assert w.counts["partial_tokens_dropped"] == 3 and w.counts["requests_retried"] == 1
    assert out.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2])


async def test_missing_logprobs_stay_none_not_zeros():
    w, _ = worker(FakeEngine(logprobs=False))
    from miles.wire.messages import Sample
    import numpy as np
    out = await w._generate_retrying(Sample(tokens=np.array([1], np.int32)), seed=1)
    assert out.status == "completed" and out.rollout_logprobs is None


def slow_sync_reward(sample):
    time.sleep(0.3)
    return float(threading.current_thread() is not threading.main_thread())


async def test_a_synchronous_reward_runs_off_the_event_loop():
    w, _ = worker(FakeEngine(), reward="test_rollout_reliability:slow_sync_reward")
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    t = asyncio.get_running_loop().create_task(tick())
    from miles.wire.messages import Sample
    import numpy as np
    assert await w._call_reward(Sample(tokens=np.array([1], np.int32))) == 1.0   # in a thread
    t.cancel()
    assert ticks >= 5                                 # the loop kept running meanwhile


async def test_a_retried_group_is_regenerated_in_its_slot_without_a_new_reservation():
    """The rollout side of the sync-mode deadlock: with every slot of the step reserved, the retry
    must not wait behind admission."""
    calls = {"n": 0}

    def fail_once(sample):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return 1.0 if sample.index else 0.0

    import test_rollout_reliability as me
    me.fail_once = fail_once
    w, b = worker(FakeEngine(), reward="test_rollout_reliability:fail_once")
    w._begin([], [], "the test")
    for _ in range(100):
        if len(b.queue) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(b.queue) == 2 and b.counts["retried"] == 1, (b.slot_table(), w.counts)
    assert b.next_slot == 2                          # the retry used its own slot
    await w._stop()


async def test_release_slot_is_retried_and_a_final_failure_is_loud(capsys):
    w, b = worker(FakeEngine())
    s = (await w.buffer.call(__import__("miles.wire.messages", fromlist=["Reserve"]).Reserve())).slot
    real, fails = w.buffer, {"n": 2}

    class Flaky:
        async def call(self, msg, timeout_s=60.0, retries=0):
            if fails["n"] > 0:
                fails["n"] -= 1
                raise ConnectionError("buffer unreachable")
            return await real.call(msg)

    w.buffer = Flaky()
    await w._release(s, "prompt failed for good")
    assert b.slot_table() == [] and b.counts["dropped"] == 1     # released on the third try
    fails["n"] = 100
    await w._release(99, "x")
    assert "ERROR [rollout] slot 99 could not be released" in capsys.readouterr().out
