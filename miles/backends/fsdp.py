"""FSDPBackend: PyTorch FSDP2 over a transformers causal LM (Qwen2, Qwen3, Qwen3-MoE, ...).

Design decisions:
- `fully_shard` on every decoder layer and on the root (`PackedPolicy`, which owns the embedding,
  final norm and LM head), over a 1-D device mesh of all trainer ranks (pure data parallel).
- Precision: fp32 sharded parameters (the optimizer's master copy) with a MixedPrecisionPolicy that
  all-gathers them as `param_dtype` (bf16) for compute and reduce-scatters gradients in
  `reduce_dtype` (fp32). `master_weights_fp32=false` loads the weights in bf16 and steps them there.
- One `train(samples)` call: agree on the batch (all ranks) -> plan steps / ranks / packed micro-batches
  (packing.py) -> no-grad pass for old / reference log-probs when the objective needs them ->
  advantages on this rank's whole groups (algo; whitening all-reduced) -> per optimizer step:
  forward, `compute_policy_loss` with step-level denominators over all ranks' samples, backward,
  clip, AdamW.
- The per-micro-batch loss is a partial sum of the step loss (see miles.algo.reduce); FSDP averages
  gradients over ranks, so each rank's loss is multiplied by the world size to make that a sum.
- Phases (base.py): `train(samples, phase)` reads every objective and schedule knob from the phase
  it is given, never from attributes a caller may change between calls. Each phase name has its own
  AdamW and step count; the main phase's ("rl", built at init) is the one checkpoints and `step`
  cover. Another phase's optimizer is built at its first step and dropped when the main phase next
  trains, so a warm-start costs one extra optimizer state only while it runs, and RL begins at step
  0 of its own schedule with empty Adam moments.
- Old log-probs by `train.old_logprobs`: "rollout" uses the engine's log-probs of the sampled
  tokens as pi_old in every loop mode (sync, one-step-off, fully async: the PPO ratio is then
  against the policy that actually sampled, so stale samples are clipped), refusing a sample
  without them; "recompute" runs a no-grad pass with the current weights; "auto" is "recompute"
  with several steps per batch (or KL reward shaping) and otherwise the training forward's own
  detached log-probs: the policy has not moved yet, so a second forward would be wasted work, but
  the ratio is exactly 1, which is right on-policy only (the recipe loader turns "auto" into
  "rollout" for stale loops).
  With "rollout", TIS/MIS weights pi_old / pi_rollout are 1 by construction (a warning says so),
  and the train/rollout mismatch metrics compare the trained policy's log-probs with the rollout's.
- A step whose gradient norm is not finite is skipped (no update, `skipped_steps` = 1) rather than
  poisoning the weights; the caller sees it in the metrics.
- FSDP2 leaves the root unsharded after a forward without backward; everything that reads the
  parameters as shards (sleep, weight sync, export, checkpoints) reshards first.
- Metrics (identical on every rank; means over the call's optimizer steps): loss, pg_loss,
  pg_clipfrac, ppo_kl, kl (= kl_loss when a KL loss is on, else ppo_kl), kl_loss, entropy,
  train_rollout_logprob_abs_diff, train_rollout_kl, tis/mis stats, grad_norm, lr; sums: tokens,
  skipped_steps; and samples, optimizer_steps, microbatches (this rank), step_s, tokens_per_s.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.algo import LossConfig, compute_advantages, compute_policy_loss, loss_denominators
from miles.algo.layout import cu_seqlens_from_lengths
from miles.algo.losses import kl_penalty
from miles.algo.metrics import mismatch_metrics
from miles.algo.reduce import reduce_tokens, token_weights
from miles.backends import attention
from miles.backends.base import MAIN_PHASE, Metrics, RankInfo, TrainingBackend, TrainPhase
from miles.backends.batch import CheckedBatch, find_batch_error, number_batch
from miles.backends.checkpoint import load_checkpoint, save_checkpoint
from miles.backends.config import TrainConfig
from miles.backends.distributed import init_process_group, pick_device
from miles.backends.hf_weights import NamedTensors, export_hf, iter_hf_weight_buckets
from miles.backends.offload import HostOffload
from miles.backends.optim import build_adamw, lr_at, set_lr
from miles.backends.packing import PackedMicroBatch, dummy_microbatch, pack_samples, plan_batch
from miles.backends.policy import PackedPolicy
from miles.weights.base import WeightTransport
from miles.wire.messages import Sample

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SHAPING_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class FSDPBackend(TrainingBackend):
    name = "fsdp"

    def __init__(self) -> None:
        self.cfg: TrainConfig | None = None
        self.policy: PackedPolicy | None = None
        self.ref: PackedPolicy | None = None
        self._optimizers: dict[str, torch.optim.Optimizer] = {}  # per phase name; MAIN_PHASE first
        self._steps: dict[str, int] = {}
        self._offload = HostOffload()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The main phase's optimizer: what checkpoints save and restore."""
        return self._optimizers.get(MAIN_PHASE)

    # ------------------------------------------------------------------ init
    def init(self, config: TrainConfig, rank: RankInfo, loss: LossConfig | None = None) -> None:
        loss = loss or LossConfig()
        if config.backend != "fsdp":
            raise ValueError(f"train.backend={config.backend!r} given to the FSDP backend")
        if not config.model_path:
            raise ValueError("train.model_path is empty; it must name an HF safetensors directory")
        _check_loss(loss)
        if loss.loss_type == "policy" and config.old_logprobs == "rollout" and (loss.use_tis or loss.use_mis):
            log.warning("train.old_logprobs = 'rollout' with algo.%s = true: the IS weight pi_old / pi_rollout "
                        "is 1 by construction (the PPO ratio already compares with the sampling policy)",
                        "use_tis" if loss.use_tis else "use_mis")
        rank.check()
        self.cfg, self.loss_cfg, self.rank = config, loss, rank
        self.device = pick_device(rank)
        init_process_group(rank, self.device)
        torch.manual_seed(config.seed + rank.rank)
        np.random.seed((config.seed + rank.rank) % 2**32)
        self.compute_dtype = DTYPES[config.param_dtype]
        # Compiled norms/MLP/rotary: 42-44% -> 47-48% MFU on an H200 (bench/train.py). Off on CPU
        # by default, where inductor's C++ compile costs more than it saves on small models.
        self.use_compile = config.compile if config.compile is not None else self.device.type == "cuda"
        if config.attention == "packed":
            attention.register()
            attention.enable_varlen_kernel(self.device, self.compute_dtype)
        self.mesh = init_device_mesh(self.device.type, (rank.world_size,))
        use_ref = config.use_ref_model
        if use_ref is None:
            use_ref = _needs_ref(loss)
        elif not use_ref and _needs_ref(loss):
            raise ValueError("train.use_ref_model=false but the loss has a KL term "
                             f"(kl_loss_coef={loss.kl_loss_coef}, kl_coef={loss.kl_coef})")
        self.policy = self._build(config.model_path, trainable=True)
        self.ref = self._build(config.ref_model_path or config.model_path, trainable=False) if use_ref else None
        self.vocab_size = int(self.policy.lm.config.vocab_size)
        self._optimizers = {MAIN_PHASE: build_adamw(self.policy, config, self.device)}
        self._steps = {MAIN_PHASE: 0}

    def _build(self, path: str, *, trainable: bool) -> PackedPolicy:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per rank per load is noise in rank logs
        cfg = self.cfg
        master = torch.float32 if (trainable and cfg.master_weights_fp32) else self.compute_dtype
        attn = attention.ATTN_IMPLEMENTATION if cfg.attention == "packed" else cfg.attention
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=master, attn_implementation=attn)
        lm.config.use_cache = False
        if trainable:
            lm.train()
            if cfg.gradient_checkpointing:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.eval().requires_grad_(False)
        policy = PackedPolicy(lm, packed_attention=cfg.attention == "packed",
                              temperature=cfg.temperature, chunk_bytes=cfg.logprob_chunk_bytes)
        if self.use_compile:
            _compile_elementwise_parts(lm)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype if master != self.compute_dtype else None,
                                  reduce_dtype=DTYPES[cfg.reduce_dtype])
        # Resharding after forward saves memory with several ranks and buys nothing with one
        # (there is nothing to gather from), where it costs a second all-gather (a cast of every
        # weight) per layer in backward; so "auto" (None) reshards only with several ranks.
        # Either way every reader of the shards (sleep, export, state dicts) reshards first.
        reshard = cfg.reshard_after_forward
        if reshard is None:
            reshard = self.rank.world_size > 1
        for layer in lm.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(policy, mesh=self.mesh, mp_policy=mp, reshard_after_forward=reshard)
        return policy

    @property
    def step(self) -> int:
        return self._steps.get(MAIN_PHASE, 0)

    def _resolve_phase(self, phase: TrainPhase | None) -> TrainPhase:
        if phase is None:
            return TrainPhase(MAIN_PHASE, self.loss_cfg, self.cfg)
        if phase.config.model_path != self.cfg.model_path:
            raise ValueError(f"phase {phase.name!r}: train.model_path = {phase.config.model_path!r}, but the "
                             f"backend was built from {self.cfg.model_path!r}; a phase cannot change the model")
        _check_loss(phase.loss)
        if self.ref is None and _needs_ref(phase.loss):
            raise ValueError(f"phase {phase.name!r}: the loss has a KL term (kl_loss_coef="
                             f"{phase.loss.kl_loss_coef}, kl_coef={phase.loss.kl_coef}) but init built no "
                             "reference model")
        return phase

    def _phase_optimizer(self, phase: TrainPhase) -> torch.optim.Optimizer:
        if phase.name == MAIN_PHASE:
            # The warm-start is over: free its Adam moments (a second full optimizer state on the device).
            for name in [n for n in self._optimizers if n != MAIN_PHASE]:
                del self._optimizers[name], self._steps[name]
        elif phase.name not in self._optimizers:
            self._optimizers[phase.name] = build_adamw(self.policy, phase.config, self.device)
            self._steps[phase.name] = 0
        return self._optimizers[phase.name]

    # ------------------------------------------------------------------ train
    def train(self, samples: Sequence[Sample], phase: TrainPhase | None = None) -> Metrics:
        self._require_awake("train")
        t0 = time.perf_counter()
        phase = self._resolve_phase(phase)
        cfg, loss_cfg, world = phase.config, phase.loss, self.rank.world_size
        batch = self._agree_on_batch(samples, phase)
        optimizer = self._phase_optimizer(phase)
        plan = plan_batch(batch.group_index, batch.lengths, world_size=world,
                          steps=cfg.steps_per_train, max_tokens=cfg.max_tokens_per_microbatch)
        with_rollout_lp = all(s.rollout_logprobs is not None for s in batch.samples)
        mine = [[self._pack(batch, idx, with_rollout_lp) for idx in step[self.rank.rank]] for step in plan]
        flat = [mb for step in mine for mb in step]

        shaping = _shaping_kl(loss_cfg)
        need_old = (cfg.old_logprobs == "recompute" or shaping
                    or (cfg.old_logprobs == "auto" and cfg.steps_per_train > 1))
        old = self._no_grad_logprobs(self.policy, flat) if need_old else None
        ref = self._no_grad_logprobs(self.ref, flat) if self.ref is not None and _needs_ref(loss_cfg) else None
        advantages = self._advantages(batch, flat, old, ref, loss_cfg)

        totals: dict[str, float] = {}
        k = 0
        for step_plan, step_mbs in zip(plan, mine):
            step_indices = sorted(i for rank_plan in step_plan for mb in rank_plan if mb for i in mb)
            denominators = self._denominators(batch, step_indices, loss_cfg)
            optimizer.zero_grad(set_to_none=True)  # nothing left over from a failed call
            sums: dict[str, torch.Tensor] = {}
            for mb in step_mbs:
                logp, ent = self.policy.run(mb.inputs)
                # a dummy micro-batch is one sample with no trained token: any positive denominator
                den = torch.tensor([denominators[i] for i in mb.sample_indices] or [1.0],
                                   dtype=torch.float64, device=self.device)
                rollout_is_old = cfg.old_logprobs == "rollout" and not mb.is_dummy
                if rollout_is_old:
                    old_mb = mb.rollout_logprobs
                else:
                    old_mb = old[k] if old is not None else None
                loss, metrics = compute_policy_loss(
                    logp, loss_mask=mb.loss_mask, sample_denominators=den,
                    cfg=loss_cfg, cu_seqlens=mb.response_cu_seqlens, advantages=advantages[k],
                    old_logprobs=old_mb, ref_logprobs=ref[k] if ref is not None else None,
                    rollout_logprobs=mb.rollout_logprobs,
                    entropy=ent if loss_cfg.entropy_coef != 0 else ent.detach())
                if rollout_is_old:
                    # pi_old IS the rollout policy here, so the objective's pi_old-vs-rollout mismatch
                    # reads 0; measure the policy being trained against it (engine vs trainer, staleness).
                    weights = token_weights(mb.loss_mask, mb.response_cu_seqlens, den)
                    for name, value in mismatch_metrics(logp, mb.rollout_logprobs).items():
                        metrics[name] = reduce_tokens(value, weights)
                (loss * world).backward()
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.detach().double()
                sums["tokens"] = sums.get("tokens", 0.0) + float(0 if mb.is_dummy else mb.num_tokens)
                k += 1
            step_metrics = self._optimizer_step(phase)
            step_metrics.update(self._all_reduce_sums(sums))
            for name, value in step_metrics.items():
                totals[name] = totals.get(name, 0.0) + value
        return self._finish_metrics(totals, len(plan), k, batch, time.perf_counter() - t0)

    def _agree_on_batch(self, samples: Sequence[Sample], phase: TrainPhase) -> CheckedBatch:
        """Check the batch on every rank, then agree: all raise together or all go on."""
        cfg, loss_cfg = phase.config, phase.loss
        error = find_batch_error(samples, vocab_size=self.vocab_size, loss=loss_cfg,
                                 reward_key=cfg.reward_key,
                                 need_rollout_logprobs=cfg.old_logprobs == "rollout")
        fingerprint = [0, 0, 0] if error else _fingerprint(samples)
        local = torch.tensor([1 if error else 0, *fingerprint, *(-x for x in fingerprint)],
                             dtype=torch.int64, device=self.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        if int(local[0]):
            raise ValueError(error or "train batch refused by another trainer rank (it logged why)")
        if any(int(local[1 + j]) != -int(local[4 + j]) for j in range(3)):
            raise ValueError("train batch differs between trainer ranks; every rank must receive "
                             "the same whole batch")
        return number_batch(samples, loss=loss_cfg, reward_key=cfg.reward_key)

    def _pack(self, batch: CheckedBatch, indices: list[int] | None, with_rollout_lp: bool) -> PackedMicroBatch:
        if indices is None:
            mb = dummy_microbatch(self.device)
            if with_rollout_lp:
                mb.rollout_logprobs = torch.zeros(1, dtype=torch.float32, device=self.device)
            return mb
        samples = [batch.samples[i] for i in indices]
        return pack_samples([s.tokens for s in samples], [s.response_length for s in samples],
                            [batch.loss_masks[i] for i in indices],
                            [s.rollout_logprobs if with_rollout_lp else None for s in samples],
                            indices, self.device)

    @torch.no_grad()
    def _no_grad_logprobs(self, model: PackedPolicy, mbs: list[PackedMicroBatch]) -> list[torch.Tensor]:
        out = [model.run(mb.inputs)[0] for mb in mbs]
        reshard(model)
        return out

    def _advantages(self, batch: CheckedBatch, mbs: list[PackedMicroBatch], old: list[torch.Tensor] | None,
                    ref: list[torch.Tensor] | None, loss_cfg: LossConfig) -> list[torch.Tensor]:
        """Per-micro-batch advantages, computed once over this rank's share (whole groups)."""
        if loss_cfg.loss_type == "sft":
            return [torch.zeros_like(mb.loss_mask) for mb in mbs]
        real = [j for j, mb in enumerate(mbs) if not mb.is_dummy]
        # A rank without samples still joins the whitening all-reduces, with one zero-weight token.
        use = real or [0]
        idx = [i for j in use for i in mbs[j].sample_indices] or [0]
        mask = torch.cat([mbs[j].loss_mask for j in use]) if real else torch.zeros(1, device=self.device)
        lengths = [batch.samples[i].response_length for i in idx] if real else [1]
        kl = None
        if _shaping_kl(loss_cfg):
            kl = torch.cat([kl_penalty(old[j], ref[j], loss_cfg.kl_loss_type) for j in use])
        t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=self.device)
        result = compute_advantages(
            loss_cfg, rewards=t(batch.rewards[idx], torch.float32), loss_mask=mask,
            cu_seqlens=cu_seqlens_from_lengths(lengths).to(self.device),
            group_ids=t(batch.group_index[idx], torch.int64),
            rollout_ids=t(batch.rollout_index[idx], torch.int64), kl=kl,
            sum_across_ranks=self._sum_across_ranks)
        pieces = iter(torch.split(result.advantages, [mbs[j].loss_mask.shape[0] for j in use]))
        out = [torch.zeros_like(mb.loss_mask) for mb in mbs]
        for j in real:
            out[j] = next(pieces)
        return out

    def _sum_across_ranks(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    def _denominators(self, batch: CheckedBatch, step_indices: list[int], loss_cfg: LossConfig) -> dict[int, float]:
        counts = torch.tensor([int(batch.loss_masks[i].sum()) for i in step_indices], dtype=torch.int64)
        rollouts = torch.as_tensor(batch.rollout_index[step_indices], dtype=torch.int64)
        den = loss_denominators(counts, reduction=loss_cfg.reduction, rollout_ids=rollouts,
                                max_response_tokens=loss_cfg.max_response_tokens)
        return dict(zip(step_indices, den.tolist()))

    def _optimizer_step(self, phase: TrainPhase) -> dict[str, float]:
        cfg, optimizer, step = phase.config, self._optimizers[phase.name], self._steps[phase.name]
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        lr = lr_at(step, cfg)
        skipped = not np.isfinite(grad_norm)
        if skipped:
            log.warning("%s step %d: grad_norm=%s is not finite; skipping the update", phase.name, step, grad_norm)
        else:
            set_lr(optimizer, lr)
            optimizer.step()
            self._steps[phase.name] = step + 1
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(skipped)}

    def _all_reduce_sums(self, sums: dict[str, Any]) -> dict[str, float]:
        names = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64, device=self.device) for n in names])
        dist.all_reduce(vec)
        return dict(zip(names, vec.tolist()))

    def _finish_metrics(self, totals: dict[str, float], steps: int, microbatches: int,
                        batch: CheckedBatch, seconds: float) -> Metrics:
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

    # ------------------------------------------------------------------ weights out
    def iter_hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[NamedTensors]:
        """Full tensors under HF names in buckets (collective: every rank iterates to the end)."""
        self._require_awake("iter_hf_weight_buckets")
        reshard(self.policy)
        return iter_hf_weight_buckets(self.policy.lm, bucket_bytes or self.cfg.update_bucket_bytes,
                                      dtype=self.compute_dtype)

    def update_weights(self, transport: WeightTransport, version: int) -> None:
        sender = transport.is_sender
        if sender:
            transport.begin(version)
        for bucket in self.iter_hf_weight_buckets():
            if sender:
                transport.send_bucket(bucket)
        if sender:
            transport.finish(version)

    def save_model(self, path: str | Path, hf: bool = False,
                   extra_state: dict[str, Any] | None = None) -> None:
        self._require_awake("save_model")
        reshard(self.policy)
        if hf:
            export_hf(self.policy.lm, self.cfg.model_path, path, write=self.rank.rank == 0,
                      dtype=self.compute_dtype)
            dist.barrier()
        else:
            save_checkpoint(path, self.policy, self.optimizer, step=self.step, extra_state=extra_state)

    def load_model(self, path: str | Path) -> dict[str, Any]:
        self._require_awake("load_model")
        reshard(self.policy)
        state = load_checkpoint(path, self.policy, self.optimizer)
        self._steps[MAIN_PHASE] = int(state["step"])
        return dict(state.get("extra_state", {}))

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        for model in (self.policy, self.ref):
            if model is not None:
                reshard(model)
        moved = self._offload.sleep(self._device_tensors())
        log.info("sleep: moved %.2f GiB to host", moved / 2**30)

    def wake_up(self) -> None:
        self._offload.wake_up()

    def _device_tensors(self):
        for model in (self.policy, self.ref):
            if model is None:
                continue
            for p in model.parameters():
                yield _local(p)
                if p.grad is not None:
                    yield _local(p.grad)
            yield from model.buffers()
        for optimizer in self._optimizers.values():
            for group in optimizer.param_groups:
                yield from (_local(p) for p in group["params"])
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield _local(value)

    def _require_awake(self, what: str) -> None:
        if self.policy is None:
            raise RuntimeError(f"{what}: call init() first")
        if self._offload.asleep:
            raise RuntimeError(f"{what}: the backend is asleep; call wake_up() first")

    def close(self) -> None:
        self.policy = self.ref = None
        self._optimizers.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_loss(loss: LossConfig) -> None:
    if loss.advantage_estimator == "ppo" and loss.loss_type == "policy":
        raise NotImplementedError("advantage_estimator='ppo' needs a critic, which the FSDP "
                                  "backend does not build yet; use grpo/gspo/reinforce_plus_plus")
    if loss.opd_kl_coef > 0:
        raise NotImplementedError("opd_kl_coef > 0 needs teacher log-probs, which the FSDP "
                                  "backend does not compute yet")
    if loss.reduction == "constant" and loss.max_response_tokens < 1:
        raise ValueError("algo.max_response_tokens = 0: the 'constant' loss reduction (Dr. GRPO) divides "
                         "by the generation budget; set it (the trainer actor fills in rollout.max_new_tokens)")


