"""Loss terms and corrections on hand-checked cases, including where the gradient must vanish."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.corrections import mis_weights, tis_weights
from miles.algo.layout import cu_seqlens_from_lengths
from miles.algo.losses import (
    clipped_value_loss,
    entropy_from_logits,
    gspo_log_ratio,
    kl_penalty,
    ppo_clip_loss,
    sft_loss,
)
from miles.algo.metrics import mismatch_metrics

torch.set_num_threads(1)


def clip_grad(ratio: float, advantage: float, **kw: float | None) -> tuple[float, float, float]:
    """(loss, d loss / d logprob, clipped) for one token with pi / pi_old = ratio."""
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    kw = {"eps_clip": 0.2, "eps_clip_high": 0.2, **kw}
    result = ppo_clip_loss(logp, torch.tensor([advantage]), **kw)  # old log-prob 0: log_ratio = logp
    result.loss.sum().backward()
    return float(result.loss.detach()), float(logp.grad), float(result.clipped)


def test_ratio_inside_the_band_has_the_plain_policy_gradient() -> None:
    loss, grad, clipped = clip_grad(1.1, 2.0)
    assert loss == pytest.approx(-2.2) and grad == pytest.approx(-2.2) and clipped == 0.0


def test_ratio_above_the_clip_with_positive_advantage_has_zero_gradient() -> None:
    loss, grad, clipped = clip_grad(1.5, 1.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0 and clipped == 1.0


def test_ratio_below_the_clip_with_negative_advantage_has_zero_gradient() -> None:
    loss, grad, clipped = clip_grad(0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and clipped == 1.0


def test_pessimistic_side_is_never_clipped() -> None:
    # Ratio far above the band but advantage negative: the unclipped (worse) loss is kept.
    loss, grad, clipped = clip_grad(1.5, -1.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5) and clipped == 0.0


def test_asymmetric_clip_uses_eps_clip_high_above_one() -> None:
    loss, grad, _ = clip_grad(1.25, 1.0, eps_clip_high=0.28)
    assert loss == pytest.approx(-1.25) and grad != 0.0
    loss, grad, _ = clip_grad(1.3, 1.0, eps_clip_high=0.28)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    loss, grad, _ = clip_grad(0.7, -1.0, eps_clip_high=0.28)  # low side still at 1 - eps_clip
    assert loss == pytest.approx(0.8) and grad == 0.0


def test_dual_clip_caps_the_loss_of_huge_ratios_on_negative_advantages() -> None:
    logp = torch.tensor([math.log(10.0), math.log(10.0)], requires_grad=True)
    result = ppo_clip_loss(logp, torch.tensor([-1.0, 1.0]), eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    result.loss.sum().backward()
    assert torch.allclose(result.loss, torch.tensor([3.0, -1.2]))
    assert torch.equal(result.dual_clipped, torch.tensor([1.0, 0.0]))
    assert torch.equal(logp.grad, torch.zeros(2))


def test_gspo_ratio_is_the_geometric_mean_over_model_tokens() -> None:
    cu = cu_seqlens_from_lengths([3, 2])
    mask = torch.tensor([0, 1, 1, 1, 1])
    logp = torch.tensor([5.0, 0.1, 0.3, -0.2, 0.0], requires_grad=True)
    log_ratio = gspo_log_ratio(logp, torch.zeros(5), mask, cu)
    assert torch.allclose(log_ratio, torch.tensor([0.2, 0.2, 0.2, -0.1, -0.1]))
    # Gradient of the unclipped GSPO loss: -A * s / |y| per model token, nothing on the prompt.
    advantages = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    loss = ppo_clip_loss(log_ratio, advantages, eps_clip=1.0, eps_clip_high=1.0).loss
    (loss * mask).sum().backward()
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    # Both model tokens of a sample carry the loss -A * s, and s depends on each log-prob through
    # the mean (1/2), so each log-prob gets 2 * (-A * s / 2); the prompt slot gets nothing.
    expected = torch.tensor([0.0, -2 * s0 / 2, -2 * s0 / 2, -2 * 2 * s1 / 2, -2 * 2 * s1 / 2])
    assert torch.allclose(logp.grad, expected)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", 0.5),
        ("k2", 0.125),
        ("k3", math.exp(-0.5) - 1 + 0.5),
        ("low_var_kl", math.exp(-0.5) - 1 + 0.5),
    ],
)
def test_kl_estimators(kind: str, expected: float) -> None:
    kl = kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.5]), kind)
    assert float(kl) == pytest.approx(expected)


def test_low_var_kl_is_clamped_and_k3_is_not() -> None:
    logp, ref = torch.tensor([-20.0]), torch.tensor([0.0])  # k3 = e^20 - 21
    assert float(kl_penalty(logp, ref, "low_var_kl")) == 10.0
    assert float(kl_penalty(logp, ref, "k3")) > 1e8


def test_kl_gradient_is_zero_when_policy_equals_reference() -> None:
    for kind in ("k2", "k3", "low_var_kl"):
        logp = torch.tensor([-0.7, -2.0], requires_grad=True)
        kl_penalty(logp, logp.detach(), kind).sum().backward()
        assert torch.equal(logp.grad, torch.zeros(2)), kind


def test_entropy_of_uniform_logits_is_log_vocab() -> None:
    logits = torch.zeros(3, 8, requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert torch.allclose(entropy, torch.full((3,), math.log(8)))
    entropy.sum().backward()  # maximum: zero gradient
    assert torch.allclose(logits.grad, torch.zeros(3, 8), atol=1e-7)


def test_sft_loss_is_negative_log_likelihood() -> None:
    assert torch.equal(sft_loss(torch.tensor([-0.5, -2.0])), torch.tensor([0.5, 2.0]))


def test_value_loss_clipping() -> None:
    values = torch.tensor([1.0, 1.0], requires_grad=True)
    result = clipped_value_loss(values, torch.tensor([0.0, 0.9]), torch.tensor([0.0, 2.0]), value_clip=0.2)
    # token 0: plain (1-0)^2 = 1, clipped (0.2-0)^2 = 0.04 -> 0.5;  token 1: plain 1, clipped (1.1-2)^2 = .81
    assert torch.allclose(result.loss, torch.tensor([0.5, 0.5]))
    assert torch.equal(result.clipped, torch.tensor([0.0, 0.0]))
    result = clipped_value_loss(values, torch.tensor([0.0, 0.9]), torch.tensor([-1.0, 2.0]), value_clip=0.2)
    # token 0: plain (1+1)^2 = 4, clipped (0.2+1)^2 = 1.44 -> plain 2.0
    assert torch.allclose(result.loss, torch.tensor([2.0, 0.5]))
    result = clipped_value_loss(values, torch.tensor([3.0, 0.9]), torch.tensor([1.5, 2.0]), value_clip=0.2)
    # token 0: plain (1-1.5)^2 = 0.25, clipped (2.8-1.5)^2 = 1.69 -> clipped, constant in V: zero grad
    result.loss.sum().backward()
    assert torch.allclose(result.loss[0], torch.tensor(0.845)) and result.clipped[0] == 1.0
    assert float(values.grad[0]) == 0.0


def test_tis_clamps_the_ratio() -> None:
    train = torch.tensor([0.0, 0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -math.log(3.0), math.log(4.0), math.log(1.25)])  # ratios 1, 3, 1/4, 0.8
    result = tis_weights(train, rollout, clip=2.0, clip_low=0.5)
    assert torch.allclose(result.ratio, torch.tensor([1.0, 3.0, 0.25, 0.8]))
    assert torch.allclose(result.weights, torch.tensor([1.0, 2.0, 0.5, 0.8]))
    assert torch.equal(result.corrected, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert not result.weights.requires_grad


def test_mis_zeroes_tokens_outside_the_band() -> None:
    train = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -math.log(3.0), math.log(4.0), math.log(1.25), -1000.0])  # last: ratio inf
    result = mis_weights(train, rollout, low=0.5, high=2.0)
    assert torch.allclose(result.weights, torch.tensor([1.0, 0.0, 0.0, 0.8, 0.0]))
    assert torch.equal(result.corrected, torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]))


def test_mismatch_metrics() -> None:
    metrics = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5]))
    assert torch.equal(metrics["train_rollout_logprob_abs_diff"], torch.tensor([0.0, 0.5]))
    assert torch.allclose(metrics["train_rollout_kl"], torch.tensor([0.0, math.exp(-0.5) - 1 + 0.5]))
