"""Weight updates for the embedded engine: from disk, from tensors, over torch.distributed; checksums.

Design decisions:
- Every update validates all names and shapes *before* copying anything, so a bad update leaves
  the old weights intact (except a distributed update, which must still drain the trainer's
  broadcasts to keep both sides in step: it receives everything, then refuses to apply it).
- Names are checkpoint names (per-expert for MoE), transformers-5 fused names, or the tied
  `lm_head.weight`; `Weights.lookup` maps each to its storage (model.py).
- `/update_weights_from_tensor` on SGLang carries pickled CUDA-IPC handles. We never unpickle
  bytes from the network: here each element of `serialized_named_tensors` is the base64 of a
  safetensors file (`safetensors.torch.save(named_tensors)`), one element per TP rank (we have
  one). `encode_tensor_payload` in miles/engines/client.py builds it.
- The distributed group is built exactly like SGLang's `init_custom_process_group` (a tcp://
  rendezvous, a `PrefixStore(group_name, store)`, `_new_process_group_helper`), so the trainer side
  can be the same helper on either engine: trainer rank 0 is the group's rank 0 and the store
  master; the engine joins as `rank_offset` (+ its TP rank, always 0 here). Then the trainer
  broadcasts each listed tensor from rank 0, in order.
- Checksums are sha256 of each tensor's raw bytes, contiguous, in the engine's dtype, keyed by
  checkpoint name; `tensor_sha256` in client.py computes the same on the trainer side.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import timedelta
from pathlib import Path

import torch

from miles.engines.embedded_engine.model import (IGNORED_CHECKPOINT_SUFFIXES, Weights,
                                                 load_hf_config, shape_from_config)


def parse_dtype(name: str) -> torch.dtype:
    bare = name.removeprefix("torch.")
    dt = getattr(torch, bare, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name (e.g. 'bfloat16')")
    return dt


def check_names_shapes(weights: Weights, items: list[tuple[str, tuple[int, ...]]]) -> None:
    for name, shape in items:
        dst = weights.lookup(name)  # KeyError names the weight
        if tuple(dst.shape) != tuple(shape):
            raise ValueError(f"weight {name!r}: shape {list(shape)} != the engine's {list(dst.shape)}")


def check_same_architecture(weights: Weights, model_path: str) -> None:
    new = shape_from_config(load_hf_config(model_path))
    old = weights.shape
    for f in ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size", "num_experts", "moe_intermediate_size"):
        if getattr(new, f) != getattr(old, f):
            raise ValueError(f"model_path {model_path!r}: config {f}={getattr(new, f)!r} differs from "
                             f"the served model's {getattr(old, f)!r}; a weight update cannot change "
                             "the architecture")


def load_from_disk(weights: Weights, model_path: str) -> int:
    """Validate then copy every tensor of a safetensors directory; returns the tensor count."""
    from safetensors import safe_open
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model_path {model_path!r}: not a directory")
    check_same_architecture(weights, model_path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path {model_path!r}: no *.safetensors files")
    plan = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if not name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                    plan.append((f, name, tuple(st.get_slice(name).get_shape())))
    check_names_shapes(weights, [(n, s) for _, n, s in plan])
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if not name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                        weights.copy_in(name, st.get_tensor(name))
    _sync(weights)
    return len(plan)


def decode_tensor_payload(payload: str, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError:
        raise ValueError(f"{where}: not base64") from None
    try:
        return load(raw)
    except Exception:
        raise ValueError(f"{where}: not a safetensors payload (the embedded engine accepts "
                         "base64 safetensors bytes and never unpickles network input)") from None


def apply_named_tensors(weights: Weights, named: list[tuple[str, torch.Tensor]]) -> None:
    check_names_shapes(weights, [(n, tuple(t.shape)) for n, t in named])
    with torch.no_grad():
        for name, t in named:
            weights.copy_in(name, t)
    _sync(weights)


def _sync(weights: Weights) -> None:
    if weights.device.type == "cuda":
        torch.cuda.synchronize(weights.device)


# ---- torch.distributed group (SGLang's init_custom_process_group) ----------------------------

def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout_s: float = 600.0):
    """A process group independent of the default one (trainers already have theirs)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class UpdateGroups:
    def __init__(self, device: torch.device):
        self.device = device
        self.groups: dict[str, object] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"group_name: {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend: 'nccl' needs an engine on CUDA; this engine runs on CPU, "
                             "use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset: {rank_offset} must be in [1, world_size={world_size})")
        host = f"[{master_address}]" if ":" in master_address else master_address
        self.groups[group_name] = init_custom_process_group(
            backend, f"tcp://{host}:{master_port}", world_size, rank_offset, group_name)

    def destroy(self, group_name: str) -> None:
        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise ValueError(f"group_name: {group_name!r} is not an open weight update group")
        import torch.distributed as dist
        try:
            dist.destroy_process_group(pg)
        except Exception:  # best effort: the peer may be gone already
            pass

    def receive(self, weights: Weights, group_name: str, names: list[str], dtypes: list[str],
                shapes: list[list[int]]) -> None:
        """Receive the trainer's broadcasts (always all of them), then validate and apply."""
        import torch.distributed as dist
        pg = self.groups.get(group_name)
        if pg is None:
            raise LookupError(f"group_name: {group_name!r} is not an open weight update group; call "
                              "/init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, "
                             f"{len(shapes)})")
        backend = dist.get_backend(pg)
        recv_device = self.device if backend == "nccl" else torch.device("cpu")
        received = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=parse_dtype(dt), device=recv_device)
            dist.broadcast(t, src=0, group=pg)
            received.append((name, t))
        apply_named_tensors(weights, received)


# ---- checksums ------------------------------------------------------------------------------

def tensor_sha256(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def checksums(weights: Weights, names: list[str] | None = None) -> dict[str, str]:
    selected = names if names else list(weights.names)
    return {n: tensor_sha256(weights.lookup(n)) for n in selected}
