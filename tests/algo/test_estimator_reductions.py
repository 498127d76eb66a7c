"""Each estimator's loss reduction is its paper's: picked by "auto", a contradicting one refused.

Dr. GRPO (arXiv:2503.20783): sum of token losses / (generation budget x responses), as TRL's
loss_type="dr_grpo" computes it. GSPO (arXiv:2507.18071): one term per sequence, 1/G sum_i.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from miles.algo import LossConfig, compute_policy_loss, loss_denominators
from miles.algo.layout import cu_seqlens_from_lengths, loss_mask_counts


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("grpo", "rollout"), ("dr_grpo", "constant"), ("gspo", "rollout"), ("reinforce_plus_plus", "rollout"),
     ("reinforce_plus_plus_baseline", "rollout"), ("ppo", "rollout")],
)
def test_auto_picks_the_estimators_reduction(estimator: str, expected: str) -> None:
    assert LossConfig(advantage_estimator=estimator).reduction == expected
    decoded = msgspec.toml.decode(f'advantage_estimator = "{estimator}"\n'.encode(), type=LossConfig)
    assert decoded.reduction == expected


@pytest.mark.parametrize(
    ("estimator", "reduction", "paper"),
    [("dr_grpo", "token", "arXiv:2503.20783"), ("dr_grpo", "sample", "arXiv:2503.20783"),
     ("dr_grpo", "rollout", "arXiv:2503.20783"), ("gspo", "token", "arXiv:2507.18071"),
     ("gspo", "constant", "arXiv:2507.18071")],
)
def test_a_reduction_the_paper_contradicts_is_refused(estimator: str, reduction: str, paper: str) -> None:
    message = rf"algo.loss_reduction = '{reduction}': advantage_estimator = '{estimator}' needs .*{paper}"
    with pytest.raises(ValueError, match=message):
        LossConfig(advantage_estimator=estimator, loss_reduction=reduction)
    toml = f'advantage_estimator = "{estimator}"\nloss_reduction = "{reduction}"\n'.encode()
    with pytest.raises(msgspec.ValidationError, match=paper):
        msgspec.toml.decode(toml, type=LossConfig)


def test_explicit_allowed_reductions_and_sft_are_kept() -> None:
    assert LossConfig(advantage_estimator="gspo", loss_reduction="sample").reduction == "sample"
    assert LossConfig(advantage_estimator="grpo", loss_reduction="token").reduction == "token"
    assert LossConfig(advantage_estimator="grpo", loss_reduction="constant").reduction == "constant"
    # The SFT warm-start of a Dr. GRPO recipe has no estimator to obey.
    sft = msgspec.structs.replace(LossConfig(advantage_estimator="dr_grpo"), loss_type="sft")
    assert sft.reduction == "rollout"
    assert LossConfig(advantage_estimator="gspo", loss_type="sft", loss_reduction="token").reduction == "token"


def _padded_policy_loss(cfg: LossConfig, lengths: list[int], advantages: list[float], budget: int):
    """compute_policy_loss on a packed batch; also the per-token log-prob gradient, padded [B, budget]."""
    cu = cu_seqlens_from_lengths(lengths)
    mask = torch.ones(int(cu[-1]), dtype=torch.int64)
    adv = torch.repeat_interleave(torch.tensor(advantages), torch.tensor(lengths))
    logprobs = (-torch.rand(int(cu[-1]), generator=torch.Generator().manual_seed(0))).requires_grad_()
    den = loss_denominators(loss_mask_counts(mask, cu), reduction=cfg.reduction,
                            max_response_tokens=cfg.max_response_tokens)
    loss, _ = compute_policy_loss(logprobs, loss_mask=mask, sample_denominators=den, cfg=cfg, cu_seqlens=cu,
                                  advantages=adv, old_logprobs=logprobs.detach())
    loss.backward()
    grad = torch.zeros(len(lengths), budget)
    for i, n in enumerate(lengths):
        grad[i, :n] = logprobs.grad[cu[i]:cu[i + 1]]
    return loss, grad


def test_dr_grpo_loss_is_the_token_sum_over_budget_times_responses() -> None:
    lengths, advantages, budget = [2, 7, 4], [1.0, 1.0, -0.5], 8
    cfg = LossConfig(advantage_estimator="dr_grpo", max_response_tokens=budget)
    loss, grad = _padded_policy_loss(cfg, lengths, advantages, budget)
    # At ratio 1 the per-token PPO loss is -A; TRL: (per_token_loss * mask).sum() / (B * max_completion_length).
    per_token = -torch.tensor(advantages)[:, None] * (torch.arange(budget) < torch.tensor(lengths)[:, None])
    expected = per_token.sum() / (len(lengths) * budget)
    assert torch.allclose(loss, expected, rtol=0, atol=1e-7)
    # No length normalisation: every token of a same-advantage response gets the same gradient,
    # short (2 tokens) or long (7): -A / (B * budget).
    assert torch.allclose(grad[0, :2], torch.full((2,), -1.0 / 24))
    assert torch.allclose(grad[1, :7], torch.full((7,), -1.0 / 24))


def test_gspo_weighs_each_sequence_once_whatever_its_length() -> None:
    # Ratio 1: each sequence's clipped term is -A_i; GSPO's 1/G sum_i gives -(1 - 0.5) / 2 = -0.25.
    # A token mean (refused) would give -(2 * 1 - 6 * 0.5) / 8 = +0.125: the long sequence would win.
    cfg = LossConfig(advantage_estimator="gspo")
    loss, _ = _padded_policy_loss(cfg, [2, 6], [1.0, -0.5], 6)
    assert torch.allclose(loss, torch.tensor(-0.25), rtol=0, atol=1e-7)
