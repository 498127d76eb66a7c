"""Advantage estimators: GRPO / Dr.GRPO / GSPO, REINFORCE++ (+baseline), PPO with GAE.

Design decisions:
- Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) is GRPO without the group-std division (A = r - mean);
  its other half, no 1/|o_i| length normalisation, is a loss reduction ("constant", reduce.py),
  which `LossConfig` makes the only one dr_grpo accepts. GSPO (Zheng et al. 2025, arXiv:2507.18071)
  shares GRPO's group advantages; its sequence-level ratio is in losses.py.
- Inputs are one scalar reward per sample and per-token tensors on the packed stream (`cu_seqlens`).
  Outputs are per-token advantages (and returns), zero wherever loss_mask is 0.
- Group statistics (GRPO family) are computed in float64 on the CPU: they are a handful of scalars,
  and this makes them deterministic on every device and accurate for near-constant groups.
  Group std is the unbiased (Bessel) std with eps 1e-6, as in slime; a group of one sample gets
  advantage 0 (its centred reward is 0) instead of NaN.
- `rollout_ids` (black-box trajectory trees): siblings of one rollout must share a reward, and a
  rollout counts once in its group's mean/std however many samples it produced, then its advantage is
  broadcast to all siblings. Without rollout_ids every sample is its own rollout.
- Token-level estimators (REINFORCE++, GAE) step time over *model tokens only* (loss_mask = 1):
  prompt and tool/environment tokens are not actions, so they are neither discounted over nor
  rewarded. The sample reward lands on its last model token; KL shaping is `-kl_coef * kl_t`.
  Where a response has no masked tokens inside it (or kl_coef = 0 and gamma = lambd = 1) this is
  exactly slime's; slime also discounts and KL-shapes across masked tool tokens.
- The reverse scans loop over time with each step vectorised across samples (element-wise ops only),
  which is deterministic on any device and any thread count; cost is O(max model tokens) tiny ops.
- Whitening (REINFORCE++, `normalize_advantages`) needs global moments. With data parallelism, pass
  `sum_across_ranks` (an all_reduce SUM of a float64 [3] tensor) and every rank whitens with the same
  global mean/var.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from miles.algo.checks import require_1d, require_finite, require_float, require_integer, require_mask
from miles.algo.config import LossConfig
from miles.algo.layout import (
    broadcast_to_tokens,
    check_stream,
    cu_seqlens_from_lengths,
    from_padded,
    segment_sum,
    to_padded,
)

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8

SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]


class AdvantageResult(NamedTuple):
    advantages: torch.Tensor  # float32 [num_tokens], 0 where loss_mask is 0
    returns: torch.Tensor  # float32 [num_tokens]: value target for PPO, discounted return for REINFORCE++


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool,
    rollout_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO per-sample advantages: (reward - group mean) [/ (group std + 1e-6)]. float32 [num_samples].

    Dr.GRPO is `normalize_std=False`. Call it on the whole step (all samples of every group).
    """
    rewards_cpu, group_cpu, unit_of_sample = _rollout_units(rewards, group_ids, rollout_ids)
    group_of_unit = torch.zeros(int(unit_of_sample.max()) + 1, dtype=torch.int64)
    group_of_unit[unit_of_sample] = group_cpu
    unit_reward = torch.zeros(group_of_unit.shape[0], dtype=torch.float64)
    unit_reward[unit_of_sample] = rewards_cpu

    _, group = torch.unique(group_of_unit, return_inverse=True)
    num_groups = int(group.max()) + 1
    count = torch.bincount(group, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, unit_reward) / count
    centred = unit_reward - mean[group]
    if normalize_std:
        square_sum = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centred * centred)
        # Unbiased std like torch.std; a lone sample has centred reward 0, so any finite std gives 0.
        std = torch.where(count > 1, (square_sum / (count - 1).clamp_min(1)).sqrt(), torch.zeros_like(count))
        centred = centred / (std[group] + GROUP_STD_EPS)
    return centred[unit_of_sample].to(device=rewards.device, dtype=torch.float32)


