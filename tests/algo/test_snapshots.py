"""Bit-for-bit snapshots of every estimator, loss term, correction, reducer and the full objective.

Regenerate with `.venv/bin/python tests/algo/algo_snapshot_cases.py --update` (see that file, which
also explains why exactness is checked only on the platform that recorded the snapshots).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from algo_snapshot_cases import GROUPS, platform, snapshot_path, split_saved


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_snapshot_bit_exact(group: str) -> None:
    torch.set_num_threads(1)
    path = snapshot_path(group)
    assert path.exists(), f"missing {path}; run tests/algo/algo_snapshot_cases.py --update"
    with safe_open(str(path), framework="pt") as f:
        recorded_on = (f.metadata() or {}).get("platform", "unknown")
    inputs, expected = split_saved(load_file(str(path)))
    _, compute = GROUPS[group]
    actual = {k: v.detach() for k, v in compute(inputs).items()}
    assert sorted(actual) == sorted(expected)
    assert all(actual[name].dtype == expected[name].dtype for name in expected)
    if recorded_on == platform():
        mismatched = [name for name in sorted(expected) if not torch.equal(actual[name], expected[name])]
        assert not mismatched, f"{group}: outputs differ from the snapshot: {mismatched}"
        return
    warnings.warn(f"{group}: snapshot recorded on {recorded_on}, running on {platform()}: checked to rounding only")
    far = [
        name
        for name in sorted(expected)
        if not torch.allclose(actual[name].double(), expected[name].double(), rtol=1e-6, atol=1e-7)
    ]
    assert not far, f"{group}: outputs differ from the snapshot beyond rounding: {far}"
