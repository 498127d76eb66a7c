"""The pieces of one Megatron training step that megatron-core does not give us as-is.

- `resolve_sequence_parallel`: on with TP > 1 unless asked otherwise (megatron's default), in the
  local spec too (its norms are ours and carry the `sequence_parallel` mark); off beside a PPO
  critic, whose value head reads whole rows.
- `padded_row`: a packed row padded to the length megatron needs, the padding its own segment.
- `freeze_pad_embedding`: HF's padding_idx (no input-side gradient for the pad token's row).
- `vocab_parallel_logprobs`: token log-probs and entropies from logits sharded over the vocab
  (TP > 1), exact: the max, the normalizer, the target logit and the entropy sum are all-reduced
  over the TP group; backward goes through megatron's `reduce_from_tensor_model_parallel_region`
  (all-reduce forward, identity backward: every TP rank computes the same loss from the reduced
  values, so each rank's local gradient is already the right one). Padded vocab columns (megatron
  pads the vocab to a multiple of 128 x TP) are excluded from every sum.
- `global_grad_norm`: the L2 norm of the whole model's gradient, each distinct shard counted once:
  a dense parameter on DP rank 0 (and TP rank 0 unless TP-sharded), an expert parameter on
  expert-DP rank 0, the last stage's copy of a tied embedding never; then one all-reduce over the
  world. It is the same number torch's clip_grad_norm_ gives on the unsharded model.
- Optimizers. megatron's `get_megatron_optimizer` (fp32 main params, distributed optimizer) needs
  CUDA: `MixedPrecisionOptimizer.__init__` allocates `device='cuda'` tensors, and its param-type
  checks compare `param.type()` with `'torch.cuda.*Tensor'`. So on CUDA `MegatronAdam` wraps it,
  and on a CPU host `LocalAdamW` is torch AdamW over fp32 main copies (the parameters themselves
  when they are fp32) stepping on megatron DDP's `main_grad`, with the same clip and the same
  no-decay rule for 1-D parameters. Both: the norm is computed first and a non-finite one skips
  the update (as the FSDP backend does); `reload_from_model()` re-reads the main copies after
  another phase's optimizer moved the weights; `torch_optimizers()` exposes the inner torch
  optimizers, whose parameters and state are what checkpoints save and sleep offloads.
  `MegatronAdam` asks for the distributed optimizer exactly when the model's DDP was built for it
  (`ddp_config.use_distributed_optimizer`): the two must agree, whatever a phase's config says.
- Optimizer-state offload (`train.optimizer_offload = "cpu" | "nvme"`, `make_optimizer`): the
  moments stream per bucket as in the FSDP backend, because LocalAdamW's inner optimizer is then
  `optim.adamw_over`'s `OffloadedAdamW` over the main copies (the same kernels as FSDP: fused on
  CUDA, foreach elsewhere; bit-identical to offload "none"). It is used on CUDA too: megatron's
  distributed optimizer keeps its fp32 shards and moments on the device and steps them in its
  own buffers, which our streaming cannot reach into. The cost, logged at build: no DP sharding
  of optimizer state, so each DP rank holds its whole moment set (off the device: host memory
  or its own files) and its fp32 main copies on the device, and the model's gradients are
  all-reduced rather than reduce-scattered (the DDP is built without the distributed optimizer).
- `apply_schedule_cpu_shims`: megatron's pipeline schedules allocate `device="cuda"` counters,
  p2p, DDP's grad buffers and the TP/EP gathers allocate on `torch.cuda.current_device()`, p2p
  calls `torch.cuda.synchronize()`, and megatron's GlobalMemoryBuffer (core.utils) that the
  gathers use does the same. On a CPU-only host these five modules (schedules,
  p2p_communication, param_and_grad_buffer, tensor_parallel.mappings, core.utils) see a `torch`
  whose `cuda` answers "cpu" and whose synchronize is a no-op, and activation recompute's save of
  the CUDA RNG state returns a stand-in; no global torch state is touched. (M1's `megatron_cpu`
  shims cover model building; these cover training.)
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from miles.backends.config import TrainConfig
from miles.backends.optim import adamw_over

log = logging.getLogger("miles.backends.megatron")


# ---------------------------------------------------------------- layout and rows
def resolve_sequence_parallel(config: TrainConfig, *, critic: bool = False) -> TrainConfig:
    """`train.megatron.sequence_parallel` resolved: None means on exactly when TP > 1 (megatron's
    default), except beside a PPO critic, whose value head reads whole rows (off, logged); asking
    for it there is an error naming the key."""
    import msgspec

    m = config.megatron
    if m.tp == 1:
        return msgspec.structs.replace(config, megatron=msgspec.structs.replace(m, sequence_parallel=False))
    if critic and m.sequence_parallel:
        raise ValueError(f"train.megatron.sequence_parallel=true with tp={m.tp} and "
                         "algo.advantage_estimator='ppo': the critic's value head needs whole rows; "
                         "set it to false")
    if m.sequence_parallel is None:
        if critic:
            log.info("train.megatron.sequence_parallel: off (tp=%d beside the PPO critic)", m.tp)
        return msgspec.structs.replace(config, megatron=msgspec.structs.replace(m, sequence_parallel=not critic))
    return config


def padded_row(mb, length: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """input_ids / position_ids [1, length] and the segment lengths, with any padding as its own
    segment (attention keeps it apart; no log-prob row points into it)."""
    ids, pos = mb.inputs.input_ids, mb.inputs.position_ids
    bounds = mb.inputs.seq_bounds
    seq_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    extra = length - ids.shape[1]
    if extra < 0:
        raise AssertionError(f"row of {ids.shape[1]} tokens planned at length {length}")
    if extra:
        ids = torch.cat([ids, ids.new_zeros(1, extra)], dim=1)
        pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype, device=pos.device)[None]], dim=1)
        seq_lens.append(extra)
    return ids, pos, seq_lens


# ---------------------------------------------------------------- log-probs over a sharded vocab
def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int,
                            vocab_size: int, temperature: float = 1.0,
                            group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), float32 [R] each, from this TP rank's logits [R, V_local]
    covering global vocab columns [vocab_start, vocab_start + V_local)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    local = z.shape[1]
    cols = torch.arange(vocab_start, vocab_start + local, device=z.device)
    pad = (cols >= vocab_size)[None, :]
    z_safe = z.masked_fill(pad, 0.0)
    m = z.detach().masked_fill(pad, float("-inf")).amax(dim=1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z_safe - m[:, None]).masked_fill(pad, 0.0)
    s = reduce_from_tensor_model_parallel_region(e.sum(dim=1), group=group)
    lse = m + torch.log(s)
    in_range = (targets >= vocab_start) & (targets < vocab_start + local)
    idx = (targets - vocab_start).clamp(0, local - 1)
    picked = z_safe.gather(1, idx[:, None]).squeeze(1)
    target_logit = reduce_from_tensor_model_parallel_region(
        torch.where(in_range, picked, torch.zeros_like(picked)), group=group)
    p = e / s[:, None]
    # H = sum p (lse - z): non-negative terms, as in miles.backends.logprobs
    ent = reduce_from_tensor_model_parallel_region((p * (lse[:, None] - z_safe)).sum(dim=1), group=group)
    return target_logit - lse, ent


# ---------------------------------------------------------------- HF's padding_idx
def freeze_pad_embedding(model: torch.nn.Module, pad_token_id: int | None) -> bool:
    """Give the input embedding HF's `nn.Embedding(padding_idx=pad_token_id)` semantics: a pad
    token in the input contributes no gradient to its embedding row (the HF models of every
    architecture we build are made that way, so the FSDP backend and the engines' model train it
    so). Without this the tied embedding's pad row gets a gradient FSDP never gives it (measured:
    that one row 60x larger, the rest equal). Returns whether a hook was installed."""
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if emb is None or pad_token_id is None or pad_token_id < 0:
        return False

    def detach_pad_rows(module, args, output):
        ids = args[0]  # [b, s]
        if output.shape[:2] == ids.shape:
            return torch.where((ids == pad_token_id)[..., None], output.detach(), output)
        # Sequence parallelism: the embedding reduce-scatters its output to [s / tp, b, h], this TP
        # rank's slice of the sequence. Detaching each rank's own pad rows zeroes them all in the
        # gradient, since the backward all-gathers the slices.
        from megatron.core import parallel_state as ps
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = output.shape[0]
        if n * tp != ids.shape[1] or output.shape[1] != ids.shape[0]:
            raise AssertionError(f"embedding output {tuple(output.shape)} for input ids "
                                 f"{tuple(ids.shape)} at tp={tp}: neither [b, s] nor [s/tp, b]")
        mine = ids.t()[rank * n:(rank + 1) * n]
        return torch.where((mine == pad_token_id)[..., None], output.detach(), output)

    emb.register_forward_hook(detach_pad_rows)
    return True


# ---------------------------------------------------------------- tensor-parallel attributes
def mark_tensor_parallel(model: torch.nn.Module) -> int:
    """Set megatron's `tensor_model_parallel` / `partition_dim` / `partition_stride` attributes
    on the TP-split weights; returns how many were set.

    megatron sets them only while initializing weights, and `megatron_model` builds with
    `perform_initialization=False` (the weights come from the HF checkpoint), so without this
    every parameter would look replicated to the gradient norm (megatron's and ours)."""
    from megatron.core.tensor_parallel import layers

    marked = 0
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.VocabParallelEmbedding)):
            split = [(getattr(module, "weight", None), 0), (getattr(module, "bias", None), 0)]
        elif isinstance(module, layers.RowParallelLinear):
            split = [(getattr(module, "weight", None), 1)]
        else:
            continue
        for param, dim in split:
            if isinstance(param, torch.Tensor) and not hasattr(param, "tensor_model_parallel"):
                layers.set_tensor_model_parallel_attributes(param, True, dim, 1)
                marked += 1
    return marked


