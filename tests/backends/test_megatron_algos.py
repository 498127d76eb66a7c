"""PPO (a critic) and on-policy distillation (a teacher) on the Megatron backend, 2 gloo ranks.

megatron_algo_worker.py runs each scenario; figures are checked here. Tolerances: fp32; the
Megatron critic at TP=2 and the FSDP critic at DP=2 sum the same products in different orders,
so the zero-head first step (values 0, the same returns) agrees to 1e-6 relative, and the
critic's gradient norm and the second step's value loss (after one critic update) to 1e-5
(measured on a 2-core CPU: both agree to ~1e-7).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend_helpers import run_ranks

WORKER = Path(__file__).with_name("megatron_algo_worker.py")


# one layout of each algorithm in CI, the other `extended` (MILES_TEST_EXTENDED=1): the layouts
# themselves are tests/backends/test_megatron_backend.py's
@pytest.mark.parametrize("layout", ["2,1", pytest.param("1,2", marks=pytest.mark.extended)],
                         ids=["tp2", "pp2"])
def test_megatron_ppo_critic_learns_resumes_and_matches_fsdp(layout, tmp_path):
    ranks = run_ranks(f"ppo:{layout}", tmp_path, world_size=2, timeout_s=400, worker=WORKER)
    r = ranks[0]
    hist = r["history"]
    assert hist[0]["explained_variance"] == pytest.approx(0.0, abs=1e-9)  # zero head: every value 0
    assert hist[-1]["value_loss"] < 0.3 * hist[0]["value_loss"], [h["value_loss"] for h in hist]
    # explained variance is measured before each update: the 7th step's (after_save) sees 6 updates
    ev = [h["explained_variance"] for h in hist] + [r["after_save"]["explained_variance"]]
    assert ev[-1] > 0.5 and ev[-1] > ev[1], ev
    assert hist[-1]["critic_step"] == 6.0
    # the critic (weights, Adam state, step) came back with the policy
    assert r["after_load"]["value_loss"] == pytest.approx(r["after_save"]["value_loss"], rel=1e-6)
    assert r["after_load"]["critic_step"] == r["after_save"]["critic_step"] == 7.0
    # one step's critic figures equal the FSDP critic's on the same batch
    fsdp = r["fsdp"]
    assert hist[0]["value_loss"] == pytest.approx(fsdp[0]["value_loss"], rel=1e-6)
    assert hist[0]["critic_grad_norm"] == pytest.approx(fsdp[0]["critic_grad_norm"], rel=1e-5)
    assert hist[1]["value_loss"] == pytest.approx(fsdp[1]["value_loss"], rel=1e-5)
    assert hist[1]["explained_variance"] == pytest.approx(fsdp[1]["explained_variance"], abs=1e-5)
    assert ranks[1]["history"] == hist  # every rank reports the same metrics


@pytest.mark.parametrize("layout", [pytest.param("2,1", marks=pytest.mark.extended), "1,2"],
                         ids=["tp2", "pp2"])
def test_megatron_opd_reverse_kl_falls_and_sample_teacher_logprobs_match(layout, tmp_path):
    r = run_ranks(f"opd:{layout}", tmp_path, world_size=2, timeout_s=300, worker=WORKER)[0]
    kls = r["kls"]
    assert kls[0] > 1.0, kls
    assert all(b < a for a, b in zip(kls, kls[1:])), kls
    # the rollout-side teacher log-probs stand in for the trainer's teacher pass
    assert r["kl_carried"] == pytest.approx(kls[0], rel=1e-4)
