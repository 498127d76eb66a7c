"""The per-micro-batch objective the training backend calls: compute_policy_loss / compute_value_loss.

Design decisions:
- One call per micro-batch returns (loss, metrics). `loss` is this micro-batch's partial sum of the
  step loss (see reduce.py): call backward on it as is and do not divide by the micro-batch count.
  Every metric is reduced with the same token weights, so metrics also add up over micro-batches.
- Inputs are the packed stream ([num_tokens] tensors + cu_seqlens) or a padded batch ([B, T]
  tensors, cu_seqlens=None); the padded batch is flattened and treated as B samples of length T.
- Tokens with loss_mask = 0 (prompt, tool output, padding) are replaced by 0 before any math, so
  whatever the backend leaves there (-inf log-probs, stale advantages) can neither produce NaN in
  the forward nor in the backward pass.
- `old_logprobs=None` means the old policy is the current one (one optimizer step per rollout):
  the ratio is exactly 1 but still carries the policy gradient. For slime's "bypass" mode pass the
  rollout log-probs as `old_logprobs`.
- The IS numerator of TIS/MIS is the old-policy log-prob (the trainer's recompute), as in slime.
"""

from __future__ import annotations

import torch

from miles.algo.checks import require_float, require_mask, require_tensor
from miles.algo.config import LossConfig
from miles.algo.corrections import mis_weights, tis_weights
from miles.algo.layout import check_stream, padded_cu_seqlens
from miles.algo.losses import (
    clipped_value_loss,
    gspo_log_ratio,
    kl_penalty,
    ppo_clip_loss,
    sft_loss,
    token_log_ratio,
)
from miles.algo.metrics import approx_kl, mismatch_metrics, reference_kl
from miles.algo.reduce import reduce_tokens, token_weights

Metrics = dict[str, torch.Tensor]


