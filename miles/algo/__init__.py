"""miles.algo: advantages, losses, mismatch corrections and loss reduction as pure functions on tensors.

Imports nothing of Miles except its own config. This is the stable API the training backends call.

Layout (packed stream; a padded [B, T] batch is B samples of length T)
    cu_seqlens: int64 [S + 1]; sample i owns tokens cu_seqlens[i]:cu_seqlens[i + 1] of the stream.
    Per-token tensors are 1-D [T]: entry t belongs to the sampled token t (its log-prob, advantage,
    ...). loss_mask [T] (any dtype, 0/1) is 1 on trained model tokens and 0 on prompt, tool and
    padding tokens; whatever sits under a 0 is ignored, even inf/NaN. A sample is never split across
    micro-batches. Per-sample metadata (cu_seqlens, rewards, ids, denominators) may stay on the CPU
    while token tensors are on the GPU. Ids are int tensors: map the wire's string group_id /
    rollout_id with layout.ids_to_index(ids, empty_is_unique=True).
    layout.cu_seqlens_from_lengths(lengths) / layout.padded_cu_seqlens(batch_size, seq_len)
    layout.loss_mask_counts(loss_mask, cu_seqlens) -> int64 [S]

Config
    LossConfig (msgspec Struct, frozen, forbid_unknown_fields; defaults as in slime):
    advantage_estimator "grpo" | "dr_grpo" | "gspo" | "reinforce_plus_plus" |
    "reinforce_plus_plus_baseline" | "ppo"; normalize_std, normalize_advantages, gamma, lambd,
    kl_coef (reward shaping); loss_type "policy" | "sft"; eps_clip, eps_clip_high, eps_clip_c;
    kl_loss_coef, kl_loss_type, use_unbiased_kl; entropy_coef; use_tis, tis_clip, tis_clip_low;
    use_mis, mis_low, mis_high; loss_reduction "auto" | "token" | "sample" | "rollout" | "constant",
    max_response_tokens; value_clip; opd_kl_coef, opd_only. `cfg.reduction` is the reduction in force: "auto"
    lets the estimator pick its paper's (dr_grpo: "constant", gspo: per-sequence mean), and a
    reduction the estimator's paper contradicts is refused.

Once per training step
    compute_advantages(cfg, *, rewards[S], loss_mask[T], cu_seqlens[S+1], group_ids[S]=None,
        rollout_ids[S]=None, kl[T]=None, values[T]=None, student_logprobs[T]=None,
        teacher_logprobs[T]=None, sum_across_ranks=None) -> AdvantageResult(advantages[T], returns[T])
        GRPO-family statistics need every sample of a group in the call; REINFORCE++ whitening uses
        sum_across_ranks (all_reduce SUM of a float64 [3]) so DP shards whiten with global moments.
    loss_denominators(loss_mask_counts[S], *, reduction=cfg.reduction, rollout_ids[S]=None,
        max_response_tokens=cfg.max_response_tokens) -> float64 [S]. Call it on the WHOLE step:
        every micro-batch of every DP rank.

Per micro-batch
    compute_policy_loss(logprobs, *, loss_mask, sample_denominators, cfg, cu_seqlens=None,
        advantages=None, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, entropy=None)
        -> (loss, metrics: dict[str, 0-d tensor])
    compute_value_loss(values, *, old_values, returns, loss_mask, sample_denominators, cfg,
        cu_seqlens=None) -> (loss, metrics)
    old_logprobs=None: the old policy is the current one (ratio 1, one update per rollout).
    `loss` is a partial sum: backward it as is; summed over micro-batches it is the step loss. Never
    divide by the number of micro-batches; under DP with averaged gradients multiply by the DP world
    size. Metrics are partial sums too: add them over micro-batches and ranks.

Example (one rank, micro-batches = lists of sample indices of the step):
    counts = loss_mask_counts(mask, cu)
    adv = compute_advantages(cfg, rewards=r, loss_mask=mask, cu_seqlens=cu, group_ids=g).advantages
    den = loss_denominators(counts, reduction=cfg.reduction, rollout_ids=rid)
    for samples in micro_batches:                       # contiguous here for brevity
        lo, hi = cu[samples[0]], cu[samples[-1] + 1]
        loss, metrics = compute_policy_loss(logp_fn(lo, hi), loss_mask=mask[lo:hi],
            sample_denominators=den[samples], cfg=cfg, cu_seqlens=cu[samples[0]:samples[-1] + 2] - lo,
            advantages=adv[lo:hi], old_logprobs=old[lo:hi])
        loss.backward()

Building blocks (also public): advantages.group_advantages / reinforce_plus_plus_returns /
gae_advantages / whiten / apply_distillation; losses.ppo_clip_loss / gspo_log_ratio / kl_penalty /
entropy_from_logits / sft_loss / clipped_value_loss; corrections.tis_weights / mis_weights;
reduce.token_weights / reduce_tokens; metrics.mismatch_metrics / approx_kl. These take every tensor
on one device.

Every public function refuses bad input (shape mismatch, NaN, empty batch, bad mask, bad config)
with a ValueError that names the argument and the value.
"""

import importlib

# Lazy exports (PEP 562): `miles.algo.config` is read by every process that loads a recipe, and
# importing torch there would cost seconds per actor process that never computes a loss.
_EXPORTS = {
    "AdvantageResult": "advantages", "compute_advantages": "advantages", "group_advantages": "advantages",
    "LossConfig": "config",
    "cu_seqlens_from_lengths": "layout", "ids_to_index": "layout", "loss_mask_counts": "layout",
    "padded_cu_seqlens": "layout",
    "entropy_from_logits": "losses", "kl_penalty": "losses",
    "compute_policy_loss": "objective", "compute_value_loss": "objective",
    "loss_denominators": "reduce",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles.algo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"miles.algo.{module}"), name)


__all__ = [
    "AdvantageResult",
    "LossConfig",
    "compute_advantages",
    "compute_policy_loss",
    "compute_value_loss",
    "cu_seqlens_from_lengths",
    "entropy_from_logits",
    "group_advantages",
    "ids_to_index",
    "kl_penalty",
    "loss_denominators",
    "loss_mask_counts",
    "padded_cu_seqlens",
]
