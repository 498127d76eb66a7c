"""Megatron checkpoints through dist_checkpointing: save at one layout, resume at another.

megatron_ckpt_worker.py runs both layouts in one 2-rank gloo process group. Tolerances: fp32
everywhere; TP=2 and TP=1 sum the same products in a different order (vocab-parallel softmax,
row-parallel reductions), so the resumed step's loss matches the uninterrupted one to 1e-5
relative, and the grad norm to 1e-4 (a norm of many summed terms).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend_helpers import run_ranks

WORKER = Path(__file__).with_name("megatron_ckpt_worker.py")


@pytest.mark.parametrize("spec", ["2,1->1,1", "2,1->1,2"], ids=["tp2-to-dp2", "tp2-to-pp2"])
def test_megatron_checkpoint_resumes_at_another_layout(spec, tmp_path):
    ranks = run_ranks(f"reshard:qwen3:{spec}", tmp_path, world_size=2, timeout_s=280, worker=WORKER)
    for r in ranks:
        want, got = r["uninterrupted"], r["resumed"]
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * max(1.0, abs(want["loss"])), (want, got)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], (want, got)
        # the optimizer's moments came back too: the step after the resumed one still matches
        assert abs(r["resumed_step3"] - r["uninterrupted_step3"]) <= 1e-4 * max(1.0, abs(r["uninterrupted_step3"]))
        # a fresh model at the second layout is measurably elsewhere (the load did something)
        assert abs(r["fresh_second_step"] - want["loss"]) > 1e-3
        assert "incomplete" in r["incomplete_error"]