def _shaping_kl(loss: LossConfig) -> bool:
    return loss.loss_type == "policy" and loss.kl_coef > 0 and loss.advantage_estimator in SHAPING_ESTIMATORS


def _needs_ref(loss: LossConfig) -> bool:
    return (loss.loss_type == "policy" and loss.kl_loss_coef > 0) or _shaping_kl(loss)


def _compile_elementwise_parts(lm: torch.nn.Module) -> None:
    """torch.compile (in place, names unchanged) the parts of each decoder layer that eager mode
    runs as chains of small memory-bound kernels: the RMSNorms (q/k norms too), a dense MLP's
    act(gate) * up, and the rotary embedding (transformers' module-level `apply_rotary_pos_emb`,
    which the attention looks up at call time, is swapped for a compiled wrapper in the model's
    own modeling module). Attention (sample boundaries vary per micro-batch) and MoE blocks
    (data-dependent expert loops) stay eager; dynamic=True keeps one graph for every length."""
    import sys
    for layer in lm.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, name).compile(dynamic=True)
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(layer.self_attn, name, None), torch.nn.Module):
                getattr(layer.self_attn, name).compile(dynamic=True)
        if not hasattr(layer.mlp, "experts"):
            layer.mlp.compile(dynamic=True)
    modeling = sys.modules.get(type(lm.model.layers[0].self_attn).__module__)
    rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    if rotary is not None and not getattr(rotary, "_miles_compiled", False):
        compiled = torch.compile(rotary, dynamic=True)
        compiled._miles_compiled = True
        modeling.apply_rotary_pos_emb = compiled


def reshard(model: torch.nn.Module) -> None:
    """Free every unsharded copy so the module's parameters are its shards again.

    FSDP2 keeps the root's parameters unsharded after a forward that has no backward (no-grad
    passes, evals): until resharded, `parameters()` returns those bf16 copies, not the masters."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fingerprint(samples: Sequence[Sample]) -> list[int]:
    crc = 0
    total = 0
    for s in samples:
        crc = zlib.crc32(np.ascontiguousarray(s.tokens).tobytes(), crc)
        crc = zlib.crc32(f"{s.response_length}|{s.reward!r}|{s.group_id}|{s.rollout_id}".encode(), crc)
        if s.loss_mask is not None:
            crc = zlib.crc32(np.ascontiguousarray(s.loss_mask).tobytes(), crc)
        total += len(s.tokens)
    return [len(samples), total, crc]