# ---------------------------------------------------------------- gradient norm
def _counts_here(param: torch.Tensor) -> bool:
    from megatron.core import parallel_state as ps

    if getattr(param, "shared", False):
        return False  # the last stage's copy of a tied embedding (its grad is the first stage's)
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    if getattr(param, "allreduce", True):
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0 and (
            sharded or ps.get_tensor_model_parallel_rank() == 0)
    return ps.get_expert_data_parallel_rank() == 0 and (sharded or ps.get_expert_tensor_parallel_rank() == 0)


def global_grad_norm(params: Sequence[torch.Tensor], device: torch.device) -> float:
    """L2 norm over every rank of the parameters' `main_grad` (collective over the world)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is not None and _counts_here(p):
            sq += g.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    return math.sqrt(float(sq)) if math.isfinite(float(sq)) else float("nan")


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor (1 when no clipping applies)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


# ---------------------------------------------------------------- optimizers
def make_optimizer(chunks: Sequence[torch.nn.Module], cfg: TrainConfig, device: torch.device,
                   dtype: torch.dtype):
    """The optimizer of one model (its DDP `chunks`): megatron's on CUDA, LocalAdamW on a CPU host
    or whenever train.optimizer_offload streams the moments (see the module docstring)."""
    params = [p for c in chunks for p in c.parameters()]
    sharded_grads = any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False)
                        for c in chunks)
    if cfg.optimizer_offload != "none":
        if sharded_grads:
            raise ValueError(f"train.optimizer_offload={cfg.optimizer_offload!r}: the model's gradient "
                             "buffers were built for megatron's distributed optimizer (the run's "
                             "train.optimizer_offload is 'none'); a phase cannot turn offload on")
        if device.type == "cuda":
            log.info("train.optimizer_offload=%r: Adam moments stream from %s per bucket (LocalAdamW); "
                     "megatron's distributed optimizer is off, so each DP rank keeps its whole moment "
                     "set there and its fp32 main params on the device", cfg.optimizer_offload,
                     "host memory" if cfg.optimizer_offload == "cpu" else cfg.offload_dir)
        return LocalAdamW(params, cfg, device, fp32_main=cfg.master_weights_fp32)
    if device.type == "cuda":
        return MegatronAdam(chunks, cfg, dtype)
    return LocalAdamW(params, cfg, device, fp32_main=cfg.master_weights_fp32)


class LocalAdamW:
    """AdamW over fp32 main params, stepping on megatron DDP's main_grad (CPU hosts; any host
    with optimizer offload, the inner optimizer then being OffloadedAdamW)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], cfg: TrainConfig, device: torch.device,
                 fp32_main: bool):
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.mains = [p.detach().float().clone() if (fp32_main and p.dtype != torch.float32) else p
                      for p in self.params]
        self.optimizer = adamw_over(self.mains, cfg, device)

    def step(self, lr: float, max_norm: float) -> tuple[float, bool]:
        """One update; returns (grad norm, skipped)."""
        norm = global_grad_norm(self.params, self.device)
        if not math.isfinite(norm):
            return norm, True
        coef = clip_coefficient(norm, max_norm)
        for main, p in zip(self.mains, self.params):
            g = p.main_grad
            g = g.to(main.dtype) if g.dtype != main.dtype else g
            main.grad = g * coef if coef != 1.0 else g
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            for main, p in zip(self.mains, self.params):
                main.grad = None
                if main is not p:
                    p.copy_(main)
        return norm, False

    def reload_from_model(self) -> None:
        with torch.no_grad():
            for main, p in zip(self.mains, self.params):
                if main is not p:
                    main.copy_(p)

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


