"""Optimizer-state offload on the Megatron backend (train.optimizer_offload = cpu | nvme): with real
gloo ranks, two steps on the same batch leave every parameter bit-identical to offload "none",
the moments live in the offload store (not on the optimizer), and a checkpoint resumes the run
bit for bit, also into another offload setting. megatron_offload_worker.py runs the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_helpers import run_ranks

WORKER = Path(__file__).with_name("megatron_offload_worker.py")


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 1), (2, 2)], ids=["1rank", "dp2", "tp2"])
def test_megatron_offload_is_bit_identical_and_resumes(world_size, tp, tmp_path):
    ranks = run_ranks(f"offload:{tp}", tmp_path, world_size=world_size, timeout_s=290, worker=WORKER)
    for r in ranks:
        d = r["digests"]
        assert len(d["none"]) >= 10
        assert d["cpu"] == d["none"], "offload 'cpu' changed the parameters"
        assert d["nvme"] == d["none"], "offload 'nvme' changed the parameters"
        assert r["losses"]["cpu"] == r["losses"]["none"] == r["losses"]["nvme"]
        # the second step moved the weights (the comparison is not of two untouched models)
        assert r["losses"]["none"][1] != r["losses"]["none"][0]
        for offload in ("cpu", "nvme"):
            assert r[f"buckets_{offload}"] > 10
            # both steps streamed every moment in and out of the store once
            assert r[f"read_bytes_{offload}"] == 2 * r[f"moment_bytes_{offload}"]
            assert r[f"state_keys_{offload}"] == ["step"]
        assert r["nvme_files"] == r["buckets_nvme"]
        for pair in ("nvme_nvme", "cpu_none", "none_cpu"):
            assert r[f"resumed_{pair}"] == d["none"], f"resume {pair} differs from two steps straight"
        assert r["resumed_state_keys"] == ["step"]
