"""Train/rollout mismatch corrections: truncated IS (TIS) and masked IS (MIS / icepop).

The rollout engine (SGLang, maybe FP8) and the trainer compute slightly different probabilities for
the same tokens. Both corrections reweight the per-token policy-gradient loss by the importance ratio
pi_train / pi_rollout, where pi_train is the old-policy (or, in bypass mode, current detached)
log-prob recomputed by the trainer.

Design decisions:
- Weights are detached: they reweight the gradient of the surrogate, they are not optimized.
- The band test is done in log space (log_ratio vs log(bound)), so an overflowing exp cannot turn an
  out-of-band token into an in-band one, and a zero lower bound means "no lower bound".
- TIS clamps (keeps every token, bounds the weight); MIS zeroes tokens outside [low, high] and keeps
  the in-band tokens weighted by their ratio (icepop). Masked tokens still count in the reduction
  denominators, so the loss scale does not jump when many tokens are dropped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from miles.algo.checks import require_1d


class CorrectionResult(NamedTuple):
    weights: torch.Tensor  # float32 [num_tokens], detached, multiply into the per-token pg loss
    ratio: torch.Tensor  # float32 [num_tokens], detached raw pi_train / pi_rollout
    corrected: torch.Tensor  # float32 [num_tokens], 1 where the weight differs from the ratio


def importance_log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    require_1d("rollout_logprobs", rollout_logprobs, train_logprobs.shape[0])
    return train_logprobs.detach().float() - rollout_logprobs.detach().float()


def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    *,
    clip: float,
    clip_low: float = 0.0,
) -> CorrectionResult:
    """Truncated IS: weight = clamp(pi_train / pi_rollout, clip_low, clip)."""
    if not 0.0 <= clip_low < clip:
        raise ValueError(f"tis bounds must satisfy 0 <= clip_low < clip, got clip_low={clip_low}, clip={clip}")
    log_ratio = importance_log_ratio(train_logprobs, rollout_logprobs)
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(clip_low, clip)
    return CorrectionResult(weights, ratio, (weights != ratio).float())


def mis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    *,
    low: float,
    high: float,
) -> CorrectionResult:
    """Masked IS (icepop): weight = pi_train / pi_rollout inside [low, high], 0 outside."""
    if not 0.0 <= low < high:
        raise ValueError(f"mis bounds must satisfy 0 <= low < high, got low={low}, high={high}")
    log_ratio = importance_log_ratio(train_logprobs, rollout_logprobs)
    ratio = torch.exp(log_ratio)
    log_low = math.log(low) if low > 0 else -math.inf
    in_band = (log_ratio >= log_low) & (log_ratio <= math.log(high))
    weights = torch.where(in_band, ratio, torch.zeros_like(ratio))
    return CorrectionResult(weights, ratio, (~in_band).float())
