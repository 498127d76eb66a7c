"""The driver's pieces against fake actors: restarted engines get the current weights while the
driver waits for a batch, and fleet/external evaluation gets HF weights only, not a resume
point (issue 15, items 2 and 9)."""

import asyncio

from miles.config import load_recipe
from miles.loop import LoopDriver
from miles.wire.messages import (Batch, ConfirmBatch, EngineSet, EnginesUpdated, EvalResult,
                                 Evaluate, GetBatch, GetEngines, Ok, PublishWeights,
                                 SaveCheckpoint)


class Fake:
    """A ref that records what it was sent and answers with `answer(msg)`."""

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    async def call(self, msg, timeout_s=60.0, retries=0):
        self.sent.append(msg)
        out = self.answer(msg)
        return await out if asyncio.iscoroutine(out) else out


class Log:
    def __init__(self):
        self.records = []

    def log(self, kind, step, metrics, **extra):
        self.records.append((kind, step, metrics, extra))


def driver(tmp_path, sets=()):
    d = LoopDriver()
    d.recipe = load_recipe(text="", overrides=[f'run.output_dir="{tmp_path}"',
                                               "engine.health_interval_s=0.05", *sets])
    d.version, d.engine_generation, d.run_id = 3, 1, "test"
    d.pending_evals, d.log = [], Log()
    return d


async def test_a_restarted_engine_gets_the_current_weights_while_the_driver_waits(tmp_path):
    d = driver(tmp_path)
    engine_sets = iter([EngineSet(gateway_url="g", engine_urls=["e1"], model_path="m", generation=1)] * 2
                       + [EngineSet(gateway_url="g", engine_urls=["e1"], pending_urls=["e2"],
                                    model_path="m", generation=2)] * 100)
    d.engines = Fake(lambda m: next(engine_sets) if isinstance(m, GetEngines) else Ok())
    d.trainers = [Fake(lambda m: Ok()) for _ in range(2)]

    async def slow_batch(msg):
        await asyncio.sleep(0.5)
        return Batch(groups=[], version=3)

    d.buffer = Fake(lambda m: slow_batch(m) if isinstance(m, GetBatch) else Ok())
    batch, request_id = await d.next_batch(step=4)
    gets = [m for m in d.buffer.sent if isinstance(m, GetBatch)]
    assert request_id == "test-step4" and [m.request_id for m in gets] == ["test-step4"]
    for t in d.trainers:  # every rank, the same call: the current version to serving + pending
        assert [(m.version, m.engine_urls) for m in t.sent] == [(3, ["e1", "e2"])]
    told = [m for m in d.engines.sent if isinstance(m, EnginesUpdated)]
    assert [(m.generation, m.version) for m in told] == [(2, 3)] and d.engine_generation == 2
    await d.buffer_call(ConfirmBatch(request_id=request_id))


async def test_fleet_eval_gets_hf_weights_outside_the_checkpoints(tmp_path):
    d = driver(tmp_path, ['eval.mode="external"', 'eval.command="true {checkpoint}"'])
    d.trainers = [Fake(lambda m: Ok())]
    d.evaluator = Fake(lambda m: EvalResult(step=m.step, version=m.version, ok=True))
    await d.evaluate(step=7, version=8, wait=True)
    saves = [m for m in d.trainers[0].sent if isinstance(m, SaveCheckpoint)]
    want = str(tmp_path / "eval" / "step_000007")
    assert [(s.path, s.hf, s.extra_state) for s in saves] == [(want, True, {})]
    (ev,) = [m for m in d.evaluator.sent if isinstance(m, Evaluate)]
    assert ev.checkpoint_dir == want
    assert not (tmp_path / "checkpoints").exists()   # no resume point, no optimizer state
