"""The sharded data plane on CUDA (NCCL, 2 GPUs): FSDP trained from `shard_batch`'s shards gives
the metrics of the whole-batch path, and a bad sample on rank 1's shard refuses on both ranks.
GPU backward kernels may add in any order, so the comparison is to a tolerance, not bitwise.

Skipped with fewer than 2 GPUs. Run: .venv/bin/python -m pytest tests/gpu/test_sharded_batch_gpu.py -q -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import run_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[1] / "backends" / "sharded_worker.py"


def test_fsdp_shards_match_the_whole_batch_on_nccl(tmp_path):
    ranks = run_ranks("fsdp:qwen3", tmp_path, world_size=2, timeout_s=400, cuda=True, worker=WORKER)
    for r in ranks:
        for name, got in r["parity"].items():
            print(name, r["rank"], "weights max abs diff", got["weights_max_abs_diff"])
            assert got["same_names"] and got["weights_moved"]
            for whole, sharded in zip(got["metrics_whole"], got["metrics_sharded"], strict=True):
                assert set(whole) == set(sharded)
                assert sharded["samples"] == whole["samples"] and sharded["tokens"] == whole["tokens"]
                for key in ("loss", "pg_loss", "grad_norm", "entropy"):
                    assert sharded[key] == pytest.approx(whole[key], rel=1e-3, abs=1e-5), (name, key)
            assert got["weights_max_abs_diff"] < 1e-3   # lr 1e-3: below one Adam step
    one = ranks[1]["refusals"]
    assert f"sample {one['first_position']}" in one["nan_reward"] and "reward" in one["nan_reward"]
    assert "refused by trainer rank 1" in ranks[0]["refusals"]["nan_reward"]
    assert ranks[0]["refusals"]["weights_unchanged"] and one["weights_unchanged"]
