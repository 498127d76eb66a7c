"""HF <-> Megatron weights: a registry of name patterns and mappings, loading and streaming export.

Design decisions:
- Our own registry, in Megatron-Bridge's spirit (its `MegatronMappingRegistry`): Megatron-Bridge
  itself does not fit CPU CI (its newest release for Python 3.11 pins transformers 4.x, megatron-
  core < 0.17 with dev extras, Transformer Engine, mamba-ssm, wandb, hydra, datasets).
- A parameter is resolved from its Megatron name: a wildcard pattern (`*` = a layer or expert
  number) picks a mapping kind, which knows how the HF tensor(s) relate to the Megatron tensor and
  to its TP split: replicated, column (dim 0), row (dim 1), vocab (dim 0, padded vocab rows),
  QKV (Megatron interleaves [q heads of group g, k_g, v_g] per query group; TP splits whole
  groups), gated MLP (linear_fc1 = [gate; up], TP splits each half).
- Megatron names carry LOCAL indices: a PP stage's layers start at 0 and an EP rank's experts
  start at 0. Both are made global first (a layer's `layer_number`; expert offset = EP rank x local
  experts, as megatron's MoELayer numbers them); everything after speaks global names only.
- Loading reads only this rank's slice of each HF tensor (`safe_open(...).get_slice`).
- Export gives every rank the full HF tensors, in one global order (names from all ranks,
  naturally sorted), so every rank makes the same collectives in the same order: TP all-gather
  inside the owning stage (the expert TP group for experts), broadcast from the owning EP rank
  over the EP group, broadcast from the owning PP stage over the PP group. Each rank therefore
  ends up with every tensor; the caller decides which rank sends.
- Buckets never split an atomic update group: q/k/v (weights and biases) of one layer, gate/up of
  one MLP, and each expert's gate/up/down (or, with `fused_experts=True`, all experts of a layer,
  for engines that load a layer's experts in one call). A group larger than the budget gets a bucket
  alone. The bucket type is `hf_weights.NamedTensors`, so any weight transport takes them.
- Tied embeddings appear once, as `model.embed_tokens.weight` (the HF checkpoint convention).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from miles.backends.hf_weights import NamedTensors, write_hf_dir

# ---------------------------------------------------------------------------------------------
# mappings


@dataclass(frozen=True)
class Mapping:
    """How one Megatron parameter relates to its HF tensor(s). `kind` is one of KINDS."""
    megatron: str               # pattern, `*` = layer (first) and expert (second) numbers
    hf: tuple[str, ...]         # HF name patterns, filled with the same numbers
    kind: str

    def tp_dim(self) -> int | None:
        return {"replicated": None, "row": 1}.get(self.kind, 0)


KINDS = ("replicated", "column", "row", "vocab", "qkv", "gated")

_LAYER = "decoder.layers.*."
_HF_LAYER = "model.layers.*."
_EXPERT = "mlp.experts.local_experts.*."
_HF_EXPERT = "mlp.experts.*."

REGISTRY: tuple[Mapping, ...] = (
    Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Mapping("output_layer.weight", ("lm_head.weight",), "vocab"),
    Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Mapping(_LAYER + "input_layernorm.weight", (_HF_LAYER + "input_layernorm.weight",), "replicated"),
    # TE spec: the norm is fused into the following linear.
    Mapping(_LAYER + "self_attention.linear_qkv.layer_norm_weight",
            (_HF_LAYER + "input_layernorm.weight",), "replicated"),
    Mapping(_LAYER + "pre_mlp_layernorm.weight",
            (_HF_LAYER + "post_attention_layernorm.weight",), "replicated"),
    Mapping(_LAYER + "mlp.linear_fc1.layer_norm_weight",
            (_HF_LAYER + "post_attention_layernorm.weight",), "replicated"),
    Mapping(_LAYER + "self_attention.linear_qkv.weight",
            tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Mapping(_LAYER + "self_attention.linear_qkv.bias",
            tuple(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    Mapping(_LAYER + "self_attention.q_layernorm.weight", (_HF_LAYER + "self_attn.q_norm.weight",),
            "replicated"),
    Mapping(_LAYER + "self_attention.k_layernorm.weight", (_HF_LAYER + "self_attn.k_norm.weight",),
            "replicated"),
    Mapping(_LAYER + "self_attention.linear_proj.weight", (_HF_LAYER + "self_attn.o_proj.weight",),
            "row"),
    Mapping(_LAYER + "mlp.linear_fc1.weight",
            (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"), "gated"),
    Mapping(_LAYER + "mlp.linear_fc2.weight", (_HF_LAYER + "mlp.down_proj.weight",), "row"),
    Mapping(_LAYER + "mlp.router.weight", (_HF_LAYER + "mlp.gate.weight",), "replicated"),
    Mapping(_LAYER + _EXPERT + "linear_fc1.weight",
            (_HF_LAYER + _HF_EXPERT + "gate_proj.weight", _HF_LAYER + _HF_EXPERT + "up_proj.weight"),
            "gated"),
    Mapping(_LAYER + _EXPERT + "linear_fc2.weight", (_HF_LAYER + _HF_EXPERT + "down_proj.weight",),
            "row"),
)


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


_COMPILED = [(_regex(m.megatron), m) for m in REGISTRY]


def resolve(name: str) -> tuple[Mapping, tuple[int, ...]]:
    """The mapping of a (global) Megatron parameter name and its layer/expert numbers."""
    for rx, mapping in _COMPILED:
        if found := rx.match(name):
            return mapping, tuple(int(g) for g in found.groups())
    raise KeyError(f"megatron parameter {name!r} matches no pattern of the HF weight registry")


def _fill(pattern: str, numbers: Sequence[int]) -> str:
    parts = pattern.split("*")
    if len(parts) - 1 != len(numbers):
        raise ValueError(f"pattern {pattern!r} needs {len(parts) - 1} numbers, got {numbers}")
    return "".join(p + (str(n) if i < len(numbers) else "")
                   for i, (p, n) in enumerate(zip(parts, list(numbers) + [None])))


def hf_names(mapping: Mapping, numbers: Sequence[int]) -> list[str]:
    return [_fill(p, numbers) for p in mapping.hf]


# ---------------------------------------------------------------------------------------------
# the model's parameters under global names


@dataclass
class _Param:
    name: str                   # global Megatron name
    mapping: Mapping
    numbers: tuple[int, ...]
    tensor: torch.Tensor
    expert: bool


def _chunks(models) -> list[torch.nn.Module]:
    out = []
    for m in (models if isinstance(models, (list, tuple)) else [models]):
        while hasattr(m, "module") and isinstance(m.module, torch.nn.Module):  # DDP / Float16Module
            m = m.module
        out.append(m)
    return out


def _shape_info(model) -> dict:
    """What the QKV and vocab mappings need to know about the model's shape."""
    cfg = model.config
    return dict(groups=cfg.num_query_groups, heads=cfg.num_attention_heads,
                head_dim=cfg.kv_channels, vocab=model.miles_vocab_size)