def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Discounted returns G_t = r_t + gamma * G_{t+1} over model tokens. float32 [num_tokens].

    r_t = -kl_coef * kl_t, plus the sample reward on its last model token.
    """
    token_rewards = _token_rewards(rewards, loss_mask, cu_seqlens, kl=kl, kl_coef=kl_coef)
    return _reverse_discounted_sum(token_rewards, loss_mask, cu_seqlens, discount=gamma)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float,
    lambd: float,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> AdvantageResult:
    """PPO generalized advantage estimation from critic values (detached). float32 [num_tokens] each.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last model token is 0),
    A_t = delta_t + gamma * lambd * A_{t+1}, returns_t = A_t + V_t.
    """
    mask = require_1d("loss_mask", loss_mask, None)
    require_mask("loss_mask", mask)
    vals = require_1d("values", values, mask.shape[0]).detach().to(torch.float32)
    require_float("values", vals)
    require_finite("values", vals)
    token_rewards = _token_rewards(rewards, mask, cu_seqlens, kl=kl, kl_coef=kl_coef)

    keep = mask != 0
    action_cu = _action_cu_seqlens(keep, check_stream(cu_seqlens, mask.shape[0], mask.device))
    r = to_padded(token_rewards[keep], action_cu)
    v = to_padded(vals[keep], action_cu)
    next_v = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)
    deltas = r + gamma * next_v - v  # padding: 0 + gamma * 0 - 0 = 0, so scans start clean
    adv_grid = _reverse_scan(deltas, gamma * lambd)
    advantages = torch.zeros_like(vals)
    advantages[keep] = from_padded(adv_grid, action_cu)
    returns = torch.where(keep, advantages + vals, torch.zeros_like(vals))
    return AdvantageResult(advantages=advantages, returns=returns)


def whiten(
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    sum_across_ranks: SumAcrossRanks | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked tokens; 0 where the mask is 0.

    Like slime: one pass of float64 moments [sum, sum of squares, count] (one all-reduce under DP),
    variance with Bessel's correction.
    """
    keep = loss_mask != 0
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    x64 = torch.where(keep, x.detach().to(torch.float64), zero)
    moments = torch.stack([x64.sum(), (x64 * x64).sum(), keep.sum().to(torch.float64)])
    if sum_across_ranks is not None:
        moments = sum_across_ranks(moments)
    total, square_total, count = moments[0], moments[1], moments[2]
    if float(count) == 0:
        raise ValueError("loss_mask has no trained token in the whole batch: nothing to whiten")
    mean = total / count
    var = (square_total / count - mean * mean).clamp_min(0.0)
    if float(count) >= 2:
        var = var * count / (count - 1)
    out = (x64 - mean) * torch.rsqrt(var + WHITEN_EPS)
    return torch.where(keep, out, zero).to(torch.float32)


def apply_distillation(
    advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    opd_kl_coef: float,
) -> torch.Tensor:
    """On-policy distillation hook: A_t - opd_kl_coef * (log pi_student - log pi_teacher) (reverse KL)."""
    n = advantages.shape[0]
    student = require_1d("student_logprobs", student_logprobs, n).detach().to(torch.float32)
    teacher = require_1d("teacher_logprobs", teacher_logprobs, n).detach().to(torch.float32)
    require_finite("teacher_logprobs", teacher)
    shaped = advantages - opd_kl_coef * (student - teacher)
    return torch.where(loss_mask != 0, shaped, torch.zeros_like(shaped))