def compute_policy_loss(
    logprobs: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    sample_denominators: torch.Tensor,
    cfg: LossConfig,
    cu_seqlens: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Policy (or SFT, cfg.loss_type == "sft") loss of one micro-batch and its metrics.

    logprobs: current policy log-probs of the sampled tokens (requires grad), [T] or [B, T].
    loss_mask: 1 on trained tokens. sample_denominators: [num_samples] from `loss_denominators`.
    advantages: required for "policy". ref_logprobs: required when kl_loss_coef > 0.
    rollout_logprobs: required by use_tis / use_mis; also enables the mismatch metrics.
    entropy: per-token entropy (differentiable), required when entropy_coef != 0.
    """
    tokens = _token_stream(
        cu_seqlens,
        logprobs=logprobs,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        entropy=entropy,
    )
    cu, keep = tokens.pop("cu_seqlens"), tokens.pop("keep")
    weights = token_weights(tokens["loss_mask"], cu, sample_denominators)
    logp = tokens["logprobs"]
    metrics: Metrics = {}

    def log(name: str, per_token: torch.Tensor) -> torch.Tensor:
        metrics[name] = reduce_tokens(per_token.detach(), weights)
        return metrics[name]

    if cfg.loss_type == "sft":
        per_token = sft_loss(logp)
        log("sft_loss", per_token)
    else:
        adv = _need(tokens, "advantages", "loss_type='policy'")
        old = tokens["old_logprobs"] if "old_logprobs" in tokens else logp.detach()
        if cfg.advantage_estimator == "gspo":
            log_ratio = gspo_log_ratio(logp, old, tokens["loss_mask"], cu)
        else:
            log_ratio = token_log_ratio(logp, old)
        log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
        clip = ppo_clip_loss(
            log_ratio, adv, eps_clip=cfg.eps_clip, eps_clip_high=cfg.clip_high, eps_clip_c=cfg.eps_clip_c
        )
        pg = clip.loss
        if cfg.use_tis or cfg.use_mis:
            rollout = _need(tokens, "rollout_logprobs", "use_tis" if cfg.use_tis else "use_mis")
            if cfg.use_tis:
                correction = tis_weights(old, rollout, clip=cfg.tis_clip, clip_low=cfg.tis_clip_low)
                log("tis", correction.ratio)
                log("tis_clipfrac", correction.corrected)
            else:
                correction = mis_weights(old, rollout, low=cfg.mis_low, high=cfg.mis_high)
                log("mis_ratio", correction.ratio)
                log("mis_masked_frac", correction.corrected)
            pg = pg * correction.weights
        per_token = pg
        log("pg_loss", pg)
        log("pg_clipfrac", clip.clipped)
        if cfg.eps_clip_c is not None:
            log("pg_dual_clipfrac", clip.dual_clipped)
        log("ppo_kl", approx_kl(logp, old))
        if "ref_logprobs" in tokens:   # given whenever a reference model runs, KL term or not
            log("ref_kl", reference_kl(logp, tokens["ref_logprobs"]))
        if cfg.kl_loss_coef > 0:
            ref = _need(tokens, "ref_logprobs", f"kl_loss_coef={cfg.kl_loss_coef}")
            # Unbiased KL (DeepSeek-V3.2): tokens come from pi_old, so weight by pi / pi_old, with gradient.
            ratio = torch.exp(torch.where(keep, token_log_ratio(logp, old), 0.0)) if cfg.use_unbiased_kl else None
            kl = kl_penalty(logp, ref, cfg.kl_loss_type, importance_ratio=ratio)
            log("kl_loss", kl)
            per_token = per_token + cfg.kl_loss_coef * kl
        if "rollout_logprobs" in tokens:
            for name, value in mismatch_metrics(old, tokens["rollout_logprobs"]).items():
                log(name, value)

    if cfg.entropy_coef != 0:
        ent = _need(tokens, "entropy", f"entropy_coef={cfg.entropy_coef}")
        per_token = per_token - cfg.entropy_coef * ent.float()
    if "entropy" in tokens:
        log("entropy", tokens["entropy"])
    loss = reduce_tokens(per_token, weights)
    metrics["loss"] = loss.detach()
    return loss, metrics


def compute_value_loss(
    values: torch.Tensor,
    *,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_denominators: torch.Tensor,
    cfg: LossConfig,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped critic loss of one micro-batch (PPO), reduced like the policy loss."""
    tokens = _token_stream(
        cu_seqlens, values=values, old_values=old_values, returns=returns, loss_mask=loss_mask
    )
    weights = token_weights(tokens["loss_mask"], tokens["cu_seqlens"], sample_denominators)
    result = clipped_value_loss(tokens["values"], tokens["old_values"], tokens["returns"], value_clip=cfg.value_clip)
    loss = reduce_tokens(result.loss, weights)
    metrics = {"value_loss": loss.detach(), "value_clipfrac": reduce_tokens(result.clipped, weights)}
    return loss, metrics


def _token_stream(cu_seqlens: torch.Tensor | None, **given: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Validate and flatten the token tensors; zero every float tensor where loss_mask is 0.

    Returns the given tensors as 1-D, plus "cu_seqlens" and "keep" (bool loss mask).
    """
    present = {name: require_tensor(name, t) for name, t in given.items() if t is not None}
    mask = present["loss_mask"]
    first_name = next(iter(present))
    shape = present[first_name].shape
    for name, t in present.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like {first_name}")
    if cu_seqlens is None:
        if len(shape) != 2:
            raise ValueError(
                f"without cu_seqlens the tensors must be a padded [B, T] batch, got shape {tuple(shape)}"
            )
        cu = padded_cu_seqlens(shape[0], shape[1], device=mask.device)
        present = {name: t.reshape(-1) for name, t in present.items()}
    else:
        if len(shape) != 1:
            raise ValueError(
                f"{first_name} must be 1-D [num_tokens] when cu_seqlens is given (pass cu_seqlens=None for a "
                f"padded [B, T] batch), got shape {tuple(shape)}"
            )
        cu = check_stream(cu_seqlens, shape[0], mask.device)
    mask = present["loss_mask"]
    require_mask("loss_mask", mask)
    keep = mask != 0
    out: dict[str, torch.Tensor] = {}
    for name, t in present.items():
        if name == "loss_mask":
            out[name] = t
            continue
        require_float(name, t)
        finite = torch.isfinite(t) | ~keep
        if not bool(finite.all()):
            index = int((~finite).nonzero()[0, 0])
            raise ValueError(f"{name} has a non-finite value {t[index].item()} at trained token {index}")
        out[name] = torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))
    out["cu_seqlens"] = cu
    out["keep"] = keep
    return out


def _need(tokens: dict[str, torch.Tensor], name: str, why: str) -> torch.Tensor:
    if name not in tokens:
        raise ValueError(f"{name} is required for {why}")
    return tokens[name]