def _local_params(models) -> list[_Param]:
    from megatron.core import parallel_state as ps

    params: list[_Param] = []
    for model in _chunks(models):
        layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        for name, tensor in model.named_parameters():
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue  # a tied model's head is the embedding (exported once, as embed_tokens)
            mapping, numbers = resolve(name)
            expert = ".local_experts." in name
            if numbers:
                numbers = (layer_numbers[numbers[0]],) + numbers[1:]
            if expert:
                local = model.decoder.layers[int(name.split(".")[2])].mlp.num_local_experts
                numbers = (numbers[0], ps.get_expert_model_parallel_rank() * local + numbers[1])
            params.append(_Param(_global_name(name, numbers), mapping, numbers, tensor, expert))
    return params


def _global_name(local_name: str, numbers: Sequence[int]) -> str:
    it = iter(numbers)
    return re.sub(r"(?<=\.)\d+(?=\.)", lambda _m: str(next(it)), local_name, count=len(numbers))


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------
# HF -> Megatron (load)


class _Checkpoint:
    """The tensors of an HF safetensors directory, read by slice."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open
        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"hf_dir {str(self.dir)!r}: no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"{str(self.dir)!r} has no tensor {name!r}")
        return self._where[name].get_slice(name)


def _read_shard(ck: _Checkpoint, mapping: Mapping, names: list[str], info: dict, rank: int,
                tp: int, local_shape: torch.Size) -> torch.Tensor:
    kind = mapping.kind
    if kind == "replicated":
        return ck.slice(names[0])[:]
    if kind == "row":
        cols = local_shape[1]
        return ck.slice(names[0])[:, rank * cols:(rank + 1) * cols]
    if kind == "column":
        rows = local_shape[0]
        return ck.slice(names[0])[rank * rows:(rank + 1) * rows]
    if kind == "vocab":
        rows, vocab = local_shape[0], info["vocab"]
        start, stop = rank * rows, min((rank + 1) * rows, vocab)
        out = torch.zeros(local_shape, dtype=_dtype_of(ck.slice(names[0])))
        if stop > start:
            out[:stop - start] = ck.slice(names[0])[start:stop]
        return out
    if kind == "gated":
        half = local_shape[0] // 2
        return torch.cat([ck.slice(n)[rank * half:(rank + 1) * half] for n in names])
    if kind == "qkv":
        groups, d = info["groups"] // tp, info["head_dim"]
        per_group = info["heads"] // info["groups"]
        g0 = rank * groups
        q = ck.slice(names[0])[g0 * per_group * d:(g0 + groups) * per_group * d]
        k = ck.slice(names[1])[g0 * d:(g0 + groups) * d]
        v = ck.slice(names[2])[g0 * d:(g0 + groups) * d]
        tail = q.shape[1:]
        parts = [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail),
                 v.reshape(groups, d, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)
    raise ValueError(f"unknown mapping kind {kind!r}")


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _dtype_of(sl) -> torch.dtype:
    return _ST_DTYPES[sl.get_dtype()]


def load_hf_into(models, hf_dir: str | Path) -> int:
    """Copy this rank's slice of every HF tensor into the model chunk(s); returns params loaded.

    Each rank reads only what it holds (its PP stage's layers, its EP rank's experts, its TP
    slice). Every parameter must be found, or KeyError names it."""
    from megatron.core import parallel_state as ps

    ck = _Checkpoint(hf_dir)
    info = _shape_info(_chunks(models)[0])
    count = 0
    with torch.no_grad():
        for model in _chunks(models):
            for p in _local_params(model):
                rank, tp = _tp_rank_size(p.expert, ps)
                if p.mapping.tp_dim() is None:
                    rank, tp = 0, 1
                names = hf_names(p.mapping, p.numbers)
                shard = _read_shard(ck, p.mapping, names, info, rank, tp, p.tensor.shape)
                _copy(p, shard)
                count += 1
            if model.share_embeddings_and_output_weights and not model.pre_process \
                    and model.post_process and getattr(model, "output_layer", None) is not None:
                # A tied model's last stage keeps its own copy of the embedding as its head.
                head = model.output_layer.weight
                m = Mapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
                rank, tp = _tp_rank_size(False, ps)
                _copy(_Param("output_layer.weight", m, (), head, False),
                      _read_shard(ck, m, list(m.hf), info, rank, tp, head.shape))
                count += 1
    return count


def _copy(p: _Param, shard: torch.Tensor) -> None:
    if tuple(shard.shape) != tuple(p.tensor.shape):
        raise ValueError(f"megatron parameter {p.name!r}: HF slice shape {tuple(shard.shape)} != "
                         f"{tuple(p.tensor.shape)}")
    p.tensor.data.copy_(shard.to(dtype=p.tensor.dtype))


def _tp_rank_size(expert: bool, ps) -> tuple[int, int]:
    if expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------------------------------------
# Megatron -> HF (export)


def _to_hf(p_mapping: Mapping, numbers, shards: list[torch.Tensor], info: dict) -> NamedTensors:
    names, kind = hf_names(p_mapping, numbers), p_mapping.kind
    if kind == "replicated":
        return [(names[0], shards[0])]
    if kind == "row":
        return [(names[0], torch.cat(shards, dim=1))]
    if kind == "column":
        return [(names[0], torch.cat(shards, dim=0))]
    if kind == "vocab":
        return [(names[0], torch.cat(shards, dim=0)[:info["vocab"]])]
    if kind == "gated":
        half = shards[0].shape[0] // 2
        return [(names[0], torch.cat([s[:half] for s in shards])),
                (names[1], torch.cat([s[half:] for s in shards]))]
    if kind == "qkv":
        full = torch.cat(shards, dim=0)
        d, per_group = info["head_dim"], info["heads"] // info["groups"]
        tail = full.shape[1:]
        grouped = full.reshape(info["groups"], (per_group + 2) * d, *tail)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [(n, t.reshape(-1, *tail)) for n, t in zip(names, (q, k, v))]
    raise ValueError(f"unknown mapping kind {kind!r}")


def _plan(models) -> tuple[list[tuple[str, tuple, str, bool, int, int]], dict[str, _Param]]:
    """Every exported parameter of the whole model, in one global order, with its owner.

    Entries: (global name, local shape, dtype name, expert, owner PP rank, owner EP rank)."""
    from megatron.core import parallel_state as ps

    local = {p.name: p for p in _local_params(models)}
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    mine = [(p.name, tuple(p.tensor.shape), str(p.tensor.dtype).removeprefix("torch."), p.expert,
             pp_rank, ep_rank if p.expert else -1) for p in local.values()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, tuple] = {}
    for entries in everyone:
        for e in entries:
            merged.setdefault(e[0], e)
    return [merged[n] for n in sorted(merged, key=_natural_key)], local


def iter_hf_weights(models, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, on EVERY rank, in the same order.

    Collective: every trainer rank must run it to the end. `dtype` None keeps the parameter dtype;
    tensors are cast before they are gathered (bf16 moves half the bytes of fp32)."""
    from megatron.core import parallel_state as ps

    chunks = _chunks(models)
    info = _shape_info(chunks[0])
    plan, local = _plan(chunks)
    pp_group, ep_group = ps.get_pipeline_model_parallel_group(), ps.get_expert_model_parallel_group()
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    device = next(iter(chunks[0].parameters())).device
    for name, shape, dtype_name, expert, owner_pp, owner_ep in plan:
        mapping, numbers = resolve(name)
        out_dtype = dtype or getattr(torch, dtype_name)
        rank, tp = _tp_rank_size(expert, ps)
        tp_group = (ps.get_expert_tensor_parallel_group() if expert
                    else ps.get_tensor_model_parallel_group())
        split = mapping.tp_dim() is not None and tp > 1
        shards_shape = [shape] * (tp if split else 1)
        if pp_rank == owner_pp and (not expert or ep_rank == owner_ep):
            mine = local[name].tensor.detach().to(out_dtype).contiguous()
            shards = [torch.empty_like(mine) for _ in range(tp)] if split else [mine]
            if split:
                dist.all_gather(shards, mine, group=tp_group)
        else:
            shards = [torch.empty(s, dtype=out_dtype, device=device) for s in shards_shape]
        if expert and ps.get_expert_model_parallel_world_size() > 1 and pp_rank == owner_pp:
            src = dist.get_global_rank(ep_group, owner_ep)
            for s in shards:
                dist.broadcast(s, src, group=ep_group)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            src = dist.get_global_rank(pp_group, owner_pp)
            for s in shards:
                dist.broadcast(s, src, group=pp_group)
        yield from _to_hf(mapping, numbers, shards, info)


