"""The flight recorder writes whole messages (arrays included) for the chosen steps only."""

import numpy as np
import pytest

from miles.wire.messages import Sample, TrainResult, TrainStep
from miles.wire.recorder import TornRecord, WireRecorder, read_records


def _sample(n: int) -> Sample:
    return Sample(tokens=np.arange(n, dtype=np.int32), response_length=2,
                  rollout_logprobs=np.array([-0.5, -1.25], np.float32), reward=1.0)


def test_records_only_chosen_steps_and_arrays_come_back_bit_for_bit(tmp_path):
    rec = WireRecorder(tmp_path / "driver.mlw", steps={2})
    for step in (1, 2, 3):
        rec.step = step
        rec.record("call", "trainer/0", TrainStep(samples=[_sample(5 + step)]))
        rec.record("reply", "trainer/0", TrainResult(metrics={"loss": 0.1 * step}))
    rec.close()
    records = list(read_records(tmp_path / "driver.mlw"))
    assert [(r.meta.step, r.meta.direction, type(r.msg).__name__) for r in records] == [
        (2, "call", "TrainStep"), (2, "reply", "TrainResult")]
    sample = records[0].msg.samples[0]
    assert sample.tokens.tolist() == list(range(7))
    assert sample.rollout_logprobs.tobytes() == np.array([-0.5, -1.25], np.float32).tobytes()
    assert records[1].msg.metrics == {"loss": pytest.approx(0.2)}
    assert records[0].meta.peer == "trainer/0"


def test_every_step_when_none_chosen_and_a_torn_tail_is_named(tmp_path):
    path = tmp_path / "driver.mlw"
    rec = WireRecorder(path)
    rec.step = 0
    rec.record("call", "x", TrainResult(metrics={}))  # step 0 (warm-start): never recorded
    for step in (1, 2):
        rec.step = step
        rec.record("reply", "x", TrainResult(metrics={"loss": float(step)}))
    rec.close()
    assert [r.meta.step for r in read_records(path)] == [1, 2]
    path.write_bytes(path.read_bytes()[:-3])
    got = []
    with pytest.raises(TornRecord, match="ends inside a record"):
        for r in read_records(path):
            got.append(r.meta.step)
    assert got == [1]
