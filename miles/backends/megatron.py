"""MegatronBackend: megatron-core GPTModel (TP x PP x EP x DP) behind the training-backend contract (base.py).

Design decisions:
- Same batch path as FSDP (`train_common`): every rank checks what it holds (the whole batch, or
  its DP shard against the `BatchIndex`) and all agree, then `plan_batch(world_size=dp)` splits
  the batch into whole groups per DATA-parallel rank; the TP/PP/CP peers of a DP rank (same
  `trainer_dp_layout` index) hold the same shard and run the same micro-batches. Advantages,
  denominators and the one `compute_policy_loss` call are train_common's, so every loss in
  `miles.algo` works unchanged.
- One micro-batch is one packed row in megatron's thd layout (`PackedSeqParams` with cu_seqlens;
  our core attention keeps samples apart, rope restarts per sample). Rows are padded (a separate
  padding segment that no log-prob reads) only where megatron needs equal shapes: a multiple of TP
  with sequence parallelism, and one length per call where activations must have a fixed shape
  (megatron's allgather MoE dispatcher, which gathers equal-sized token blocks over TP x EP).
- Forward and backward always go through megatron's `get_forward_backward_func()` (PP=1 and
  PP>1 alike). `forward_step` returns the model output and a loss function; on the last stage
  that function computes token log-probs from the vocab-sharded logits (TP=1: the FSDP backend's
  own `token_logprobs`; TP>1: `megatron_step.vocab_parallel_logprobs`, exact over the TP group)
  and calls `microbatch_loss`. `calculate_per_token_loss=True` with our own finalize function:
  megatron then neither divides the loss by the micro-batch count nor averages gradients over DP,
  so the summed gradient is exactly the step loss's gradient, as in FSDP. Old/ref log-prob
  passes are the same schedule with `forward_only=True`. As in FSDP's PackedPolicy the LM head
  runs only on log-prob rows, and (HF's padding_idx) a pad token gets no input-embedding gradient.
- Metrics are computed on the last pipeline stage, summed over DP there and shared with every
  rank (one broadcast of the names inside each PP group, one all-reduce), so all ranks return the
  same dict with FSDP's keys. grad_norm counts each distinct gradient shard once.
- Optimizer: megatron's `get_megatron_optimizer` (bf16 + fp32 main params, the distributed
  optimizer per `train.megatron.distributed_optimizer`) on CUDA; on a CPU host, where that
  optimizer cannot run (it allocates CUDA tensors), torch AdamW over fp32 main copies
  (megatron_step.py). Both use `optim.lr_at`, skip a non-finite step, and exist per phase name;
  switching phases re-reads the main params from the model. `train.optimizer_offload` ("cpu",
  "nvme") streams the Adam moments per bucket as FSDP does: torch AdamW over the main copies on
  CUDA too (its inner optimizer optim_offload.OffloadedAdamW), without megatron's distributed
  optimizer, so each DP rank holds its whole moment set off the device (megatron_step.py says why).
- Checkpoints go through megatron-core's dist_checkpointing (torch_dist, megatron_checkpoint.py):
  the model's and the optimizer's sharded state under `dist/`, plus FSDP's trainer_state.json /
  RNG / COMPLETE files. A checkpoint saved at one layout resumes at another (TP=2 -> TP=1 x DP=2
  or PP=2); the per-rank RNG streams continue only under the same ranks and layout.
- Weights out: `megatron_weights.iter_hf_weight_buckets` (TP gather, PP broadcast, EP gather,
  QKV / gate-up split) feeds the transports exactly as FSDP's generator does; `hf=True` exports
  with `save_hf`. Sleep/wake: `HostOffload` over parameters, DDP grad buffers, optimizer state.
- PPO (`algo.advantage_estimator = "ppo"`): megatron_critic.py, a GPTModel with the policy's
  layout whose LM head is a scalar value head, its own optimizer and schedule; its pre-update
  values feed GAE and it steps on the same micro-batches after each policy step (through `_run`
  with `output_fn`), and it saves and resumes with the policy under `critic/`.
- On-policy distillation (`algo.opd_kl_coef > 0`): the teacher's log-probs are the samples' own
  (`Sample.teacher_logprobs`, scored on the rollout side) when every sample carries them, else a
  frozen teacher GPTModel (`train.teacher_model_path`, the policy's layout) scores them in a
  forward-only pass like the reference's; both go through train_common's
  `advantages_and_returns(student=, teacher=)` as in FSDP. Metrics as FSDP's: value_loss,
  value_clipfrac, explained_variance, critic_grad_norm, critic_lr, critic_step, teacher_reverse_kl.
  As in FSDP, init builds the teacher (`train.teacher_model_path` is required) unless the rollout
  side scores every sample (`[teacher]`, `train.teacher_from_samples`); R3 replays the policy's
  routing only (not the critic's or the teacher's).
- Refused: LoRA (`train.lora`; FSDP only for now).
- Transformer Engine is not required (local spec): sequence parallelism runs on our norms (on with TP > 1,
  as in megatron; MoE with TP needs it), and context parallelism is ours (megatron_cp.py: each
  row cut into 2 x cp chunks, K/V all-gathered per layer; every CP rank computes the whole
  micro-batch's loss from the gathered log-probs). The PPO critic refuses both.
- R3 (`train.router_replay`): megatron-core's RouterReplay per MoE layer, per model
  (megatron_replay.py); the old/ref passes replay forward, the training pass replays forward and
  recompute. A rank that trains a sample without its routing refuses the batch (all ranks raise
  together); routing without replay is only measured (same metrics as FSDP).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from miles.algo import LossConfig
from miles.backends import megatron_algos, megatron_checkpoint, megatron_cp, megatron_step, train_common
from miles.backends.base import MAIN_PHASE, Metrics, RankInfo, TrainingBackend, TrainPhase
from miles.backends.batch import CheckedBatch
from miles.backends.batch_plan import plan_batch
from miles.backends.config import TrainConfig, trainer_dp_layout
from miles.backends.critic import uses_critic
from miles.backends.logprobs import token_logprobs
from miles.backends.offload import HostOffload
from miles.backends.optim import lr_at
from miles.backends.packing import PackedMicroBatch
from miles.backends.router_replay import agree_on_routing, micro_batch_routing
from miles.backends.teacher import builds_teacher, uses_teacher
from miles.weights.base import WeightTransport, send_weights
from miles.wire.messages import BatchIndex, Sample

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class MegatronBackend(TrainingBackend):
    name = "megatron"

    def __init__(self) -> None:
        self.cfg: TrainConfig | None = None
        self.chunks: list[torch.nn.Module] | None = None   # DDP-wrapped GPTModel chunks
        self.ref_chunks: list[torch.nn.Module] | None = None
        self.critic = None   # megatron_critic.MegatronCritic under PPO
        self.teacher_chunks: list[torch.nn.Module] | None = None
        self._optimizers: dict[str, Any] = {}
        self._steps: dict[str, int] = {}
        self._last_phase = MAIN_PHASE
        self._rows: torch.Tensor | None = None   # logprob rows of the micro-batch being run
        self._heads_pick_rows = False
        self._offload = HostOffload()

    # ------------------------------------------------------------------ init
    def init(self, config: TrainConfig, rank: RankInfo, loss: LossConfig | None = None) -> None:
        from megatron.core import parallel_state as ps

        from miles.backends.megatron_model import init_parallel, load_hf_config
        from miles.backends.megatron_replay import MegatronReplay

        loss = loss or LossConfig()
        if config.backend != "megatron":
            raise ValueError(f"train.backend={config.backend!r} given to the Megatron backend")
        if not config.model_path:
            raise ValueError("train.model_path is empty; it must name an HF safetensors directory")
        if config.lora is not None:  # also refused when the recipe is checked (miles.config)
            raise NotImplementedError("train.lora: LoRA adapters are built for train.backend = 'fsdp' only; "
                                      "the Megatron backend trains every weight")
        train_common.check_loss(loss, "Megatron", critic=True, teacher=True)
        if loss.loss_type == "policy" and config.old_logprobs == "rollout" and (loss.use_tis or loss.use_mis):
            log.warning("train.old_logprobs = 'rollout' with algo.%s = true: the IS weight pi_old / pi_rollout "
                        "is 1 by construction (the PPO ratio already compares with the sampling policy)",
                        "use_tis" if loss.use_tis else "use_mis")
        rank.check()
        config = megatron_step.resolve_sequence_parallel(config, critic=uses_critic(loss))
        self.cfg, self.loss_cfg, self.rank = config, loss, rank
        self.dp = config.megatron.data_parallel(rank.world_size)
        self.device = init_parallel(config, rank)
        megatron_step.apply_schedule_cpu_shims()
        torch.manual_seed(config.seed + rank.rank)
        np.random.seed((config.seed + rank.rank) % 2**32)
        self.dtype = DTYPES[config.param_dtype]
        if self.device.type == "cuda" and self.dtype != torch.float32 and not config.master_weights_fp32:
            raise ValueError(f"train.master_weights_fp32=false with param_dtype={config.param_dtype!r}: "
                             "megatron's optimizer steps low-precision weights only through fp32 main params")
        self.dp_rank = ps.get_data_parallel_rank()
        expected = trainer_dp_layout(config, rank.world_size)[1][rank.rank]
        if self.dp_rank != expected:  # the driver shards per-sample data (R3 routing) by this layout
            raise RuntimeError(f"megatron put rank {rank.rank} at DP index {self.dp_rank}, but "
                               f"trainer_dp_layout says {expected}; the rank orders disagree")
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.cp, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.vocab_size = int(load_hf_config(config.model_path).vocab_size)
        use_ref = train_common.use_ref_model(config, loss)
        self.chunks = self._build(config.model_path, trainable=True)
        self.ref_chunks = self._build(config.ref_model_path or config.model_path, trainable=False) if use_ref else None
        self.replay = MegatronReplay.install(self.chunks)
        self.ref_replay = MegatronReplay.install(self.ref_chunks) if self.ref_chunks is not None else None
        if config.router_replay and self.replay is None:
            raise ValueError(f"train.router_replay = true (rollout.r3), but {config.model_path} has no "
                             "MoE router to replay (a dense model)")
        self._optimizers = {MAIN_PHASE: self._make_optimizer(config)}
        self._steps = {MAIN_PHASE: 0}
        self._last_phase = MAIN_PHASE
        self.critic, self.teacher_chunks = megatron_algos.build_aux_models(self, config, loss)

    def _build(self, path: str, *, trainable: bool, prepare=None) -> list[torch.nn.Module]:
        """GPTModel chunks from an HF directory; `prepare(model)` runs after the HF weights are in
        and before DDP wraps the model (the critic swaps its LM head for a value head there)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from miles.backends.megatron_model import build_gpt_model
        from miles.backends.megatron_weights import load_hf_into

        model = build_gpt_model(path, self.cfg)
        if self.device.type == "cuda":
            model.cuda(self.device)
        load_hf_into([model], path)
        megatron_step.mark_tensor_parallel(model)
        megatron_step.freeze_pad_embedding(model, getattr(model.miles_hf_config, "pad_token_id", None))
        self._select_logprob_rows(model)
        if prepare is not None:
            prepare(model)
        config = model.config
        config.calculate_per_token_loss = True  # see the module docstring: no /num_microbatches, no DP mean
        if not torch.cuda.is_available():
            config.batch_p2p_comm = False   # gloo: plain isend/irecv pairs
        if not trainable:
            model.eval().requires_grad_(False)
            return [model]

        def finalize(chunks, num_tokens=None, **kwargs):
            # Gradients are sums already (the per-micro-batch loss is a partial sum of the step loss).
            finalize_model_grads(chunks, None, **kwargs)

        config.finalize_model_grads_func = finalize
        # Optimizer offload steps LocalAdamW on whole gradients (megatron_step.make_optimizer)
        use_dist_opt = (self.cfg.megatron.distributed_optimizer and self.device.type == "cuda"
                        and self.cfg.optimizer_offload == "none")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.cfg.reduce_dtype == "float32", overlap_grad_reduce=False,
            overlap_param_gather=False, use_distributed_optimizer=use_dist_opt,
            average_in_collective=False)
        model.train()
        return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]

    def _select_logprob_rows(self, model) -> None:
        """Run the LM head only on the rows that predict a response token (as FSDP's PackedPolicy
        does): a pre-hook on the output layer picks them from its [T, 1, H] input, so the logits
        are [1, R, V/tp] and prompt positions cost no head flops. With sequence parallelism the
        head's input is still sequence-sharded there, so the hook stays off and rows are picked
        from the full logits instead."""
        head = getattr(model, "output_layer", None)
        if head is None or not model.post_process or model.config.sequence_parallel:
            return

        def pick(module, args, kwargs):
            rows = self._rows
            if rows is None:
                return None
            return (args[0].index_select(0, rows), *args[1:]), kwargs

        head.register_forward_pre_hook(pick, with_kwargs=True)
        self._heads_pick_rows = True

    def _make_optimizer(self, cfg: TrainConfig):
        if cfg.megatron.distributed_optimizer and self.dp > 1 and self.device.type != "cuda":
            log.info("train.megatron.distributed_optimizer: megatron's optimizer needs CUDA; on this CPU "
                     "host every DP rank keeps the whole optimizer state (torch AdamW on main_grad)")
        return megatron_step.make_optimizer(self.chunks, cfg, self.device, self.dtype)

    @property
    def step(self) -> int:
        return self._steps.get(MAIN_PHASE, 0)

    def _resolve_phase(self, phase: TrainPhase | None) -> TrainPhase:
        if phase is None:
            return TrainPhase(MAIN_PHASE, self.loss_cfg, self.cfg)
        if phase.config.model_path != self.cfg.model_path:
            raise ValueError(f"phase {phase.name!r}: train.model_path = {phase.config.model_path!r}, but the "
                             f"backend was built from {self.cfg.model_path!r}; a phase cannot change the model")
        train_common.check_loss(phase.loss, "Megatron", critic=True, teacher=True)
        if (uses_critic(phase.loss) and self.critic is None) or (builds_teacher(phase.config, phase.loss) and self.teacher_chunks is None):
            raise ValueError(f"phase {phase.name!r}: its loss needs a {'critic' if uses_critic(phase.loss) else 'teacher'}"
                             ", which init did not build (init's loss did not use one)")
        if self.ref_chunks is None and train_common.needs_ref(phase.loss):
            raise ValueError(f"phase {phase.name!r}: the loss has a KL term (kl_loss_coef="
                             f"{phase.loss.kl_loss_coef}, kl_coef={phase.loss.kl_coef}) but init built no "
                             "reference model")
        return phase

    def _phase_optimizer(self, phase: TrainPhase):
        if phase.name == MAIN_PHASE:
            for name in [n for n in self._optimizers if n != MAIN_PHASE]:
                del self._optimizers[name], self._steps[name]
        elif phase.name not in self._optimizers:
            self._optimizers[phase.name] = self._make_optimizer(phase.config)
            self._steps[phase.name] = 0
        if phase.name != self._last_phase:
            # Another phase's optimizer moved the weights: this one's main params must follow.
            self._optimizers[phase.name].reload_from_model()
            self._last_phase = phase.name
        return self._optimizers[phase.name]

    # ------------------------------------------------------------------ train
    def train(self, samples: Sequence[Sample], phase: TrainPhase | None = None,
              index: BatchIndex | None = None) -> Metrics:
        from megatron.core import parallel_state as ps

        from miles.backends.megatron_replay import NO_GRAD, OFF, TRAIN

        self._require_awake("train")
        t0 = time.perf_counter()
        phase = self._resolve_phase(phase)
        cfg, loss_cfg = phase.config, phase.loss
        batch = train_common.agree_on_batch(samples, phase, vocab_size=self.vocab_size, device=self.device,
                                             index=index, dp_size=self.dp, dp_rank=self.dp_rank)
        self._phase_optimizer(phase)
        plan = plan_batch(batch.group_index, batch.lengths, world_size=self.dp,
                          steps=cfg.steps_per_train, max_tokens=cfg.max_tokens_per_microbatch)
        with_rollout_lp = batch.with_rollout_logprobs
        mine = [[train_common.pack(batch, idx, with_rollout_lp, self.device) for idx in step[self.dp_rank]]
                for step in plan]
        flat = [mb for step in mine for mb in step]
        lengths = self._row_lengths(plan, batch)
        last = ps.is_pipeline_last_stage()
        # R3 replays the rollout's routing in RL phases (an SFT warm-start's data has none).
        replaying = cfg.router_replay and loss_cfg.loss_type == "policy"
        routing, error = micro_batch_routing(self.replay, batch.samples, flat, required=replaying,
                                             rank=self.rank.rank)
        if self.replay is not None:
            agree_on_routing(error, self.device)
        no_grad_routing = routing if replaying else None
        train_routing = (routing, self.replay, TRAIN if replaying else OFF)

        # distillation's student side is pi_old: the rollout's log-probs, or this pass
        need_old = train_common.needs_old_logprobs(cfg, loss_cfg) or (
            uses_teacher(loss_cfg) and not (with_rollout_lp and cfg.old_logprobs == "rollout"))
        old = (self._no_grad_logprobs(self.chunks, flat, lengths, (no_grad_routing, self.replay, NO_GRAD))
               if need_old else None)
        ref = (self._no_grad_logprobs(self.ref_chunks, flat, lengths, (no_grad_routing, self.ref_replay, NO_GRAD))
               if self.ref_chunks is not None and train_common.needs_ref(loss_cfg) else None)
        aux = megatron_algos.aux_passes(self, batch, flat, lengths, old, loss_cfg)
        advantages, returns = (train_common.advantages_and_returns(
            batch, flat, old, ref, loss_cfg, self.device, self._sum_over_dp, values=aux.get("values"),
            student=aux.get("student"), teacher=aux.get("teacher")) if last else (None, None))

        totals: dict[str, float] = {}
        k0 = 0
        for step_plan, step_mbs in zip(plan, mine):
            step_indices = sorted(i for rank_plan in step_plan for mb in rank_plan if mb for i in mb)
            denominators = train_common.step_denominators(batch, step_indices, loss_cfg)
            sums: dict[str, Any] = {}

            def loss_for(k, mb, logp, ent, denominators=denominators, sums=sums):
                loss, metrics = train_common.microbatch_loss(
                    mb, logp, ent, cfg=cfg, loss_cfg=loss_cfg, denominators=denominators,
                    advantages=advantages[k], old=old[k] if old is not None else None,
                    ref=ref[k] if ref is not None else None, device=self.device)
                train_common.add_sums(sums, metrics, mb)
                return loss

            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            ks = list(range(k0, k0 + len(step_mbs)))
            self._run(self.chunks, [(k, flat[k], lengths[k]) for k in ks], loss_for=loss_for, routing=train_routing)
            k0 += len(step_mbs)
            step_metrics = self._optimizer_step(phase)
            if self.critic is not None and uses_critic(loss_cfg):  # same micro-batches, after the policy
                out = self.critic.train_step([(k, flat[k], lengths[k]) for k in ks], aux.get("values"), returns,
                                             denominators, loss_cfg, cfg.grad_clip)
                sums.update(out.pop("sums"))
                step_metrics.update(out)
            step_metrics.update(self._share_sums(sums, last))
            for name, value in step_metrics.items():
                totals[name] = totals.get(name, 0.0) + value
        metrics = train_common.finish_metrics(totals, len(plan), k0, batch, time.perf_counter() - t0)
        if self.replay is not None:
            metrics.update(self.replay.reduce_metrics(self.device))
        metrics.update(megatron_algos.aux_metrics(self, aux, returns, flat, loss_cfg))
        return metrics

    def _row_lengths(self, plan, batch: CheckedBatch) -> list[int]:
        """The packed row length each of this rank's micro-batches runs at (see the docstring)."""
        from megatron.core import parallel_state as ps

        def real(mb):
            return sum(batch.lengths[i] for i in mb) if mb else 2  # a dummy is two tokens

        cfg0 = self._model_config(self.chunks)
        sp_tp = self.tp if cfg0.sequence_parallel else 1
        multiple = megatron_cp.cp_chunk_multiple(self.cp, sp_tp) if self.cp > 1 else sp_tp
        round_up = lambda n: -(-n // multiple) * multiple
        fixed = not cfg0.variable_seq_lengths and (ps.get_pipeline_model_parallel_world_size() > 1
                                                   or ps.get_expert_model_parallel_world_size() > 1)
        if fixed:
            longest = max(real(mb) for step in plan for rank_plan in step for mb in rank_plan)
            return [round_up(longest)] * sum(len(step[self.dp_rank]) for step in plan)
        return [round_up(real(mb)) for step in plan for mb in step[self.dp_rank]]

    @staticmethod
    def _model_config(chunks):
        return chunks[0].config

    def _run(self, chunks, items: list[tuple[int, PackedMicroBatch, int]], *, loss_for=None,
             routing=(None, None, None), output_fn=None) -> list:
        """Megatron's schedule over `items` (k, micro-batch, row length). With `loss_for`: forward and
        backward, the loss from loss_for(k, mb, logp, ent); without: forward only, returns the
        (log-probs, entropies) of each micro-batch on the last stage (nothing elsewhere).
        `routing` = (replay indices per k or None, the chunks' MegatronReplay, its stage).
        `output_fn(output, mb)` replaces the log-prob read of the last stage's output (the critic's values)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from miles.backends.megatron_model import make_packed_seq_params

        collected: list = []
        one = torch.ones((), dtype=torch.int, device=self.device)

        def forward_step(data_iterator, model):
            k, mb, length = next(data_iterator)
            ids, pos, seq_lens = megatron_step.padded_row(mb, length)
            params = make_packed_seq_params(seq_lens, self.device)
            rows, layout = mb.inputs.logprob_rows, None
            if self.cp > 1:   # this CP rank's share of the row (megatron_cp.py)
                layout = megatron_cp.cp_layout(seq_lens, self.cp, self.cp_rank, self.device)
                ids, pos = ids[:, layout.local_index], pos[:, layout.local_index]
                megatron_cp.attach(params, layout)
                mine, rows = megatron_cp.response_rows(layout, rows)
            self._rows = rows
            if replay is not None:
                replay.set_micro_batch(indices[k] if indices is not None else None, length, stage=stage,
                                       local_index=layout.local_index_host if layout is not None else None)
            output = model(ids, pos, None, packed_seq_params=params)

            def loss_func(output_tensor):
                if layout is None or output_fn is not None:   # the critic refuses cp > 1
                    logp, ent = (output_fn or self._token_logprobs)(output_tensor, mb)
                else:
                    logp, ent = self._token_logprobs(output_tensor, mb, rows, mine)
                if loss_for is None:
                    collected.append(logp.detach())
                    return output_tensor.sum() * 0.0, one, {}
                return loss_for(k, mb, logp, ent), one, {}

            return output, loss_func

        indices, replay, stage = routing
        length = max(n for _, _, n in items)
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(items), model=chunks,
                num_microbatches=len(items), seq_length=length, micro_batch_size=1,
                forward_only=loss_for is None)
        finally:
            if replay is not None:
                replay.clear()
        return collected

    @torch.no_grad()
    def _no_grad_logprobs(self, chunks, mbs: list[PackedMicroBatch], lengths: list[int],
                          routing=(None, None, None)) -> list[torch.Tensor] | None:
        from megatron.core import parallel_state as ps

        out = self._run(chunks, [(k, mb, lengths[k]) for k, mb in enumerate(mbs)], routing=routing)
        return out if ps.is_pipeline_last_stage() else None

    def _token_logprobs(self, output: torch.Tensor, mb: PackedMicroBatch, rows: torch.Tensor | None = None,
                        mine: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the micro-batch's response tokens from the last stage's logits.
        Under context parallelism `rows` are this rank's log-prob rows (local token indices) and
        `mine` their places among the micro-batch's; every CP rank gets the whole micro-batch's."""
        from megatron.core import parallel_state as ps

        rows = mb.inputs.logprob_rows if rows is None else rows
        targets = mb.inputs.targets if mine is None else mb.inputs.targets.index_select(0, mine)
        # the policy and the reference are built alike, so either both heads pick rows or neither
        logits = output[0] if self._heads_pick_rows else output[0].index_select(0, rows)
        if self.tp == 1:
            logp, ent = token_logprobs(logits[:, :self.vocab_size], targets, temperature=self.cfg.temperature,
                                       chunk_bytes=self.cfg.logprob_chunk_bytes)
        else:
            start = ps.get_tensor_model_parallel_rank() * logits.shape[1]
            logp, ent = megatron_step.vocab_parallel_logprobs(
                logits, targets, vocab_start=start, vocab_size=self.vocab_size,
                temperature=self.cfg.temperature, group=ps.get_tensor_model_parallel_group())
        if mine is None:
            return logp, ent
        total = mb.inputs.targets.shape[0]
        return megatron_cp.gather_rows(logp, mine, total), megatron_cp.gather_rows(ent, mine, total)

    def _sum_over_dp(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        y = x.clone()
        dist.all_reduce(y, group=ps.get_data_parallel_group())
        return y

    def _share_sums(self, sums: dict[str, Any], last: bool) -> dict[str, float]:
        """Sum the last stage's metric sums over DP and give every rank the result."""
        from megatron.core import parallel_state as ps

        names = sorted(sums) if last else []
        if ps.get_pipeline_model_parallel_world_size() > 1:
            blob = torch.tensor(list(json.dumps(names).encode()), dtype=torch.uint8) if last else None
            size = torch.tensor([blob.numel() if last else 0], dtype=torch.int64, device=self.device)
            src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
            dist.broadcast(size, src=src, group=group)
            buf = blob.to(self.device) if last else torch.empty(int(size), dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=src, group=group)
            names = json.loads(bytes(buf.cpu().tolist()).decode())
        contributes = last and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        if contributes:
            vec = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64, device=self.device) for n in names])
        dist.all_reduce(vec)
        return dict(zip(names, vec.tolist()))

    def _optimizer_step(self, phase: TrainPhase) -> dict[str, float]:
        cfg, optimizer, step = phase.config, self._optimizers[phase.name], self._steps[phase.name]
        lr = lr_at(step, cfg)
        grad_norm, skipped = optimizer.step(lr, cfg.grad_clip)
        if skipped:
            log.warning("%s step %d: grad_norm=%s is not finite; skipping the update", phase.name, step, grad_norm)
        else:
            self._steps[phase.name] = step + 1
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(skipped)}

    # ------------------------------------------------------------------ weights out
    def iter_hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors under HF names in buckets (collective: every rank iterates to the end)."""
        from miles.backends.megatron_weights import iter_hf_weight_buckets

        self._require_awake("iter_hf_weight_buckets")
        return iter_hf_weight_buckets([c.module for c in self.chunks], bucket_bytes or self.cfg.update_bucket_bytes,
                                      dtype=self.dtype)

    def update_weights(self, transport: WeightTransport, version: int) -> None:
        send_weights(transport, version, self.iter_hf_weight_buckets())

    def save_model(self, path: str | Path, hf: bool = False, extra_state: dict[str, Any] | None = None) -> None:
        self._require_awake("save_model")
        root = Path(path)
        if hf:
            from miles.backends.megatron_weights import save_hf
            save_hf([c.module for c in self.chunks], self.cfg.model_path, root, dtype=self.dtype)
            dist.barrier()
            return
        megatron_checkpoint.save_backend(self, root, extra_state)

    def load_model(self, path: str | Path) -> dict[str, Any]:
        self._require_awake("load_model")
        return megatron_checkpoint.load_backend(self, Path(path))

    def _layout(self) -> dict[str, int]:
        m = self.cfg.megatron
        return {"tp": m.tp, "pp": m.pp, "cp": m.cp, "ep": m.ep}

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        moved = self._offload.sleep(self._device_tensors())
        log.info("sleep: moved %.2f GiB to host", moved / 2**30)

    def wake_up(self) -> None:
        self._offload.wake_up()

    def _device_tensors(self) -> Iterator[torch.Tensor]:
        if self.critic is not None:
            yield from self.critic.device_tensors()
        for chunks in (self.chunks, self.ref_chunks, self.teacher_chunks):
            for chunk in chunks or []:
                for p in chunk.parameters():
                    yield p
                    if getattr(p, "main_grad", None) is not None:
                        yield p.main_grad
                for attr in ("buffers", "expert_parallel_buffers"):
                    buffers = getattr(chunk, attr, None)
                    for buf in buffers if isinstance(buffers, list) else []:
                        for t in (buf.grad_data, getattr(buf, "param_data", None)):
                            if t is not None:
                                yield t
        for opt in self._optimizers.values():
            for _, t in megatron_step.optimizer_tensors(opt):
                yield t

    def _require_awake(self, what: str) -> None:
        if self.chunks is None:
            raise RuntimeError(f"{what}: call init() first")
        if self._offload.asleep:
            raise RuntimeError(f"{what}: the backend is asleep; call wake_up() first")

    def close(self) -> None:
        from miles.backends.megatron_model import destroy_parallel

        self.chunks = self.ref_chunks = self.teacher_chunks = self.critic = None
        self._optimizers.clear()
        destroy_parallel()