def compute_advantages(
    cfg: LossConfig,
    *,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    student_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    sum_across_ranks: SumAcrossRanks | None = None,
) -> AdvantageResult:
    """Per-token advantages and returns for `cfg.advantage_estimator`, for a batch of whole groups.

    rewards [S], group_ids [S] (GRPO family, REINFORCE++-baseline), rollout_ids [S] (optional),
    loss_mask / kl / values / *_logprobs [T], cu_seqlens [S + 1].
    `kl` is the per-token estimate for reward shaping (needed when cfg.kl_coef > 0), e.g.
    `kl_penalty(old_logprobs, ref_logprobs, "k1")`. `values` are the critic's (PPO only).
    """
    mask = require_1d("loss_mask", loss_mask, None)
    require_mask("loss_mask", mask)
    cu = check_stream(cu_seqlens, mask.shape[0], mask.device)
    num_samples = cu.shape[0] - 1
    require_1d("rewards", rewards, num_samples)
    estimator = cfg.advantage_estimator
    if cfg.kl_coef > 0 and estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo") and kl is None:
        raise ValueError(f"kl is required: kl_coef={cfg.kl_coef} shapes the reward for {estimator}")
    shaping_kl = kl if cfg.kl_coef > 0 else None

    if cfg.opd_only:  # pure distillation: the reverse-KL term below is the whole advantage
        advantages = returns = torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device)
    elif estimator in ("grpo", "dr_grpo", "gspo"):
        per_sample = group_advantages(
            rewards, _need("group_ids", group_ids, estimator), normalize_std=cfg.std_normalized, rollout_ids=rollout_ids
        )
        advantages = _masked(broadcast_to_tokens(per_sample.to(mask.device), cu), mask)
        returns = advantages
    elif estimator == "reinforce_plus_plus":
        returns = reinforce_plus_plus_returns(rewards, mask, cu, gamma=cfg.gamma, kl=shaping_kl, kl_coef=cfg.kl_coef)
        advantages = whiten(returns, mask, sum_across_ranks=sum_across_ranks)
    elif estimator == "reinforce_plus_plus_baseline":
        per_sample = group_advantages(
            rewards, _need("group_ids", group_ids, estimator), normalize_std=False, rollout_ids=rollout_ids
        )
        returns = broadcast_to_tokens(per_sample.to(mask.device), cu)
        if shaping_kl is not None:
            returns = returns - cfg.kl_coef * _shaping_kl(shaping_kl, mask.shape[0])
        returns = _masked(returns, mask)
        advantages = whiten(returns, mask, sum_across_ranks=sum_across_ranks)
    else:  # ppo
        advantages, returns = gae_advantages(
            rewards,
            _need("values", values, estimator),
            mask,
            cu,
            gamma=cfg.gamma,
            lambd=cfg.lambd,
            kl=shaping_kl,
            kl_coef=cfg.kl_coef,
        )

    if cfg.normalize_advantages and not cfg.opd_only and estimator not in ("reinforce_plus_plus",
                                                                            "reinforce_plus_plus_baseline"):
        advantages = whiten(advantages, mask, sum_across_ranks=sum_across_ranks)
    if cfg.opd_kl_coef > 0:
        advantages = apply_distillation(
            advantages,
            _need("student_logprobs", student_logprobs, "opd_kl_coef > 0"),
            _need("teacher_logprobs", teacher_logprobs, "opd_kl_coef > 0"),
            mask,
            opd_kl_coef=cfg.opd_kl_coef,
        )
    return AdvantageResult(advantages=advantages, returns=returns)


