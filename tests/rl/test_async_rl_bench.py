"""bench/async_rl.py's reward-curve verdict: a difference counts as noise only against the
seed-to-seed spread of the runs themselves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("async_rl_bench", ROOT / "bench" / "async_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_curves_within_noise_only_when_the_gap_is_under_two_standard_errors():
    compare = _bench().compare_curves
    rng = np.random.default_rng(0)
    base = np.linspace(0.4, 0.8, 16)
    sync = base + rng.normal(0, 0.03, (3, 16))
    same = compare(sync, base + rng.normal(0, 0.03, (3, 16)), last=5)
    assert same["within_noise"] is True and abs(same["final_diff"]) < 2 * same["diff_se"]
    worse = compare(sync, base - 0.2 + rng.normal(0, 0.03, (3, 16)), last=5)
    assert worse["within_noise"] is False and worse["final_diff"] < -0.1
    # the final reward is the mean of the last `last` points: a late gap counts in full
    late = sync.copy()
    late[:, -5:] += 0.3
    assert compare(sync, late, last=5)["final_diff"] == 0.3
    one = compare(sync[:1], late[:1], last=5)  # one seed: no noise estimate
    assert one["within_noise"] is None and one["diff_se"] is None
