"""FSDPBackend: PyTorch FSDP2 over a transformers causal LM (Qwen2, Qwen3, Qwen3-MoE, ...).

Design decisions:
- `fully_shard` on every decoder layer and on the root (`PackedPolicy`, which owns the embedding,
  final norm and LM head), over a 1-D device mesh of all trainer ranks (pure data parallel).
- Precision: fp32 sharded parameters (the optimizer's master copy) with a MixedPrecisionPolicy that
  all-gathers them as `param_dtype` (bf16) for compute and reduce-scatters gradients in
  `reduce_dtype` (fp32). `master_weights_fp32=false` loads the weights in bf16 and steps them there.
- One `train(samples, index=None)` call (the whole batch, or this rank's shard with the batch's
  `BatchIndex`): agree on the batch (all ranks) -> plan steps / ranks / packed micro-batches
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
- The reference model (`train.use_ref_model`, or a KL term) scores every RL step's tokens; with
  no `train.ref_model_path` it becomes the warm start when the main phase first trains after
  one (its weights copied from the policy), so its KL term and the logged `ref_kl` measure how
  far RL moved from the warm start, not from `model_path`. A resumed run rebuilds it from
  `model_path` (the warm start does not run again); with LoRA it stays the base model.
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
- R3 (`train.router_replay`, from `rollout.r3`): the MoE routers are patched at init
  (router_replay.py); each micro-batch's forward, recompute and backward run inside its routing
  context, the no-grad passes in their own. A rank that trains a sample without its routing
  refuses the batch (all ranks raise together). Samples carrying routing without replay are
  only measured: routing_agreement / routing_native_agreement (1.0 / the flip rate with replay).
- PPO (`algo.advantage_estimator = "ppo"`): a value model (critic.py) with its own optimizer and
  schedule steps right after each policy step on the same micro-batches; GAE takes its pre-update
  values. On-policy distillation (`algo.opd_kl_coef > 0`): a frozen teacher (teacher.py,
  `train.teacher_model_path`) scores every response token in a no-grad pass like the reference's.
  Metrics: value_loss, value_clipfrac, explained_variance, critic_grad_norm, critic_lr,
  critic_step; teacher_reverse_kl.
- LoRA (`train.lora`, lora.py): peft adapters injected before fully_shard; only they require grad,
  so only they have Adam state. Weight sync and HF exports send merged weights under the base
  names; every checkpoint and export also writes `adapter/` in peft's format. Metrics:
  trainable_params, optimizer_bytes (every run, LoRA or not).
- Metrics (identical on every rank; means over the call's optimizer steps): loss, pg_loss,
  pg_clipfrac, ppo_kl, kl (= kl_loss when a KL loss is on, else ppo_kl), kl_loss, entropy,
  train_rollout_logprob_abs_diff, train_rollout_kl, tis/mis stats, grad_norm, lr; sums: tokens,
  skipped_steps; and samples, optimizer_steps, microbatches (this rank), step_s, tokens_per_s.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.algo import LossConfig
from miles.backends import attention, snapshot, train_common
from miles.backends.base import MAIN_PHASE, Metrics, RankInfo, TrainingBackend, TrainPhase
from miles.backends.batch import CheckedBatch
from miles.backends.batch_plan import plan_batch
from miles.backends.checkpoint import load_checkpoint, save_checkpoint
from miles.backends.config import TrainConfig
from miles.backends.critic import Critic, explained_variance, uses_critic
from miles.backends.distributed import init_process_group, pick_device
from miles.backends.hf_weights import NamedTensors, export_hf, iter_hf_weight_buckets
from miles.backends.lora import (ADAPTER_DIR, apply_lora, export_adapter, merged_hf_parameters,
                                 optimizer_bytes, trainable_parameters)
from miles.backends.offload import HostOffload
from miles.backends.optim import build_adamw, lr_at, set_lr
from miles.backends.packing import PackedMicroBatch
from miles.backends.policy import PackedPolicy
from miles.backends.router_replay import (RouterReplay, agree_on_routing, finish_routing_metrics,
                                          micro_batch_routing, routed)
from miles.backends.teacher import (builds_teacher, carried_teacher_logprobs, check_teacher_config,
                                    check_teacher_vocab, teacher_reverse_kl, uses_teacher)
from miles.weights.base import WeightTransport, send_weights
from miles.wire.messages import BatchIndex, Sample

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FSDPBackend(TrainingBackend):
    name = "fsdp"

    def __init__(self) -> None:
        self.cfg: TrainConfig | None = None
        self.policy: PackedPolicy | None = None
        self.ref: PackedPolicy | None = None
        self.critic: Critic | None = None
        self.teacher: PackedPolicy | None = None
        self._optimizers: dict[str, torch.optim.Optimizer] = {}  # per phase name; MAIN_PHASE first
        self._steps: dict[str, int] = {}
        self._offload = HostOffload()
        # (lm, device, compute_dtype) -> None, on the trainable model before fully_shard:
        # quant.train (miles/quant/train.py: INT4 QAT, torchao float8). Set by quantize_training.
        self.lm_transform = None

    def quantize_training(self, quant) -> None:
        from miles.quant.train import training_transform
        self.lm_transform = training_transform(quant)

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
        use_ref = train_common.use_ref_model(config, loss)
        self.policy = self._build(config.model_path, trainable=True)
        self.ref = self._build(config.ref_model_path or config.model_path, trainable=False) if use_ref else None
        self.vocab_size = int(self.policy.lm.config.vocab_size)
        self.critic = self._build_critic(config) if uses_critic(loss) else None  # PPO (critic.py)
        check_teacher_config(config, loss)
        self.teacher = self._build(config.teacher_model_path, trainable=False) if builds_teacher(config, loss) else None
        if self.teacher is not None:
            check_teacher_vocab(int(self.teacher.lm.config.vocab_size), self.vocab_size, config.teacher_model_path)
        # R3: MoE routers are patched whenever the model has them (agreement is measured whenever
        # samples carry routing); replay itself only with train.router_replay.
        self.replay = RouterReplay.install(self.policy.lm)
        self.ref_replay = RouterReplay.install(self.ref.lm) if self.ref is not None else None
        if config.router_replay and self.replay is None:
            raise ValueError(f"train.router_replay = true (rollout.r3), but {config.model_path} has no "
                             "MoE router to replay (a dense model)")
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
        if trainable and self.lm_transform is not None:
            self.lm_transform(lm, self.device, self.compute_dtype)
        if trainable and cfg.lora is not None:  # only the adapters require grad (lora.py)
            apply_lora(lm, cfg.lora)
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
        if (uses_critic(phase.loss) and self.critic is None) or (builds_teacher(phase.config, phase.loss) and self.teacher is None):
            raise ValueError(f"phase {phase.name!r}: its loss needs a {'critic' if uses_critic(phase.loss) else 'teacher'}"
                             " (advantage_estimator='ppo' / opd_kl_coef > 0), which init did not build")
        if self.ref is None and _needs_ref(phase.loss):
            raise ValueError(f"phase {phase.name!r}: the loss has a KL term (kl_loss_coef="
                             f"{phase.loss.kl_loss_coef}, kl_coef={phase.loss.kl_coef}) but init built no "
                             "reference model")
        return phase

    def _phase_optimizer(self, phase: TrainPhase) -> torch.optim.Optimizer:
        if phase.name == MAIN_PHASE:
            # The warm-start is over: free its Adam moments (a second full optimizer state on the device).
            warm_started = [n for n in self._optimizers if n != MAIN_PHASE]
            for name in warm_started:
                del self._optimizers[name], self._steps[name]
            if warm_started and self.ref is not None and not self.cfg.ref_model_path and self.cfg.lora is None:
                copy_parameters(self.policy, self.ref)   # the reference is the warm start
        elif phase.name not in self._optimizers:
            self._optimizers[phase.name] = build_adamw(self.policy, phase.config, self.device)
            self._steps[phase.name] = 0
        return self._optimizers[phase.name]

    # ------------------------------------------------------------------ train
    def train(self, samples: Sequence[Sample], phase: TrainPhase | None = None,
              index: BatchIndex | None = None) -> Metrics:
        self._require_awake("train")
        t0 = time.perf_counter()
        phase = self._resolve_phase(phase)
        cfg, loss_cfg, world = phase.config, phase.loss, self.rank.world_size
        batch = self._agree_on_batch(samples, phase, index)
        optimizer = self._phase_optimizer(phase)
        plan = plan_batch(batch.group_index, batch.lengths, world_size=world,
                          steps=cfg.steps_per_train, max_tokens=cfg.max_tokens_per_microbatch)
        with_rollout_lp = batch.with_rollout_logprobs
        mine = [[self._pack(batch, idx, with_rollout_lp) for idx in step[self.rank.rank]] for step in plan]
        flat = [mb for step in mine for mb in step]
        # R3 replays the rollout's routing in RL phases (an SFT warm-start's data has none).
        replaying = cfg.router_replay and loss_cfg.loss_type == "policy"
        routing, error = micro_batch_routing(self.replay, batch.samples, flat, required=replaying,
                                             rank=self.rank.rank)
        if self.replay is not None:
            agree_on_routing(error, self.device)

        # distillation's student side is pi_old: the rollout's log-probs, or this pass
        need_old = train_common.needs_old_logprobs(cfg, loss_cfg) or (
            uses_teacher(loss_cfg) and not (with_rollout_lp and cfg.old_logprobs == "rollout"))
        old = self._no_grad_logprobs(self.policy, flat, routing, self.replay, replaying) if need_old else None
        ref = (self._no_grad_logprobs(self.ref, flat, routing, self.ref_replay, replaying)
               if self.ref is not None and train_common.runs_ref(loss_cfg) else None)
        aux = self._critic_and_teacher_passes(flat, old, loss_cfg, batch)
        advantages, returns = self._advantages(batch, flat, old, ref, loss_cfg, aux)

        totals: dict[str, float] = {}
        k = 0
        for step_plan, step_mbs in zip(plan, mine):
            k0 = k
            step_indices = sorted(i for rank_plan in step_plan for mb in rank_plan if mb for i in mb)
            denominators = self._denominators(batch, step_indices, loss_cfg)
            optimizer.zero_grad(set_to_none=True)  # nothing left over from a failed call
            sums: dict[str, torch.Tensor] = {}
            for mb in step_mbs:
                # backward inside: activation recompute routes by the same indices
                with routed(self.replay, routing[k], replay_on=replaying):
                    logp, ent = self.policy.run(mb.inputs)
                    loss, metrics = train_common.microbatch_loss(
                        mb, logp, ent, cfg=cfg, loss_cfg=loss_cfg, denominators=denominators,
                        advantages=advantages[k], old=old[k] if old is not None else None,
                        ref=ref[k] if ref is not None else None, device=self.device)
                    (loss * world).backward()
                train_common.add_sums(sums, metrics, mb)
                k += 1
            if self.replay is not None:
                sums.update(self.replay.take_sums())
            step_metrics = self._optimizer_step(phase)
            if "values" in aux:  # the critic steps on the same micro-batches, after the policy
                critic_sums = self.critic.train_step(step_mbs, aux["values"][k0:k], returns[k0:k],
                                                     denominators, loss_cfg)
                step_metrics.update({n: critic_sums.pop(n) for n in ("critic_grad_norm", "critic_lr")})
                sums.update(critic_sums)
            step_metrics.update(self._all_reduce_sums(sums))
            for name, value in step_metrics.items():
                totals[name] = totals.get(name, 0.0) + value
        metrics = self._finish_metrics(totals, len(plan), k, batch, time.perf_counter() - t0)
        masks = [mb.loss_mask for mb in flat]
        if "values" in aux:
            metrics["explained_variance"] = explained_variance(aux["values"], returns, masks, self.device)
            metrics["critic_step"] = float(self.critic.step)
        if "teacher" in aux:
            metrics["teacher_reverse_kl"] = teacher_reverse_kl(aux["student"], aux["teacher"], masks, self.device)
        metrics["trainable_params"] = float(trainable_parameters(self.policy))
        metrics["optimizer_bytes"] = float(optimizer_bytes(optimizer))
        return finish_routing_metrics(metrics)

    def _agree_on_batch(self, samples: Sequence[Sample], phase: TrainPhase,
                        index: BatchIndex | None = None) -> CheckedBatch:
        return train_common.agree_on_batch(samples, phase, vocab_size=self.vocab_size, device=self.device,
                                           index=index, dp_size=self.rank.world_size, dp_rank=self.rank.rank)

    def _pack(self, batch: CheckedBatch, indices: list[int] | None, with_rollout_lp: bool) -> PackedMicroBatch:
        return train_common.pack(batch, indices, with_rollout_lp, self.device)

    @torch.no_grad()
    def _no_grad_logprobs(self, model: PackedPolicy, mbs: list[PackedMicroBatch], routing: list,
                          replay: RouterReplay | None, replaying: bool) -> list[torch.Tensor]:
        out = []
        for mb, indices in zip(mbs, routing):
            with routed(replay, indices, replay_on=replaying, measure=False):
                out.append(model.run(mb.inputs)[0])
        reshard(model)
        return out

    def _build_critic(self, config: TrainConfig) -> Critic:
        attn = attention.ATTN_IMPLEMENTATION if config.attention == "packed" else config.attention
        reshard = config.reshard_after_forward
        return Critic.build(config, mesh=self.mesh, device=self.device, compute_dtype=self.compute_dtype,
                            reduce_dtype=DTYPES[config.reduce_dtype], attn_implementation=attn,
                            reshard=self.rank.world_size > 1 if reshard is None else reshard,
                            world_size=self.rank.world_size)

    def _critic_and_teacher_passes(self, mbs: list[PackedMicroBatch], old: list[torch.Tensor] | None,
                                   loss_cfg: LossConfig, batch: CheckedBatch) -> dict[str, list[torch.Tensor]]:
        """The critic's pre-update values (PPO) and the teacher's and student's log-probs (OPD)."""
        aux: dict[str, list[torch.Tensor]] = {}
        if uses_critic(loss_cfg):
            reshard(self.policy)
            self.critic.start_from(self.policy.lm.model)
            aux["values"] = self.critic.values(mbs)
        if uses_teacher(loss_cfg):
            # the rollout's teacher engine scored the samples already, or the trainer's teacher does
            aux["teacher"] = (carried_teacher_logprobs(batch, mbs, self.device, required=self.teacher is None)
                              or self._no_grad_logprobs(self.teacher, mbs, [None] * len(mbs), None, False))
            aux["student"] = old if old is not None else [mb.rollout_logprobs for mb in mbs]
        return aux

    def _advantages(self, batch: CheckedBatch, mbs: list[PackedMicroBatch], old: list[torch.Tensor] | None,
                    ref: list[torch.Tensor] | None, loss_cfg: LossConfig,
                    aux: dict[str, list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return train_common.advantages_and_returns(batch, mbs, old, ref, loss_cfg, self.device,
                                                   self._sum_across_ranks, **aux)

    def _sum_across_ranks(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    def _denominators(self, batch: CheckedBatch, step_indices: list[int], loss_cfg: LossConfig) -> dict[int, float]:
        return train_common.step_denominators(batch, step_indices, loss_cfg)

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
        return train_common.all_reduce_sums(sums, self.device)

    def _finish_metrics(self, totals: dict[str, float], steps: int, microbatches: int,
                        batch: CheckedBatch, seconds: float) -> Metrics:
        return train_common.finish_metrics(totals, steps, microbatches, batch, seconds)

    # ------------------------------------------------------------------ weights out
    def iter_hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[NamedTensors]:
        """Full tensors under HF names in buckets (collective: every rank iterates to the end)."""
        self._require_awake("iter_hf_weight_buckets")
        reshard(self.policy)
        return iter_hf_weight_buckets(self.policy.lm, bucket_bytes or self.cfg.update_bucket_bytes,
                                      dtype=self.compute_dtype, params=self._merged_lora())

    def _merged_lora(self):
        """With train.lora, the weights engines and exports get: each adapter merged (lora.py)."""
        return merged_hf_parameters(self.policy.lm) if self.cfg.lora is not None else None

    def update_weights(self, transport: WeightTransport, version: int) -> None:
        if self._publishes_local_shards(transport):
            # p2p: each rank sends its own Shard(0) rows; no all-gather of any parameter
            self._require_awake("update_weights")
            transport.publish_local(self.policy.lm, version, bucket_bytes=self.cfg.update_bucket_bytes,
                                    dtype=self.compute_dtype)
            return
        send_weights(transport, version, self.iter_hf_weight_buckets())

    def _publishes_local_shards(self, transport: WeightTransport) -> bool:
        """The P2P transport itself (not wrapped: a checksum tap or quantize-on-export needs the
        full tensors) and a model whose parameters export under their own names (no LoRA merge,
        no fused MoE experts)."""
        from miles.weights.p2p import P2PTransport
        return (type(transport) is P2PTransport and self.cfg.lora is None
                and not any(".experts." in n for n, _ in self.policy.lm.named_parameters()))

    def save_model(self, path: str | Path, hf: bool = False,
                   extra_state: dict[str, Any] | None = None) -> None:
        self._require_awake("save_model")
        reshard(self.policy)
        if self.cfg.lora is not None:  # the adapters alone, in peft's format, beside either kind
            export_adapter(self.policy.lm, self.cfg.lora, Path(path) / ADAPTER_DIR, write=self.rank.rank == 0,
                           base_model_path=self.cfg.model_path)
        if hf:
            export_hf(self.policy.lm, self.cfg.model_path, path, write=self.rank.rank == 0,
                      dtype=self.compute_dtype, params=self._merged_lora())
            dist.barrier()
        else:
            if self.critic is not None:  # first: the policy's COMPLETE marker then covers it
                self.critic.save(path)
            save_checkpoint(path, self.policy, self.optimizer, step=self.step, extra_state=extra_state)

    def load_model(self, path: str | Path) -> dict[str, Any]:
        self._require_awake("load_model")
        reshard(self.policy)
        state = load_checkpoint(path, self.policy, self.optimizer)
        self._steps[MAIN_PHASE] = int(state["step"])
        if self.critic is not None:
            self.critic.load(path)
        return dict(state.get("extra_state", {}))

    # ------------------------------------------------------------------ memory
    def memory_state(self, train_call: int, metrics: dict[str, float]) -> tuple[dict, list]:
        return snapshot.capture(self, train_call, metrics)

    def load_memory_state(self, image) -> None:
        snapshot.restore(self, image)

    def sleep(self) -> None:
        for model in (self.policy, self.ref, self.teacher):
            if model is not None:
                reshard(model)
        # Device tensors that only garbage cycles still reach (a step's autograd graph held by a
        # traceback or a closure) are freed now, not at the next automatic collection: what stays
        # allocated asleep is what something still uses.
        gc.collect()
        moved = self._offload.sleep(self._device_tensors())
        log.info("sleep: moved %.2f GiB to host", moved / 2**30)

    def wake_up(self) -> None:
        self._offload.wake_up()

    def _device_tensors(self):
        if self.critic is not None:
            yield from self.critic.device_tensors()
        for model in (self.policy, self.ref, self.teacher):
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
        self.policy = self.ref = self.teacher = self.critic = None
        self._optimizers.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_loss(loss: LossConfig) -> None:
    train_common.check_loss(loss, "FSDP", critic=True, teacher=True)


def _needs_ref(loss: LossConfig) -> bool:
    return train_common.needs_ref(loss)


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


@torch.no_grad()
def copy_parameters(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst's parameters take src's values, by name (both sharded alike, on the same mesh; the
    dtype follows dst's)."""
    reshard(src)
    reshard(dst)
    theirs = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        if name not in theirs:
            raise ValueError(f"the reference model has a parameter {name!r} the policy lacks")
        _local(p).copy_(_local(theirs[name]))


def reshard(model: torch.nn.Module) -> None:
    """Free every unsharded copy so the module's parameters are its shards again.

    FSDP2 keeps the root's parameters unsharded after a forward that has no backward (no-grad
    passes, evals): until resharded, `parameters()` returns those bf16 copies, not the masters."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