def atomic_group(hf_name: str, *, fused_experts: bool = False) -> str:
    """The update group of an HF tensor: tensors with the same key go into one bucket."""
    if m := re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.", hf_name):
        return m.group(1) if fused_experts else f"{m.group(1)}.{m.group(2)}"
    if m := re.match(r"^(model\.layers\.\d+\.self_attn)\.[qkv]_proj\.(weight|bias)$", hf_name):
        return m.group(1) + ".qkv"
    if m := re.match(r"^(model\.layers\.\d+\.mlp)\.(gate|up)_proj\.weight$", hf_name):
        return m.group(1) + ".gate_up"
    return hf_name


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_atomic(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int,
                  group_of: Callable[[str], str] = atomic_group) -> Iterator[NamedTensors]:
    """Pack a stream of (name, tensor) into buckets of at most `bucket_bytes`, keeping each atomic
    group whole (a group larger than the budget is a bucket alone). A group's tensors must be
    adjacent in the stream; one that reappears later is an error (it would be split)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    bucket: NamedTensors = []
    size = 0
    group: NamedTensors = []
    key = None
    closed: set[str] = set()

    def place(g: NamedTensors):
        nonlocal bucket, size
        g_size = sum(_nbytes(t) for _, t in g)
        out = None
        if bucket and size + g_size > bucket_bytes:
            out, bucket, size = bucket, [], 0
        bucket.extend(g)
        size += g_size
        return out

    for name, tensor in named:
        k = group_of(name)
        if k != key:
            if group and (full := place(group)):
                yield full
            if k in closed:
                raise ValueError(f"atomic group {k!r} is not contiguous in the export order "
                                 f"({name!r} came after the group was closed)")
            if key is not None:
                closed.add(key)
            group, key = [], k
        group.append((name, tensor.contiguous()))
    if group and (full := place(group)):
        yield full
    if bucket:
        yield bucket


def iter_hf_weight_buckets(models, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                           fused_experts: bool = False) -> Iterator[NamedTensors]:
    """`iter_hf_weights` in buckets of about `bucket_bytes`, atomic groups never split (collective,
    on every rank; `fused_experts=True` keeps all experts of a layer together)."""
    yield from bucket_atomic(iter_hf_weights(models, dtype=dtype), bucket_bytes,
                             lambda n: atomic_group(n, fused_experts=fused_experts))


# ---------------------------------------------------------------------------------------------
# HF directory export

def save_hf(models, source_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
            shard_bytes: int = 4 << 30, write: bool | None = None) -> None:
    """Write an HF safetensors directory loadable by `from_pretrained` (collective on every rank;
    only the rank with `write`, default global rank 0, touches the disk): `write_hf_dir` over
    this model's buckets."""
    write = dist.get_rank() == 0 if write is None else write
    write_hf_dir(iter_hf_weight_buckets(models, shard_bytes, dtype=dtype), source_dir, out_dir,
                 write=write)
