"""The teacher's engine fleet (`[teacher]`, miles/engines/fleet/teacher.py): launched by the engine
fleet's own code from `[teacher.engine]` and the teacher's model, logs under `<run>/teacher/logs/`;
a killed teacher engine comes back serving at once (it never waits for weights), and it scores
prompt log-probs through the gateway. Real engines, a real smg, 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from miles.runtime import Runtime
from miles.engines.fleet import TeacherFleet
from miles.config import Recipe, RunConfig
from miles.engines.client import EngineClient
from miles.engines.config import EngineConfig
from miles.rl.config import ModelConfig, TeacherConfig
from miles.rl.teacher_scores import score_sample
from miles.wire.messages import GetEngines, Sample


async def _until(what: str, predicate, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.1)


async def test_a_killed_teacher_engine_serves_again_without_a_publish(tmp_path, tiny_qwen3):
    engine = EngineConfig(start_timeout_s=120.0, health_interval_s=0.3, num_engines=1)
    recipe = Recipe(run=RunConfig(output_dir=str(tmp_path / "run")), model=ModelConfig(path="/no/student"),
                    teacher=TeacherConfig(path=str(tiny_qwen3), engine=engine))
    fleet = TeacherFleet()
    fleet.recipe = recipe
    runtime = Runtime()
    await fleet.start(runtime)
    ref = runtime.ref_at(fleet.server.endpoint, "teacher_engines")
    sample = Sample(tokens=np.arange(10, 19, dtype=np.int32), response_length=4)
    try:
        before = await ref.call(GetEngines(), timeout_s=120)
        assert before.model_path == str(tiny_qwen3) and len(before.engine_urls) == 1
        assert (Path(tmp_path) / "run" / "teacher" / "logs" / "engine0.log").exists()
        async with EngineClient(before.gateway_url) as client:
            first = await score_sample(client, sample)
        fleet.slots[0].engine.process.kill()

        async def serving_again():
            s = await ref.call(GetEngines(), timeout_s=10)
            return s if s.engine_urls and s.engine_urls != before.engine_urls else None
        after = await _until("the killed teacher engine serves again", serving_again)
        assert after.pending_urls == [] and after.generation > before.generation
        async with EngineClient(after.gateway_url) as client:   # the gateway routes to it
            again = await _until("the gateway routes to the restarted engine",
                                 lambda: _score_or_none(client, sample))
        np.testing.assert_array_equal(again, first)   # the same frozen weights
    finally:
        await fleet.close()
        runtime.close()


async def _score_or_none(client, sample):
    try:
        return await score_sample(client, sample)
    except Exception:  # noqa: BLE001 - the gateway may not list it yet
        return None
