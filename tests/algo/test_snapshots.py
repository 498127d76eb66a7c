"""Bit-for-bit snapshots of every estimator, loss term, correction, reducer and the full objective.

Regenerate with `.venv/bin/python tests/algo/algo_snapshot_cases.py --update` (see that file).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from algo_snapshot_cases import GROUPS, snapshot_path, split_saved


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_snapshot_bit_exact(group: str) -> None:
    torch.set_num_threads(1)
    path = snapshot_path(group)
    assert path.exists(), f"missing {path}; run tests/algo/algo_snapshot_cases.py --update"
    inputs, expected = split_saved(load_file(str(path)))
    _, compute = GROUPS[group]
    actual = {k: v.detach() for k, v in compute(inputs).items()}
    assert sorted(actual) == sorted(expected)
    mismatched = [
        name
        for name in sorted(expected)
        if actual[name].dtype != expected[name].dtype or not torch.equal(actual[name], expected[name])
    ]
    assert not mismatched, f"{group}: outputs differ from the snapshot: {mismatched}"
