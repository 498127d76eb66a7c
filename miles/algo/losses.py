"""Per-token loss terms: PPO clip (asymmetric, dual), GSPO sequence ratio, KL k1/k2/k3/low-var, entropy,
SFT, and the clipped critic loss.

Design decisions:
- Every function returns *per-token* values; reduction to a scalar is a separate step (reduce.py), so
  one reducer serves every term and the metrics.
- Log-ratios are taken as differences of float32 log-probabilities and only exponentiated at the end,
  so bf16 inputs and large ratios do not lose precision or overflow early.
- GSPO's sequence ratio is exp(mean over the sample's model tokens of (logp - old_logp)), broadcast
  to its tokens; the gradient flows through the mean, giving the sequence-level GSPO objective.
- `low_var_kl` is k3 clamped to [-10, 10] for stability (slime's choice); `k3` is unclamped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miles.algo.checks import require_1d
from miles.algo.layout import broadcast_to_tokens, segment_sum

LOW_VAR_KL_BOUND = 10.0


class ClipResult(NamedTuple):
    loss: torch.Tensor  # float32 [num_tokens], per-token policy-gradient loss
    clipped: torch.Tensor  # float32 [num_tokens], 1 where the clipped branch was taken
    dual_clipped: torch.Tensor  # float32 [num_tokens], 1 where the dual-clip bound was taken


def ppo_clip_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> ClipResult:
    """max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A), with r = exp(log_ratio).

    Dual clip (eps_clip_c > 1): for A < 0 the loss is additionally capped at -eps_clip_c * A, so a huge
    ratio on a bad action cannot blow the update up.
    """
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c={eps_clip_c} must be > 1 for dual-clip PPO")
    require_1d("advantages", advantages, log_ratio.shape[0])
    ratio = torch.exp(log_ratio.float())
    adv = advantages.detach().float()
    unclipped = -ratio * adv
    clipped_loss = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).float()
    if eps_clip_c is None:
        return ClipResult(loss, clipped, torch.zeros_like(clipped))
    dual_bound = -eps_clip_c * adv
    dual = (adv < 0) & (loss > dual_bound)
    loss = torch.where(dual, dual_bound, loss)
    return ClipResult(loss, clipped, dual.float())


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token (PPO)."""
    return logprobs.float() - old_logprobs.detach().float()


def gspo_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """GSPO: per-sample mean over model tokens of log(pi / pi_old), broadcast to every token.

    GSPO (Zheng et al. 2025, arXiv:2507.18071): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), clipped
    per sequence; the objective averages one term per sequence, so it needs a per-sequence
    reduction ("sample"/"rollout"), which `LossConfig` enforces.
    """
    mask = loss_mask.float()
    total = segment_sum(token_log_ratio(logprobs, old_logprobs) * mask, cu_seqlens)
    count = segment_sum(mask, cu_seqlens).clamp_min(1.0)
    return broadcast_to_tokens(total / count, cu_seqlens)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimator from sampled tokens (Schulman's k1/k2/k3).

    k1 = log(pi / pi_ref); k2 = k1^2 / 2; k3 = exp(-k1) - 1 + k1 (non-negative, unbiased, low variance);
    low_var_kl = k3 clamped to [-10, 10]. `importance_ratio` (pi / pi_old) makes the estimate unbiased
    when tokens were sampled from pi_old.
    """
    log_ratio = logprobs.float() - ref_logprobs.detach().float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio * log_ratio
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"kind={kind!r} is not one of k1, k2, k3, low_var_kl")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kind == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of softmax(logits): [num_tokens, vocab] -> float32 [num_tokens] (differentiable).

    Materialises a float32 [num_tokens, vocab] log-softmax; for large vocabularies a backend should
    call it on chunks of tokens (or fuse it with its log-prob kernel) and concatenate.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, vocab], got shape {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token."""
    return -logprobs.float()


class ValueLossResult(NamedTuple):
    loss: torch.Tensor  # float32 [num_tokens]
    clipped: torch.Tensor  # float32 [num_tokens], 1 where the clipped prediction gave the larger loss


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    value_clip: float,
) -> ValueLossResult:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token (PPO critic)."""
    v = values.float()
    old = old_values.detach().float()
    target = returns.detach().float()
    v_clipped = old + (v - old).clamp(-value_clip, value_clip)
    plain = (v - target) ** 2
    clipped = (v_clipped - target) ** 2
    return ValueLossResult(0.5 * torch.maximum(plain, clipped), (clipped > plain).float())
