"""Advantage estimators on small hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo import LossConfig, compute_advantages, group_advantages
from miles.algo.advantages import gae_advantages, reinforce_plus_plus_returns, whiten
from miles.algo.layout import cu_seqlens_from_lengths

torch.set_num_threads(1)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_grpo_group_1001_gives_plus_minus_sqrt3_over_2() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ids(0, 0, 0, 0), normalize_std=True)
    # centred +-0.5, unbiased std sqrt(1/3): 0.5 / (sqrt(1/3) + 1e-6) ~= 0.866
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.equal(adv, torch.tensor([expected, -expected, -expected, expected], dtype=torch.float32))


def test_dr_grpo_keeps_only_the_mean_baseline() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ids(0, 0, 0, 0), normalize_std=False)
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))
    cfg = LossConfig(advantage_estimator="dr_grpo")  # normalize_std=True by default, still off for dr_grpo
    assert not cfg.std_normalized


def test_groups_are_independent_and_order_free() -> None:
    rewards = torch.tensor([3.0, 1.0, 10.0, 2.0, 20.0])
    adv = group_advantages(rewards, ids(7, 7, 2, 7, 2), normalize_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -5.0, 0.0, 5.0]))


def test_constant_group_and_single_sample_group_get_zero_not_nan() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.5]), ids(0, 0, 0, 1), normalize_std=True)
    assert torch.equal(adv, torch.zeros(4))


def test_rollout_siblings_count_once_in_group_statistics() -> None:
    # Rollout 5 produced three samples (e.g. compaction); it must weigh like one rollout.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    rollout_ids = ids(5, 5, 5, 6, 7, 8)
    adv = group_advantages(rewards, ids(0, 0, 0, 0, 0, 0), normalize_std=True, rollout_ids=rollout_ids)
    per_rollout = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ids(0, 0, 0, 0), normalize_std=True)
    expected = per_rollout[[0, 0, 0, 1, 2, 3]]
    assert torch.equal(adv, expected)
    flattened = group_advantages(rewards, ids(0, 0, 0, 0, 0, 0), normalize_std=True)
    assert not torch.allclose(flattened, expected)


def test_grpo_advantages_are_broadcast_to_model_tokens_only() -> None:
    cu = cu_seqlens_from_lengths([3, 2])
    mask = torch.tensor([0, 1, 1, 0, 1])
    result = compute_advantages(
        LossConfig(advantage_estimator="grpo", normalize_std=False),
        rewards=torch.tensor([1.0, 0.0]),
        loss_mask=mask,
        cu_seqlens=cu,
        group_ids=ids(0, 0),
    )
    assert torch.equal(result.advantages, torch.tensor([0.0, 0.5, 0.5, 0.0, -0.5]))


# One sample: prompt token, two model tokens, a tool token (masked), a final model token.
ONE_CU = cu_seqlens_from_lengths([5])
ONE_MASK = torch.tensor([0, 1, 1, 0, 1])


def test_reinforce_plus_plus_discounts_over_model_tokens_only() -> None:
    returns = reinforce_plus_plus_returns(torch.tensor([1.0]), ONE_MASK, ONE_CU, gamma=0.5)
    assert torch.equal(returns, torch.tensor([0.0, 0.25, 0.5, 0.0, 1.0]))


def test_reinforce_plus_plus_kl_shaping() -> None:
    kl = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0])  # prompt/tool entries must be ignored
    returns = reinforce_plus_plus_returns(torch.tensor([1.0]), ONE_MASK, ONE_CU, gamma=0.5, kl=kl, kl_coef=0.1)
    # token rewards -0.1, -0.2, (-0.3 + 1); G = 0.7, -0.2 + 0.35 = 0.15, -0.1 + 0.075 = -0.025
    assert torch.allclose(returns, torch.tensor([0.0, -0.025, 0.15, 0.0, 0.7]), atol=1e-7)


def test_gae_hand_case() -> None:
    values = torch.tensor([7.0, 0.5, 0.2, 7.0, 0.1])
    result = gae_advantages(torch.tensor([1.0]), values, ONE_MASK, ONE_CU, gamma=1.0, lambd=0.5)
    # deltas: 1 - 0.1 = 0.9, 0 + 0.1 - 0.2 = -0.1, 0 + 0.2 - 0.5 = -0.3
    # A: 0.9, -0.1 + 0.45 = 0.35, -0.3 + 0.175 = -0.125; returns = A + V
    assert torch.allclose(result.advantages, torch.tensor([0.0, -0.125, 0.35, 0.0, 0.9]), atol=1e-7)
    assert torch.allclose(result.returns, torch.tensor([0.0, 0.375, 0.55, 0.0, 1.0]), atol=1e-7)


def test_gae_with_gamma_lambda_one_is_reward_minus_value() -> None:
    g = torch.Generator().manual_seed(0)
    cu = cu_seqlens_from_lengths([4, 6, 3])
    mask = (torch.rand(13, generator=g) > 0.3).long()
    values = torch.randn(13, generator=g)
    rewards = torch.tensor([1.0, -0.5, 2.0])
    result = gae_advantages(rewards, values, mask, cu, gamma=1.0, lambd=1.0)
    expected = torch.repeat_interleave(rewards, torch.tensor([4, 6, 3])) - values
    assert torch.allclose(result.advantages, expected * mask, atol=1e-6)


def test_whiten_hand_case() -> None:
    out = whiten(torch.tensor([1.0, 100.0, 2.0, 3.0]), torch.tensor([1, 0, 1, 1]))
    # mean 2, unbiased variance 1
    assert torch.allclose(out, torch.tensor([-1.0, 0.0, 0.0, 1.0]), atol=1e-6)


def test_whiten_with_sum_across_ranks_matches_single_rank() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    whole = whiten(x, mask)
    shards = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    local = [
        torch.stack([(v.double() * m).sum(), (v.double() ** 2 * m).sum(), m.double().sum()]) for v, m in shards
    ]
    # An all_reduce SUM over two ranks adds the other rank's moments.
    split = torch.cat([
        whiten(*shards[rank], sum_across_ranks=lambda t, rank=rank: t + local[1 - rank]) for rank in (0, 1)
    ])
    assert torch.allclose(split, whole, atol=1e-6)


def test_whiten_refuses_a_batch_without_trained_tokens() -> None:
    with pytest.raises(ValueError, match="loss_mask has no trained token in the whole batch"):
        whiten(torch.ones(3), torch.zeros(3))


def test_reinforce_plus_plus_baseline_is_whitened_group_centred_reward() -> None:
    cu = cu_seqlens_from_lengths([2, 2])
    result = compute_advantages(
        LossConfig(advantage_estimator="reinforce_plus_plus_baseline"),
        rewards=torch.tensor([1.0, 0.0]),
        loss_mask=torch.tensor([1, 1, 1, 1]),
        cu_seqlens=cu,
        group_ids=ids(0, 0),
    )
    assert torch.allclose(result.returns, torch.tensor([0.5, 0.5, -0.5, -0.5]))
    s = math.sqrt(3) / 2  # values +-0.5, unbiased std 1/sqrt(3)
    assert torch.allclose(result.advantages, torch.tensor([s, s, -s, -s]), atol=1e-6)


def test_ppo_estimator_uses_gae_and_optional_normalization() -> None:
    values = torch.tensor([7.0, 0.5, 0.2, 7.0, 0.1])
    cfg = LossConfig(advantage_estimator="ppo", lambd=0.5)
    result = compute_advantages(cfg, rewards=torch.tensor([1.0]), loss_mask=ONE_MASK, cu_seqlens=ONE_CU, values=values)
    assert torch.allclose(result.advantages, torch.tensor([0.0, -0.125, 0.35, 0.0, 0.9]), atol=1e-7)
    normalized = compute_advantages(
        LossConfig(advantage_estimator="ppo", lambd=0.5, normalize_advantages=True),
        rewards=torch.tensor([1.0]),
        loss_mask=ONE_MASK,
        cu_seqlens=ONE_CU,
        values=values,
    )
    kept = normalized.advantages[ONE_MASK.bool()]
    assert abs(float(kept.mean())) < 1e-6 and abs(float(kept.var()) - 1) < 1e-4


def test_distillation_hook_subtracts_reverse_kl() -> None:
    cu = cu_seqlens_from_lengths([3])
    result = compute_advantages(
        LossConfig(normalize_std=False, opd_kl_coef=0.5),
        rewards=torch.tensor([1.0]),
        loss_mask=torch.tensor([0, 1, 1]),
        cu_seqlens=cu,
        group_ids=ids(0),
        student_logprobs=torch.tensor([-9.0, -1.0, -2.0]),
        teacher_logprobs=torch.tensor([-9.0, -2.0, -1.0]),
    )
    # group of one: base advantage 0; minus 0.5 * (student - teacher)
    assert torch.equal(result.advantages, torch.tensor([0.0, -0.5, 0.5]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline"])
def test_fully_masked_sample_gets_zero_advantage(estimator: str) -> None:
    result = compute_advantages(
        LossConfig(advantage_estimator=estimator),
        rewards=torch.tensor([1.0, 0.0]),
        loss_mask=torch.tensor([0, 0, 1, 1]),
        cu_seqlens=cu_seqlens_from_lengths([2, 2]),
        group_ids=ids(0, 0),
    )
    assert torch.equal(result.advantages[:2], torch.zeros(2))


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus", "ppo"])
def test_empty_samples_are_allowed(estimator: str) -> None:
    for lengths in ([0, 3], [2, 0], [0, 0]):
        cu = cu_seqlens_from_lengths(lengths)
        num_tokens = int(cu[-1])
        cfg = LossConfig(advantage_estimator=estimator)
        kwargs = dict(rewards=torch.tensor([1.0, 0.0]), loss_mask=torch.ones(num_tokens), cu_seqlens=cu,
                      group_ids=ids(0, 0), values=torch.zeros(num_tokens))
        if estimator == "reinforce_plus_plus" and num_tokens == 0:
            with pytest.raises(ValueError, match="no trained token"):
                compute_advantages(cfg, **kwargs)
            continue
        result = compute_advantages(cfg, **kwargs)
        assert result.advantages.shape == (num_tokens,) and torch.isfinite(result.advantages).all()
