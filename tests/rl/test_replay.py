"""The flight recorder in a real run, and `miles replay` reproducing a recorded step's loss."""

import json
import subprocess
import sys

import pytest

from miles.wire.messages import Batch, ConfirmBatch, PublishWeights, TrainResult, TrainStep
from miles.wire.recorder import read_records
from test_loop import ROOT, run_recipe


@pytest.mark.slow
@pytest.mark.timeout(700)   # a run and a replay, each with its own deadline
def test_a_recorded_step_replays_bit_for_bit_on_cpu(tmp_path):
    code, log, out = run_recipe(tmp_path, "rec", [
        "loop.num_steps=4", "loop.eval_every=0", "loop.save_every=0", "sft.steps=50",
        "logging.record_wire=true", "logging.record_steps=[3]", "logging.plot=false"],
        timeout_s=300)
    assert code == 0, log[-3000:]
    wire = out / "wire" / "driver.mlw"
    records = list(read_records(wire))
    assert {r.meta.step for r in records} == {3}  # only the chosen step
    kinds = {type(r.msg) for r in records}
    assert {Batch, TrainStep, TrainResult, ConfirmBatch, PublishWeights} <= kinds
    batch = next(r.msg for r in records if isinstance(r.msg, Batch))
    train = next(r.msg for r in records if isinstance(r.msg, TrainStep))
    assert len(train.samples) == sum(len(g.samples) for g in batch.groups) == 64
    assert (out / "wire" / "step_000003" / "pre_state").is_dir()

    rep = subprocess.run([sys.executable, "-m", "miles.cli", "replay", str(wire), "--step", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    line = json.loads(rep.stdout.strip().splitlines()[-1])
    assert line["step"] == 3 and line["world_recorded"] == 1
    assert line["bitwise_equal"], line
    assert line["replayed_loss"] == line["recorded_loss"]
    assert line["metrics_compared"] >= 5

    bad = subprocess.run([sys.executable, "-m", "miles.cli", "replay", str(wire), "--step", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not in" in bad.stderr and "recorded: [3]" in bad.stderr
