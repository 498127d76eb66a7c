"""R3 in the Megatron backend on CUDA (NCCL, megatron's alltoall dispatcher, variable row lengths):
the same worker and checks as tests/backends/test_r3_megatron.py. One GPU: TP=PP=EP=1; two GPUs:
EP=2 and PP=2.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_r3_megatron_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import run_ranks  # noqa: E402
from test_r3_megatron import WORKER, check_ranks  # noqa: E402

# fp32 on CUDA: recompute may reorder reductions (atomics), so the gradient norms agree less tightly
GRAD_RTOL = 1e-4


def test_r3_one_gpu(tmp_path):
    ranks = run_ranks("r3:1,1,1", tmp_path, world_size=1, timeout_s=300, cuda=True, worker=WORKER)
    check_ranks(ranks, pp=False, grad_rtol=GRAD_RTOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("sizes", ["1,1,2", "1,2,1"], ids=["ep2", "pp2"])
def test_r3_two_gpus(sizes, tmp_path):
    ranks = run_ranks(f"r3:{sizes}", tmp_path, world_size=2, timeout_s=300, cuda=True, worker=WORKER)
    check_ranks(ranks, pp=sizes == "1,2,1", grad_rtol=GRAD_RTOL)
