"""Full (unsharded) weights under HF checkpoint names, in buckets: for weight sync and HF export.

Design decisions:
- One generator, `iter_hf_weight_buckets`, serves both the weight transports (update_weights) and
  the safetensors export, so the names engines load and the names on disk can never drift apart.
- Every rank must run the generator to the end: gathering a sharded parameter is a collective.
  Ranks that do not send simply drop the tensors.
- transformers 5 keeps MoE experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] with
  gate rows first, `mlp.experts.down_proj` [E, H, I]); checkpoints and SGLang use one tensor per
  expert (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]). The split
  happens here, after the gather, and nowhere else.
- Tied embeddings appear once (`model.embed_tokens.weight`), as in an HF checkpoint of a tied model.
- Tensors are cast to the export dtype and made contiguous before they leave; a bucket closes when
  adding the next tensor would pass `bucket_bytes` (a tensor larger than that gets a bucket alone).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from miles.weights.disk import copy_model_files

NamedTensors = list[tuple[str, torch.Tensor]]

_FUSED_GATE_UP = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.mlp\.experts)\.down_proj$")


def to_hf_names(name: str, full: torch.Tensor) -> NamedTensors:
    """One in-memory parameter -> its checkpoint tensors (several for fused MoE experts)."""
    if (m := _FUSED_GATE_UP.match(name)) and full.dim() == 3:
        inter = full.shape[1] // 2
        out = []
        for e in range(full.shape[0]):
            out.append((f"{m.group(1)}.{e}.gate_proj.weight", full[e, :inter]))
            out.append((f"{m.group(1)}.{e}.up_proj.weight", full[e, inter:]))
        return out
    if (m := _FUSED_DOWN.match(name)) and full.dim() == 3:
        return [(f"{m.group(1)}.{e}.down_proj.weight", full[e]) for e in range(full.shape[0])]
    return [(name, full)]


def _full_tensor(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole parameter, cast to `dtype`; collective for a sharded one.

    The local shard is cast first (gathering bf16 moves half the bytes of gathering fp32 masters).
    FSDP2's layout (one mesh dim, `Shard(0)`) is gathered with plain tensor ops and one
    all_gather: DTensor's `.to()` + `.full_tensor()` dispatch cost ~180 us per parameter on a host
    core against ~50 (measured with a 1-rank mesh), which is most of a small model's publish.
    Any other layout goes through DTensor."""
    data = param.detach()
    if not hasattr(data, "full_tensor"):
        return data if dtype is None else data.to(dtype)
    mesh, placements = data.device_mesh, data.placements
    if mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard(0):
        local = data.to_local()
        if dtype is not None:
            local = local.to(dtype)
        if mesh.size() == 1:
            return local
        return _gather_dim0(local, data.shape, mesh.get_group())
    return (data if dtype is None else data.to(dtype)).full_tensor()


def _gather_dim0(local: torch.Tensor, shape: torch.Size, group) -> torch.Tensor:
    """All-gather dim-0 shards laid out like `torch.chunk` (DTensor's Shard(0)): every shard has
    ceil(n / world) rows except the last non-empty one, and any after it are empty. Each rank pads
    its shard to that size, so the gathered rows are the tensor's rows followed by padding."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    rows = -(-shape[0] // world)
    if local.shape[0] < rows:
        local = torch.cat([local, local.new_zeros(rows - local.shape[0], *shape[1:])])
    out = local.new_empty(world * rows, *shape[1:])
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out[:shape[0]]


def iter_hf_weight_buckets(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                           device: torch.device | str | None = None,
                           params: Iterable[tuple[str, torch.Tensor]] | None = None) -> Iterator[NamedTensors]:
    """Yield lists of (HF name, full tensor) of about `bucket_bytes` each, in parameter order.

    `model` is the HF causal LM (its parameters may be FSDP DTensor shards). `dtype` None keeps the
    parameter dtype; `device` None keeps the tensors where the gather put them. `params` replaces
    `model.named_parameters()` (LoRA: the merged weights, miles/backends/lora.py).
    """
    bucket: NamedTensors = []
    size = 0
    for name, param in (model.named_parameters() if params is None else params):
        full = _full_tensor(param, dtype)
        if device is not None:
            full = full.to(device)
        for hf_name, tensor in to_hf_names(name, full):
            tensor = tensor.contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((hf_name, tensor))
            size += nbytes
    if bucket:
        yield bucket


def export_hf(model: nn.Module, source_dir: str | Path, out_dir: str | Path, *, write: bool,
              dtype: torch.dtype, shard_bytes: int = 4 << 30,
              params: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Write an HF directory (safetensors + config + tokenizer files) loadable by from_pretrained.

    Every rank calls this (the gather is collective); only the rank with `write` touches the disk.
    The tokenizer and generation config are copied from `source_dir`, the model's own directory.
    """
    write_hf_dir(iter_hf_weight_buckets(model, shard_bytes, dtype=dtype, device="cpu", params=params),
                 source_dir, out_dir, write=write)


def write_hf_dir(buckets: Iterable[NamedTensors], source_dir: str | Path, out_dir: str | Path, *,
                 write: bool) -> None:
    """The one HF-directory writer (FSDP's `export_hf`, Megatron's `save_hf`): one safetensors
    shard per bucket, named as huggingface_hub names them, the index when there are several,
    config.json with the exported dtype and the tokenizer files of `source_dir`.

    Every rank iterates `buckets` (gathering them is collective); only `write` touches the disk.
    Each bucket is written as soon as it is gathered (no rank holds the whole model), under a
    provisional name: the final "-of-N" names are known only at the end."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if write:
        out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    total, dtype = 0, None
    for k, bucket in enumerate(buckets):
        dtype = dtype or bucket[0][1].dtype
        if not write:
            continue
        tmp = out / f".shard-{k:05d}.safetensors"
        save_file({name: t.cpu() for name, t in bucket}, str(tmp), metadata={"format": "pt"})
        written.append((tmp, [name for name, _ in bucket]))
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    if not write:
        return
    weight_map: dict[str, str] = {}
    for k, (tmp, names) in enumerate(written):
        fname = ("model.safetensors" if len(written) == 1
                 else f"model-{k + 1:05d}-of-{len(written):05d}.safetensors")
        tmp.rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    if len(written) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    copy_model_files(source_dir, out, dtype)
