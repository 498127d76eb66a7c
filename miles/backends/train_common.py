"""What every training backend does the same way around its own forward and backward.

The FSDP and Megatron backends differ in how a packed micro-batch becomes log-probs and how
gradients are reduced; everything between "a batch arrived" and "the loss of one micro-batch" is
here, once, so every loss in `miles.algo` behaves identically on either backend.

Design decisions:
- Batch agreement is a collective over ALL trainer ranks, whatever the parallel layout: each rank
  checks what it holds (the whole batch, or its DP shard against the `BatchIndex` the driver sent
  with it), one small all-reduce carries the verdict and the fingerprints (whole batch or index
  equal everywhere; a DP rank's model-parallel peers hold the same shard), and all raise together
  naming the sample (the refusing rank logs why; the others name that rank).
- Advantages and whitening run over a rank's whole groups; `sum_across_ranks` is the caller's, so a
  backend with model-parallel peers sums over its data-parallel group only (peers hold the same
  samples and must not be counted twice).
- `microbatch_loss` is the single call site of `compute_policy_loss`: the choice of pi_old
  (rollout / recompute / the forward's own), the step-level denominators and the train/rollout
  mismatch metrics of `old_logprobs = "rollout"` are decided here for both backends.
- Metric sums are float64 tensors reduced in one all-reduce; `finish_metrics` turns the per-step
  sums into the documented keys (means over optimizer steps; tokens and skipped steps summed).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from miles.algo import LossConfig, compute_advantages, compute_policy_loss, loss_denominators
from miles.algo.layout import cu_seqlens_from_lengths
from miles.algo.losses import kl_penalty
from miles.algo.metrics import mismatch_metrics
from miles.algo.reduce import reduce_tokens, token_weights
from miles.backends.base import TrainPhase
from miles.backends.batch import CheckedBatch, find_batch_error, find_shard_error, number_batch, number_shard
from miles.backends.batch_plan import sample_owners
from miles.backends.config import TrainConfig
from miles.backends.packing import PackedMicroBatch, dummy_microbatch, pack_samples
from miles.wire.messages import BatchIndex, Sample

log = logging.getLogger(__name__)

SHAPING_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def check_loss(loss: LossConfig, backend: str, *, critic: bool = False, teacher: bool = False) -> None:
    """`critic` / `teacher`: whether this backend builds a value model (PPO) / a distillation teacher."""
    if loss.advantage_estimator == "ppo" and loss.loss_type == "policy" and not critic:
        raise NotImplementedError(f"advantage_estimator='ppo' needs a critic, which the {backend} "
                                  "backend does not build yet; use grpo/gspo/reinforce_plus_plus")
    if loss.opd_kl_coef > 0 and not teacher:
        raise NotImplementedError(f"opd_kl_coef > 0 needs teacher log-probs, which the {backend} "
                                  "backend does not compute yet")
    if loss.reduction == "constant" and loss.max_response_tokens < 1:
        raise ValueError("algo.max_response_tokens = 0: the 'constant' loss reduction (Dr. GRPO) divides "
                         "by the generation budget; set it (the trainer actor fills in rollout.max_new_tokens)")


def shaping_kl(loss: LossConfig) -> bool:
    return loss.loss_type == "policy" and loss.kl_coef > 0 and loss.advantage_estimator in SHAPING_ESTIMATORS


def needs_ref(loss: LossConfig) -> bool:
    return (loss.loss_type == "policy" and loss.kl_loss_coef > 0) or shaping_kl(loss)


def runs_ref(loss: LossConfig) -> bool:
    """Whether a reference model, where one was built, scores this step's tokens: every RL step
    (its KL term, or only the logged ref_kl with train.use_ref_model = true), never an SFT step."""
    return loss.loss_type == "policy"


def use_ref_model(config: TrainConfig, loss: LossConfig) -> bool:
    """train.use_ref_model resolved: None follows the loss; false with a KL term is refused."""
    if config.use_ref_model is None:
        return needs_ref(loss)
    if not config.use_ref_model and needs_ref(loss):
        raise ValueError("train.use_ref_model=false but the loss has a KL term "
                         f"(kl_loss_coef={loss.kl_loss_coef}, kl_coef={loss.kl_coef})")
    return config.use_ref_model


def needs_old_logprobs(cfg: TrainConfig, loss: LossConfig) -> bool:
    """Whether a no-grad pass for pi_old runs before training (see fsdp.py's docstring)."""
    return (cfg.old_logprobs == "recompute" or shaping_kl(loss)
            or (cfg.old_logprobs == "auto" and cfg.steps_per_train > 1))


def fingerprint(samples: Sequence[Sample]) -> list[int]:
    crc = 0
    total = 0
    for s in samples:
        crc = zlib.crc32(np.ascontiguousarray(s.tokens).tobytes(), crc)
        crc = zlib.crc32(f"{s.response_length}|{s.reward!r}|{s.group_id}|{s.rollout_id}".encode(), crc)
        if s.loss_mask is not None:
            crc = zlib.crc32(np.ascontiguousarray(s.loss_mask).tobytes(), crc)
        total += len(s.tokens)
    return [len(samples), total, crc]


def index_fingerprint(index: BatchIndex) -> list[int]:
    """What every rank's copy of the index must agree on (positions differ by DP rank)."""
    crc = zlib.crc32(b"1" if index.all_rollout_logprobs else b"0")
    for a in (index.lengths, index.group_index, index.rollout_index, index.trained_tokens):
        crc = zlib.crc32(np.ascontiguousarray(a, np.int64).tobytes(), crc)
    return [len(index.lengths), int(np.sum(index.lengths, dtype=np.int64)), crc]


def agree_on_batch(samples: Sequence[Sample], phase: TrainPhase, *, vocab_size: int,
                   device: torch.device, index: BatchIndex | None = None, dp_size: int = 1,
                   dp_rank: int = 0) -> CheckedBatch:
    """Check the batch (or this rank's shard and the index) on every rank, then agree: all raise
    together or all go on. One int64 all-reduce (MAX) carries the verdict (the refusing rank + 1),
    the fingerprint of what must be the same everywhere (the whole batch, or the index) and, when
    sharded, each DP rank's shard fingerprint (its model-parallel peers must hold the same)."""
    cfg, loss_cfg = phase.config, phase.loss
    need_lp = cfg.old_logprobs == "rollout"
    if index is None:
        error = find_batch_error(samples, vocab_size=vocab_size, loss=loss_cfg, reward_key=cfg.reward_key,
                                 need_rollout_logprobs=need_lp)
    else:
        owners_of = lambda groups, lengths: sample_owners(
            groups, lengths, world_size=dp_size, steps=cfg.steps_per_train,
            max_tokens=cfg.max_tokens_per_microbatch)
        try:
            error = find_shard_error(samples, index, owners_of=owners_of, dp_rank=dp_rank,
                                     vocab_size=vocab_size, loss=loss_cfg, reward_key=cfg.reward_key,
                                     need_rollout_logprobs=need_lp)
        except ValueError as exc:  # the plan itself refused the index (e.g. fewer groups than steps)
            error = f"train batch index: {exc}"
    fp = [0, 0, 0] if error else fingerprint(samples) if index is None else index_fingerprint(index)
    shard_fp = np.full(2 * dp_size, -1, np.int64) if index is not None else np.zeros(0, np.int64)
    if index is not None:
        shard_fp[dp_size:] = -(1 << 40)  # below any -crc: the MAX then reads the peers' minimum
        if not error:
            crc = fingerprint(samples)[2]
            shard_fp[dp_rank], shard_fp[dp_size + dp_rank] = crc, -crc
    rank = dist.get_rank() if dist.is_initialized() else 0
    if error:
        log.error("trainer rank %d refuses the train batch: %s", rank, error)
    local = torch.tensor([rank + 1 if error else 0, *fp, *(-x for x in fp), *shard_fp.tolist()],
                         dtype=torch.int64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    got = local.tolist()
    if got[0]:
        raise ValueError(error or f"train batch refused by trainer rank {got[0] - 1} (it logged why)")
    if any(got[1 + j] != -got[4 + j] for j in range(3)):
        raise ValueError("train batch differs between trainer ranks; every rank must receive the same "
                         + ("whole batch" if index is None else "batch index"))
    if index is None:
        return number_batch(samples, loss=loss_cfg, reward_key=cfg.reward_key)
    for dp in range(dp_size):
        if got[7 + dp] != -got[7 + dp_size + dp]:
            raise ValueError(f"train batch: the trainer ranks of DP rank {dp} (model-parallel peers) "
                             "received different shards; they must train the same samples")
    return number_shard(samples, index, loss=loss_cfg, reward_key=cfg.reward_key)


def pack(batch: CheckedBatch, indices: list[int] | None, with_rollout_lp: bool,
         device: torch.device) -> PackedMicroBatch:
    """One planned micro-batch (None: the zero-weight dummy that keeps a rank in the collectives)."""
    if indices is None:
        mb = dummy_microbatch(device)
        if with_rollout_lp:
            mb.rollout_logprobs = torch.zeros(1, dtype=torch.float32, device=device)
        return mb
    samples = [batch.samples[i] for i in indices]
    return pack_samples([s.tokens for s in samples], [s.response_length for s in samples],
                        [batch.loss_masks[i] for i in indices],
                        [s.rollout_logprobs if with_rollout_lp else None for s in samples],
                        indices, device)


def advantages(batch: CheckedBatch, mbs: list[PackedMicroBatch], old: list[torch.Tensor] | None,
               ref: list[torch.Tensor] | None, loss_cfg: LossConfig, device: torch.device,
               sum_across_ranks: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Per-micro-batch advantages, computed once over this rank's share (whole groups)."""
    return advantages_and_returns(batch, mbs, old, ref, loss_cfg, device, sum_across_ranks)[0]


def advantages_and_returns(batch: CheckedBatch, mbs: list[PackedMicroBatch], old: list[torch.Tensor] | None,
                           ref: list[torch.Tensor] | None, loss_cfg: LossConfig, device: torch.device,
                           sum_across_ranks: Callable[[torch.Tensor], torch.Tensor], *,
                           values: list[torch.Tensor] | None = None, student: list[torch.Tensor] | None = None,
                           teacher: list[torch.Tensor] | None = None,
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-micro-batch (advantages, returns). `values`: the critic's (PPO); `student`/`teacher`: the
    log-probs of on-policy distillation (algo.opd_kl_coef); each a list over `mbs` like `old`."""
    if loss_cfg.loss_type == "sft":
        zeros = [torch.zeros_like(mb.loss_mask) for mb in mbs]
        return zeros, zeros
    real = [j for j, mb in enumerate(mbs) if not mb.is_dummy]
    # A rank without samples still joins the whitening all-reduces, with one zero-weight token.
    use = real or [0]
    idx = [i for j in use for i in mbs[j].sample_indices] or [0]
    mask = torch.cat([mbs[j].loss_mask for j in use]) if real else torch.zeros(1, device=device)
    lengths = [batch.samples[i].response_length for i in idx] if real else [1]
    kl = None
    if shaping_kl(loss_cfg):
        kl = torch.cat([kl_penalty(old[j], ref[j], loss_cfg.kl_loss_type) for j in use])
    t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=device)
    cat = lambda parts: torch.cat([parts[j] for j in use]) if parts is not None else None
    result = compute_advantages(
        loss_cfg, rewards=t(batch.rewards[idx], torch.float32), loss_mask=mask,
        cu_seqlens=cu_seqlens_from_lengths(lengths).to(device),
        group_ids=t(batch.group_index[idx], torch.int64),
        rollout_ids=t(batch.rollout_index[idx], torch.int64), kl=kl, values=cat(values),
        student_logprobs=cat(student), teacher_logprobs=cat(teacher),
        sum_across_ranks=sum_across_ranks)
    sizes = [mbs[j].loss_mask.shape[0] for j in use]
    out = ([torch.zeros_like(mb.loss_mask) for mb in mbs], [torch.zeros_like(mb.loss_mask) for mb in mbs])
    for full, parts in zip(out, (result.advantages, result.returns)):
        pieces = iter(torch.split(parts, sizes))
        for j in real:
            full[j] = next(pieces)
    return out


def step_denominators(batch: CheckedBatch, step_indices: list[int], loss_cfg: LossConfig) -> dict[int, float]:
    """Each sample's loss denominator over the whole optimizer step (all ranks' samples)."""
    counts = torch.as_tensor(batch.trained_tokens[step_indices], dtype=torch.int64)
    rollouts = torch.as_tensor(batch.rollout_index[step_indices], dtype=torch.int64)
    den = loss_denominators(counts, reduction=loss_cfg.reduction, rollout_ids=rollouts,
                            max_response_tokens=loss_cfg.max_response_tokens)
    return dict(zip(step_indices, den.tolist()))


def microbatch_loss(mb: PackedMicroBatch, logp: torch.Tensor, ent: torch.Tensor, *, cfg: TrainConfig,
                    loss_cfg: LossConfig, denominators: dict[int, float], advantages: torch.Tensor,
                    old: torch.Tensor | None, ref: torch.Tensor | None,
                    device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss (a partial sum, see miles.algo.reduce) and its metrics.

    `old`/`ref`: this micro-batch's no-grad log-probs, when those passes ran."""
    # a dummy micro-batch is one sample with no trained token: any positive denominator
    den = torch.tensor([denominators[i] for i in mb.sample_indices] or [1.0], dtype=torch.float64,
                       device=device)
    rollout_is_old = cfg.old_logprobs == "rollout" and not mb.is_dummy
    old_mb = mb.rollout_logprobs if rollout_is_old else old
    loss, metrics = compute_policy_loss(
        logp, loss_mask=mb.loss_mask, sample_denominators=den, cfg=loss_cfg,
        cu_seqlens=mb.response_cu_seqlens, advantages=advantages, old_logprobs=old_mb,
        ref_logprobs=ref, rollout_logprobs=mb.rollout_logprobs,
        entropy=ent if loss_cfg.entropy_coef != 0 else ent.detach())
    if rollout_is_old:
        # pi_old IS the rollout policy here, so the objective's pi_old-vs-rollout mismatch reads 0;
        # measure the policy being trained against it (engine vs trainer, staleness).
        weights = token_weights(mb.loss_mask, mb.response_cu_seqlens, den)
        for name, value in mismatch_metrics(logp, mb.rollout_logprobs).items():
            metrics[name] = reduce_tokens(value, weights)
    return loss, metrics


def add_sums(sums: dict[str, Any], metrics: dict[str, torch.Tensor], mb: PackedMicroBatch) -> None:
    for name, value in metrics.items():
        sums[name] = sums.get(name, 0.0) + value.detach().double()
    sums["tokens"] = sums.get("tokens", 0.0) + float(0 if mb.is_dummy else mb.num_tokens)


def all_reduce_sums(sums: dict[str, Any], device: torch.device, group=None) -> dict[str, float]:
    names = sorted(sums)
    vec = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64, device=device) for n in names])
    dist.all_reduce(vec, group=group)
    return dict(zip(names, vec.tolist()))


def finish_metrics(totals: dict[str, float], steps: int, microbatches: int, batch: CheckedBatch,
                   seconds: float) -> dict[str, float]:
    out = {name: value / steps for name, value in totals.items()}
    for name in ("tokens", "skipped_steps"):
        out[name] = totals.get(name, 0.0)
    out["kl"] = out.get("kl_loss", out.get("ppo_kl", 0.0))
    out["samples"] = float(len(batch.samples))
    out["optimizer_steps"] = float(steps)
    out["microbatches"] = float(microbatches)  # per rank, dummies included
    out["step_s"] = seconds
    out["tokens_per_s"] = out["tokens"] / seconds if seconds > 0 else 0.0
    return out
