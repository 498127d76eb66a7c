"""On CUDA: every snapshot group runs, is deterministic run to run, and matches the CPU snapshot.

CUDA kernels (exp, reductions) need not round like the CPU ones, so CPU agreement is allclose; the
bit-exact pin is the CPU snapshot. Skipped where CUDA is absent (CI).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from algo_snapshot_cases import GROUPS, snapshot_path, split_saved

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Per-sample metadata a backend may keep on the CPU next to GPU token tensors.
CPU_METADATA = {"cu_seqlens", "rewards", "group_ids", "rollout_ids"}


def run_on_cuda(group: str, metadata_on_cpu: bool) -> tuple[dict, dict, dict]:
    inputs, expected = split_saved(load_file(str(snapshot_path(group))))
    placed = {
        k: v if (metadata_on_cpu and k in CPU_METADATA) else v.cuda() for k, v in inputs.items()
    }
    _, compute = GROUPS[group]
    first = {k: v.detach() for k, v in compute(placed).items()}
    second = {k: v.detach() for k, v in compute(placed).items()}
    return first, second, expected


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_cuda_is_deterministic_and_matches_cpu(group: str) -> None:
    first, second, expected = run_on_cuda(group, metadata_on_cpu=False)
    for name, value in expected.items():
        assert first[name].is_cuda, name
        assert torch.equal(first[name], second[name]), f"{name} differs between two CUDA runs"
        assert torch.allclose(first[name].cpu(), value, rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("group", ["advantages", "objective"])
def test_entry_points_accept_cpu_metadata_with_cuda_tokens(group: str) -> None:
    first, _, expected = run_on_cuda(group, metadata_on_cpu=True)
    for name, value in expected.items():
        assert torch.allclose(first[name].cpu(), value, rtol=1e-5, atol=1e-5), name
