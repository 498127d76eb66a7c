"""A real run logs every publish's stall time and its parts in the step metrics (weights/...)."""

import pytest
from test_loop import records, run_recipe


@pytest.mark.slow
def test_every_step_logs_stall_time_that_adds_up(tmp_path):
    code, log, out = run_recipe(tmp_path, "stall", ["loop.num_steps=3", "loop.eval_every=0",
                                                    "loop.save_every=0", "logging.plot=false"],
                                timeout_s=400)
    assert code == 0, log[-3000:]
    train = records(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        parts = sum(r[f"weights/{k}_s"] for k in ("pause", "transfer", "load", "version", "resume"))
        # the log rounds each value to 1e-6: six rounded figures differ from their sum by < 3e-6
        assert 0 < r["weights/stall_s"] == pytest.approx(parts, abs=3e-6), r
        assert r["weights/stall_s"] <= r["weights/publish_s"] <= r["perf/publish_s"]
        assert r["weights/bytes"] > 0