def _rollout_units(
    rewards: torch.Tensor, group_ids: torch.Tensor, rollout_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate; return per-sample float64 rewards, group ids, and each sample's rollout unit index."""
    require_1d("rewards", rewards)
    if rewards.shape[0] == 0:
        raise ValueError("rewards is empty: advantages need at least one sample")
    require_float("rewards", rewards)
    require_finite("rewards", rewards)
    require_1d("group_ids", group_ids, rewards.shape[0])
    require_integer("group_ids", group_ids)
    rewards_cpu = rewards.detach().to("cpu", torch.float64)
    group_cpu = group_ids.detach().to("cpu", torch.int64)
    if rollout_ids is None:
        return rewards_cpu, group_cpu, torch.arange(rewards.shape[0])
    require_1d("rollout_ids", rollout_ids, rewards.shape[0])
    require_integer("rollout_ids", rollout_ids)
    rollout_cpu = rollout_ids.detach().to("cpu", torch.int64)
    _, unit = torch.unique(rollout_cpu, return_inverse=True)
    first = torch.full((int(unit.max()) + 1,), -1, dtype=torch.int64)
    for sample in range(unit.shape[0]):  # siblings must agree: one reward and one group per rollout
        u = int(unit[sample])
        if first[u] < 0:
            first[u] = sample
            continue
        ref = int(first[u])
        rid = int(rollout_cpu[sample])
        if rewards_cpu[sample] != rewards_cpu[ref]:
            raise ValueError(
                f"rewards: samples {ref} and {sample} share rollout_id {rid} but have rewards "
                f"{rewards_cpu[ref].item()} and {rewards_cpu[sample].item()}; siblings must share one reward"
            )
        if group_cpu[sample] != group_cpu[ref]:
            raise ValueError(
                f"group_ids: samples {ref} and {sample} share rollout_id {rid} but are in groups "
                f"{int(group_cpu[ref])} and {int(group_cpu[sample])}"
            )
    return rewards_cpu, group_cpu, unit


def _token_rewards(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    kl: torch.Tensor | None,
    kl_coef: float,
) -> torch.Tensor:
    """float32 [num_tokens]: -kl_coef * kl_t on model tokens, plus the reward on each last model token."""
    mask = require_1d("loss_mask", loss_mask, None)
    require_mask("loss_mask", mask)
    cu = check_stream(cu_seqlens, mask.shape[0], mask.device)
    require_1d("rewards", rewards, cu.shape[0] - 1)
    require_float("rewards", rewards)
    require_finite("rewards", rewards)
    keep = mask != 0
    token_rewards = torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef != 0:
        token_rewards = torch.where(keep, -kl_coef * _shaping_kl(kl, mask.shape[0]), token_rewards)
    if mask.shape[0] == 0:
        return token_rewards
    # Last model token of each sample: the largest masked position inside the sample, if any.
    positions = torch.where(keep, torch.arange(mask.shape[0], device=mask.device), -1)
    last = to_padded(positions, cu, pad_value=-1).amax(dim=1)
    has_action = last >= 0
    sample_rewards = rewards.detach().to(mask.device, torch.float32)[has_action]
    ends = last[has_action]
    token_rewards = token_rewards.index_put((ends,), token_rewards[ends] + sample_rewards)
    return token_rewards


def _reverse_discounted_sum(
    x: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, *, discount: float
) -> torch.Tensor:
    """Per sample, over model tokens only: y_t = x_t + discount * y_{t+1}. 0 where mask is 0."""
    keep = loss_mask != 0
    action_cu = _action_cu_seqlens(keep, check_stream(cu_seqlens, keep.shape[0], keep.device))
    grid = _reverse_scan(to_padded(x[keep], action_cu), discount)
    out = torch.zeros_like(x)
    out[keep] = from_padded(grid, action_cu)
    return out


def _action_cu_seqlens(keep: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of the stream that keeps only model tokens (the time axis of the scans)."""
    return cu_seqlens_from_lengths(segment_sum(keep.to(torch.int64), cu_seqlens)).to(keep.device)


def _reverse_scan(grid: torch.Tensor, discount: float) -> torch.Tensor:
    """[num_samples, time] -> y[:, t] = grid[:, t] + discount * y[:, t + 1]; trailing padding must be 0."""
    out = torch.zeros_like(grid)
    running = grid.new_zeros(grid.shape[0])
    for t in range(grid.shape[1] - 1, -1, -1):
        running = grid[:, t] + discount * running
        out[:, t] = running
    return out


def _shaping_kl(kl: torch.Tensor, num_tokens: int) -> torch.Tensor:
    k = require_1d("kl", kl, num_tokens).detach().to(torch.float32)
    require_finite("kl", k)
    return k


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask != 0, x, torch.zeros_like(x))


def _need(name: str, value: torch.Tensor | None, why: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"{name} is required for {why}")
    return value
