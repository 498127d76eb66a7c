"""miles.algo: advantages, losses, mismatch corrections and loss reduction as pure functions on tensors.

Imports nothing of Miles except its own config. Stable API for the training backends:

Layout (packed stream; a padded [B, T] batch is B samples of length T)
    cu_seqlens: int64 [num_samples + 1]; sample i owns tokens cu_seqlens[i]:cu_seqlens[i + 1].
    Per-token tensors are 1-D [num_tokens] and aligned with the sampled tokens; loss_mask is 1 on
    trained (model) tokens, 0 on prompt / tool / padding tokens. A sample is never split across
    micro-batches.
    layout.cu_seqlens_from_lengths(lengths) -> cu_seqlens
    layout.padded_cu_seqlens(batch_size, seq_len) -> cu_seqlens
    layout.loss_mask_counts(loss_mask, cu_seqlens) -> int64 [num_samples]

Config
    LossConfig (msgspec Struct, forbid_unknown_fields): advantage_estimator, normalize_std, gamma,
    lambd, kl_coef, loss_type, eps_clip(_high, _c), kl_loss_coef, kl_loss_type, entropy_coef,
    use_tis/tis_clip/tis_clip_low, use_mis/mis_low/mis_high, loss_reduction, value_clip, opd_kl_coef.

Once per training step, on the whole step (all micro-batches; all DP ranks for the denominators)
    compute_advantages(cfg, *, rewards[S], loss_mask[T], cu_seqlens[S+1], group_ids[S]=None,
        rollout_ids[S]=None, kl[T]=None, values[T]=None, student_logprobs=None, teacher_logprobs=None,
        sum_across_ranks=None) -> AdvantageResult(advantages[T], returns[T])
    loss_denominators(loss_mask_counts[S], *, reduction=cfg.loss_reduction, rollout_ids[S]=None)
        -> float64 [S]

Per micro-batch (slice advantages / denominators to the micro-batch's tokens / samples)
    compute_policy_loss(logprobs, *, loss_mask, sample_denominators, cfg, cu_seqlens=None,
        advantages=None, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, entropy=None)
        -> (loss, metrics)
    compute_value_loss(values, *, old_values, returns, loss_mask, sample_denominators, cfg,
        cu_seqlens=None) -> (loss, metrics)
    `loss` is a partial sum: backward it as is; summed over micro-batches it is the step loss.
    Never divide by the number of micro-batches; under DP with averaged gradients multiply by the
    DP world size. Metrics are partial sums too: add them over micro-batches and ranks.

Building blocks (also public): advantages.group_advantages / reinforce_plus_plus_returns /
gae_advantages / whiten / apply_distillation; losses.ppo_clip_loss / gspo_log_ratio / kl_penalty /
entropy_from_logits / sft_loss / clipped_value_loss; corrections.tis_weights / mis_weights;
reduce.token_weights / reduce_tokens; metrics.mismatch_metrics / approx_kl.

Every public function refuses bad input (shape mismatch, NaN, empty batch, bad mask) with a
ValueError that names the argument and the value.
"""

from miles.algo.advantages import AdvantageResult, compute_advantages, group_advantages
from miles.algo.config import LossConfig
from miles.algo.layout import cu_seqlens_from_lengths, loss_mask_counts, padded_cu_seqlens
from miles.algo.losses import entropy_from_logits, kl_penalty
from miles.algo.objective import compute_policy_loss, compute_value_loss
from miles.algo.reduce import loss_denominators

__all__ = [
    "AdvantageResult",
    "LossConfig",
    "compute_advantages",
    "compute_policy_loss",
    "compute_value_loss",
    "cu_seqlens_from_lengths",
    "entropy_from_logits",
    "group_advantages",
    "kl_penalty",
    "loss_denominators",
    "loss_mask_counts",
    "padded_cu_seqlens",
]
