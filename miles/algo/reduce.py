"""Loss reduction that adds up exactly across micro-batches: per token, sample, rollout, or constant.

Every reduction is written as one formula,

    loss = sum over tokens t of  value_t * loss_mask_t / denominator[sample(t)]

where `denominator` is one number per sample computed ONCE for the whole training step (all
micro-batches, all data-parallel ranks) by `loss_denominators`:

    token    denominator_s = total trained tokens in the step
             -> sum of all token losses / all tokens
    sample   denominator_s = trained tokens of sample s * number of samples in the step
             -> mean per sample, then mean over samples
    rollout  denominator_s = trained tokens of s's whole rollout * number of rollouts in the step
             -> token-weighted mean over each rollout's tokens (all siblings together), then mean
                over rollouts
    constant denominator_s = max_response_tokens * number of rollouts in the step
             -> sum of all token losses / (budget * responses): Dr. GRPO's length-unbiased reduction
                (arXiv:2503.20783; TRL loss_type="dr_grpo", verl "seq-mean-token-sum-norm"); the
                same for every sample, so no response's tokens count more or less for its length

Design decisions:
- Because the denominators are global, each micro-batch's loss is a *partial sum*: summing the
  micro-batch losses (or accumulating their gradients) gives exactly the step loss, however samples
  (and a rollout's siblings) are split across micro-batches. The backend must therefore NOT divide
  by the number of micro-batches; with data parallelism whose gradient all-reduce averages, multiply
  the loss by the DP world size (or all-reduce with SUM).
- A sample with no trained tokens gets a denominator clamped to 1: its numerator is 0, so it adds 0
  instead of NaN. It still counts as a sample/rollout in the step (slime does the same).
- Without `rollout_ids` every sample is its own rollout, so "rollout" equals "sample", and "constant"
  counts samples. With them a rollout is one response o_i of Dr. GRPO's 1/G.
- Which reduction an estimator may use is the config's business (`LossConfig.reduction`); here
  "auto" is refused, since only the config knows what it resolves to.
- Denominators are float64: step token counts can pass 2^24, where float32 stops being exact.
"""

from __future__ import annotations

import torch

from miles.algo.checks import require_1d, require_finite, require_integer
from miles.algo.config import LOSS_REDUCTIONS
from miles.algo.layout import broadcast_to_tokens, check_stream


def loss_denominators(
    loss_mask_counts: torch.Tensor,
    *,
    reduction: str,
    rollout_ids: torch.Tensor | None = None,
    max_response_tokens: int = 0,
) -> torch.Tensor:
    """float64 [num_samples] per-sample denominators for the WHOLE step.

    The "rollout" reduction, for black-box trajectory trees. The step holds R rollouts; rollout r
    produced the samples S_r (one, or several when its harness forked, retried, spawned subagents
    or compacted its context), and T_r is the set of its trained tokens over all of S_r
    (loss_mask = 1), |T_r| = sum over s in S_r of loss_mask_counts[s]. Every sample s of rollout r
    gets denominator_s = |T_r| * R, so

        loss = sum_s sum_{t in T_s} l_t / (|T_r(s)| * R)
             = (1/R) sum_r (1/|T_r|) sum_{t in T_r} l_t

    which depends on each rollout's set of trained tokens, not on how they are cut into samples:
    one rollout as 1 sample, or the same tokens (same contexts, hence the same l_t) split into k
    samples whose loss masks partition T_r, gives the same loss and the same gradient. The
    advantage inside l_t does not change either: group statistics count a rollout once
    (`advantages.group_advantages`). "sample" instead weighs each sample 1/S and averages over its
    own tokens, so a rollout split into k samples counts k times; "token" is split-invariant too,
    but weighs a rollout by its length. R and |T_r| are counted per optimizer step; the planner
    keeps groups (hence rollouts) whole within one step. |T_r| = 0 is clamped to 1 (numerator 0).

    loss_mask_counts: int [num_samples], trained tokens per sample (see layout.loss_mask_counts).
    reduction: a resolved reduction, i.e. `LossConfig.reduction`.
    rollout_ids: int [num_samples], siblings of one rollout share an id (optional).
    max_response_tokens: the generation budget per response, required (> 0) by "constant".
    """
    counts = require_1d("loss_mask_counts", loss_mask_counts)
    if counts.shape[0] == 0:
        raise ValueError("loss_mask_counts is empty: a training step needs at least one sample")
    require_integer("loss_mask_counts", counts)
    if bool((counts < 0).any()):
        index = int((counts < 0).nonzero()[0, 0])
        raise ValueError(f"loss_mask_counts must be >= 0, got {int(counts[index])} at index {index}")
    if reduction not in LOSS_REDUCTIONS:
        hint = " (resolve 'auto' with LossConfig.reduction)" if reduction == "auto" else ""
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(LOSS_REDUCTIONS)}{hint}")
    if reduction == "constant" and (isinstance(max_response_tokens, bool) or not isinstance(max_response_tokens, int)
                                    or max_response_tokens < 1):
        raise ValueError(f"max_response_tokens={max_response_tokens!r}: reduction='constant' (Dr. GRPO) divides by "
                         "the generation budget; set algo.max_response_tokens or rollout.max_new_tokens >= 1")
    counts64 = counts.to(torch.float64)
    num_samples = counts.shape[0]
    if reduction == "token":
        return counts64.sum().clamp_min(1.0).expand(num_samples).clone()
    if reduction == "sample" or (reduction == "rollout" and rollout_ids is None):
        return counts64.clamp_min(1.0) * num_samples
    num_rollouts, rollout = num_samples, None
    if rollout_ids is not None:
        ids = require_1d("rollout_ids", rollout_ids, num_samples)
        require_integer("rollout_ids", ids)
        _, rollout = torch.unique(ids.to(counts.device), return_inverse=True)
        num_rollouts = int(rollout.max()) + 1
    if reduction == "constant":
        return torch.full((num_samples,), float(max_response_tokens * num_rollouts), dtype=torch.float64,
                          device=counts.device)
    # index_add_ on float64 integer counts is exact, so atomics cannot make it nondeterministic.
    rollout_tokens = torch.zeros(num_rollouts, dtype=torch.float64, device=counts.device)
    rollout_tokens.index_add_(0, rollout, counts64)
    return rollout_tokens[rollout].clamp_min(1.0) * num_rollouts


def token_weights(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sample_denominators: torch.Tensor,
) -> torch.Tensor:
    """float32 [num_tokens]: loss_mask_t / denominator[sample(t)] for one micro-batch.

    `sample_denominators` are this micro-batch's samples' entries of `loss_denominators(...)`.
    """
    mask = require_1d("loss_mask", loss_mask)
    cu = check_stream(cu_seqlens, mask.shape[0], mask.device)
    denominators = require_1d("sample_denominators", sample_denominators, cu.shape[0] - 1)
    require_finite("sample_denominators", denominators)
    if bool((denominators <= 0).any()):
        index = int((denominators <= 0).nonzero()[0, 0])
        raise ValueError(f"sample_denominators must be > 0, got {denominators[index].item()} at index {index}")
    per_token = broadcast_to_tokens(denominators.to(mask.device, torch.float64), cu)
    return (mask.to(torch.float64) / per_token).to(torch.float32)


def reduce_tokens(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_t values_t * weights_t: this micro-batch's share of the step-level mean."""
    require_1d("values", values, weights.shape[0])
    # where() rather than multiply: masked tokens may hold inf (e.g. a ratio of an ignored prompt token).
    return torch.where(weights != 0, values.float() * weights, torch.zeros_like(weights)).sum()