class MegatronAdam:
    """megatron's optimizer (fp32 main params, optional distributed optimizer), CUDA hosts."""

    def __init__(self, chunks: Sequence[torch.nn.Module], cfg: TrainConfig, dtype: torch.dtype):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        mixed = dtype in (torch.bfloat16, torch.float16) and cfg.master_weights_fp32
        config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.grad_clip, bf16=mixed and dtype == torch.bfloat16,
            fp16=mixed and dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=any(c.ddp_config.use_distributed_optimizer for c in chunks))
        self.optimizer = get_megatron_optimizer(config, list(chunks))

    def _parts(self):
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def step(self, lr: float, max_norm: float) -> tuple[float, bool]:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.optimizer.prepare_grads():  # fp16 overflow
            return float("nan"), True
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return norm, True
        if max_norm > 0:
            for part in self._parts():
                params = part.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
        self.optimizer.step_with_ready_grads()
        return norm, False

    def reload_from_model(self) -> None:
        self.optimizer.reload_model_params()

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self._parts() if getattr(part, "optimizer", None) is not None]


def optimizer_tensors(opt) -> Iterator[tuple[str, torch.Tensor]]:
    """(stable name, tensor) of every main parameter and state tensor of `opt`'s torch optimizers."""
    for j, inner in enumerate(opt.torch_optimizers()):
        i = 0
        for group in inner.param_groups:
            for p in group["params"]:
                yield f"{j}.{i}.param", p
                for key, value in sorted(inner.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        yield f"{j}.{i}.{key}", value
                i += 1


def load_optimizer_tensors(opt, saved: dict[str, torch.Tensor]) -> None:
    """Inverse of `optimizer_tensors`: main params copied in place, state tensors restored."""
    for j, inner in enumerate(opt.torch_optimizers()):
        i = 0
        for group in inner.param_groups:
            for p in group["params"]:
                with torch.no_grad():
                    p.copy_(saved[f"{j}.{i}.param"])
                prefix = f"{j}.{i}."
                # torch Adam keeps `step` on the host unless it is fused or capturable
                step_on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
                state = {k[len(prefix):]: v.to(p.device if (step_on_device or k != prefix + "step") else "cpu")
                         for k, v in saved.items() if k.startswith(prefix) and k != f"{j}.{i}.param"}
                if state:
                    inner.state[p] = state
                i += 1


# ---------------------------------------------------------------- CPU schedule shims
class _CpuCuda:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None


class _CpuTorch(types.ModuleType):
    """torch as the pipeline schedules see it on a CPU-only host (see the module docstring)."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_cpu_for_cuda(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_cpu_for_cuda(device), **kwargs)


def _cpu_for_cuda(device):
    if device is None:
        return None
    return torch.device("cpu") if torch.device(device).type == "cuda" else device


def apply_schedule_cpu_shims() -> bool:
    """Give megatron's schedule and p2p modules the CPU `torch` (no-op with CUDA); idempotent."""
    if torch.cuda.is_available():
        return False
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core import utils
    from megatron.core.tensor_parallel import mappings

    for module in (schedules, p2p_communication, param_and_grad_buffer, mappings, utils):
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch("torch")
    # Activation recompute saves "the CUDA RNG state" around each checkpointed forward; there is
    # none here (megatron_cpu already makes restoring it a no-op), so saving returns a stand-in.
    from megatron.core.tensor_parallel import random as tp_random
    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    return True


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()
