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
  one). `encode_tensor_payload` in miles/engines/client.py builds it. With `load_format:
  "miles_cuda_ipc"` it is instead the JSON description of one CUDA IPC handle of a flat bucket
  (miles/weights/cuda_ipc.py: the fields of torch's reduce_tensor, no pickle), for a trainer on
  the same GPU. With load_format "miles_cuda_ipc_direct" the trainer has written straight into
  this engine's own weights, shared once through `GET /ipc_weight_targets` (`ipc_targets`), while
  the engine was paused; the call only checks the engine instance's token, flushes the prefix
  cache and sets the version.
- The distributed group is built exactly like SGLang's `init_custom_process_group` (a tcp://
  rendezvous, a `PrefixStore(group_name, store)`, `_new_process_group_helper`), so the trainer side
  can be the same helper on either engine: trainer rank 0 is the group's rank 0 and the store
  master; the engine joins as `rank_offset` (+ its TP rank, always 0 here). Then the trainer
  broadcasts each listed tensor from rank 0, in order.
- `load_format: "flattened_bucket"` (SGLang's name and layout: one broadcast of all the listed
  tensors back to back, one dtype) receives into one flat buffer and copies out on the device.
  It is pipelined: the call posts its receive, completes the *previous* flat bucket, and answers;
  so the trainer's next call and this bucket's copy overlap the transfer. Anything else that
  touches the weights or the version first completes the pending bucket (`complete_pending`).
- `load_format: "miles_direct"` (Miles only; the trainer's `weights.direct_min_bytes`): the first
  `flat_count` tensors come as one flat broadcast as above, then every other tensor as its own
  broadcast, all posted as one NCCL group (`broadcast_all`, the trainer's own function). Each of
  those is received straight into the parameter's storage (every checkpoint name is a contiguous
  view, fused q/k/v and gate/up rows included), so the engine copies only the small ones. One
  that cannot be (another dtype or device) lands in a scratch tensor copied in like a flat one.
  The engine is paused for the update, as for every distributed update; a bucket with a bad name
  or shape is still drained, into scratch only, then refused.
- At --tp-size > 1 a disk update checks names and shapes against the *full* model
  (`Weights.full_shape`) and each rank copies in its own slice (`Weights.copy_in`); the other
  update paths are one-rank only (the server refuses them at tp > 1).
- Checksums are the trainer's own functions (miles/weights/checks.py: sha256 of each tensor's raw
  bytes, or the device digest), in the engine's dtype, keyed by checkpoint name, so both sides
  can never compute them differently.
"""

from __future__ import annotations

import base64
import math
import threading
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch

from miles.engines.embedded_engine.params import IGNORED_CHECKPOINT_SUFFIXES, Weights
from miles.engines.embedded_engine.shapes import load_hf_config, shape_from_config
from miles.weights.buckets import wait_stream
from miles.weights.checks import CHECKSUMS
from miles.weights.cuda_ipc import DIRECT_FORMAT
from miles.weights.process_group import broadcast_all


def parse_dtype(name: str) -> torch.dtype:
    bare = name.removeprefix("torch.")
    dt = getattr(torch, bare, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name (e.g. 'bfloat16')")
    return dt


def check_names_shapes(weights: Weights, items: list[tuple[str, tuple[int, ...]]]) -> None:
    for name, shape in items:
        if weights.quant is not None and weights.quant.check_shape(name, tuple(shape)):
            continue  # a quantized part (quantized.py)
        expected = weights.full_shape(name)  # KeyError names the weight; the full model's shape
        if tuple(expected) != tuple(shape):
            raise ValueError(f"weight {name!r}: shape {list(shape)} != the engine's {list(expected)}")


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
    sync_device(weights)
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
    sync_device(weights)


CUDA_IPC_FORMAT = "miles_cuda_ipc"
CUDA_IPC_DIRECT = DIRECT_FORMAT   # the trainer wrote into this engine's IpcTargets


def apply_cuda_ipc_bucket(weights: Weights, payload: str) -> None:
    """`/update_weights_from_tensor` with load_format "miles_cuda_ipc": one flat bucket shared by a
    colocated trainer through a CUDA IPC handle (fields as JSON, never pickle;
    miles/weights/cuda_ipc.py). Copied device to device, then the mapping is dropped."""
    from miles.weights import cuda_ipc
    if weights.device.type != "cuda":
        raise ValueError(f"load_format: {CUDA_IPC_FORMAT!r} needs an engine on CUDA (CUDA IPC shares "
                         f"GPU memory); this engine runs on {weights.device.type}")
    bucket = cuda_ipc.decode_bucket(payload)
    check_names_shapes(weights, [(n, tuple(s)) for n, s in zip(bucket.names, bucket.shapes)])
    flat = cuda_ipc.open_tensor(bucket.flat)
    numel = sum(math.prod(s) for s in bucket.shapes)
    if flat.dim() != 1 or flat.numel() != numel:
        raise ValueError(f"serialized_named_tensors[0]: the shared tensor has shape {list(flat.shape)}, "
                         f"the shapes add up to {numel} elements")
    offset = 0
    with torch.no_grad():
        for name, shape in zip(bucket.names, bucket.shapes):
            n = math.prod(shape)
            weights.copy_in(name, flat[offset:offset + n].view(shape))
            offset += n
    sync_device(weights)
    del flat  # releases the producer's ref counter, so the trainer may free the bucket


def ipc_targets(weights: Weights) -> tuple[object, list[torch.Tensor]]:
    """The engine's weight storages and views shared through CUDA IPC (cuda_ipc.IpcTargets), for a
    colocated trainer to write into; and the flat tensors the sharing needs kept alive. Names held
    in FP8 or quantized, and non-contiguous views, are left out: they go by flat buckets."""
    import uuid
    from miles.weights import cuda_ipc
    if weights.device.type != "cuda":
        raise ValueError(f"CUDA IPC targets need an engine on CUDA; this engine runs on "
                         f"{weights.device.type}")
    index: dict[int, int] = {}
    keep: list[torch.Tensor] = []
    storages, views = [], []
    named = {} if weights.quant is not None else {**weights.names, **weights.aliases}
    for name, t in named.items():
        if name in weights.fp8 or t.device.type != "cuda" or not t.is_contiguous():
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in index:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),))
            index[st.data_ptr()] = len(storages)
            storages.append(cuda_ipc.share(flat))
            keep.append(flat)
        views.append(cuda_ipc.IpcView(name, index[st.data_ptr()], t.storage_offset() * t.element_size(),
                                      list(t.shape), str(t.dtype).removeprefix("torch.")))
    return cuda_ipc.IpcTargets(uuid.uuid4().hex, storages, views), keep


def check_direct_write(targets, payload: str) -> None:
    """A miles_cuda_ipc_direct update: the trainer is writing into the views of `targets` while
    the engine is paused. Checks that they are this engine instance's (its token)."""
    from miles.weights import cuda_ipc
    try:
        w = msgspec.json.decode(payload, type=cuda_ipc.DirectWrite)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"serialized_named_tensors[0]: not a {cuda_ipc.DIRECT_FORMAT} write: {e}") from None
    if targets is None or w.token != targets.token:
        raise ValueError(f"serialized_named_tensors[0]: token {w.token!r} is not this engine's CUDA "
                         "IPC targets token (the engine restarted or never shared its weights): the "
                         "trainer must fetch /ipc_weight_targets again")


def sync_device(weights: Weights) -> None:
    if weights.device.type == "cuda":
        torch.cuda.synchronize(weights.device)


# ---- torch.distributed group (SGLang's init_custom_process_group) ----------------------------

def _release_group(held: list) -> None:
    """Release a group handed over in `held` ([pg, pending bucket or None]); the last references
    die here, on this thread: a gloo group's destructor joins its worker threads, which wait out
    a receive whose sender is gone (up to the group's timeout)."""
    import torch.distributed as dist
    pg = held[0]
    try:
        if dist.get_backend(pg) == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group(pg)
        else:
            dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - best effort: the peer may be gone already
        pass
    del pg
    held.clear()


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


DIRECT_FORMAT = "miles_direct"


class _PendingBucket:
    """A bucket whose receives are posted but not yet complete: `items` are in `flat` and are
    copied in at completion, as are the `scratch` tensors; the rest went straight into the weights."""

    def __init__(self, work, flat: torch.Tensor | None, items: list[tuple[str, list[int]]],
                 scratch: list[tuple[str, torch.Tensor]]):
        self.work, self.flat, self.items, self.scratch = work, flat, items, scratch


class UpdateGroups:
    def __init__(self, device: torch.device):
        self.device = device
        self.groups: dict[str, object] = {}
        self.pending: dict[str, _PendingBucket] = {}
        # Two receive buffers per (group, dtype, device), used in turn: at most two flat buckets
        # are alive at once (the one arriving, the one being copied in), and a fresh 1 GiB
        # allocation per bucket is avoided. A reused buffer is safe without a host sync: NCCL's
        # stream waits for the compute stream (which holds the copy-out of that buffer's previous
        # bucket) before it writes into it.
        self._buffers: dict[tuple, list[torch.Tensor | None]] = {}
        self._turn: dict[tuple, int] = {}
        self.timing: dict[str, float] = {}  # seconds per phase since the last take_timing()
        self.posted_at: list[float] = []    # perf_counter() of each receive posted since then

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"group_name: {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend: 'nccl' needs an engine on CUDA; this engine runs on CPU, "
                             "use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset: {rank_offset} must be in [1, world_size={world_size})")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per-thread; NCCL binds the group to it
        host = f"[{master_address}]" if ":" in master_address else master_address
        self.groups[group_name] = init_custom_process_group(
            backend, f"tcp://{host}:{master_port}", world_size, rank_offset, group_name)

    def destroy(self, group_name: str) -> None:
        """Forget the group at once; its communicator is released on a daemon thread.

        Destroying an NCCL communicator can block (seen: over a minute, the peer still holding
        its end), and this runs on the server's event loop: the name is free again immediately,
        and an NCCL group is aborted rather than destroyed (nothing is in flight on it by now).
        A gloo group's destructor joins its worker threads, which may wait out a receive whose
        sender died (seen: the event loop blocked 75 s+ where the group's last reference was
        dropped here), so that happens on the releasing thread too."""
        if group_name not in self.groups:
            raise ValueError(f"group_name: {group_name!r} is not an open weight update group")
        # No reference stays on this thread: the group (and a pending bucket's work, never waited
        # for: its sender may be gone) goes to the releasing thread, whose exit drops the last one.
        held = [self.groups.pop(group_name), self.pending.pop(group_name, None)]
        for key in [k for k in self._buffers if k[0] == group_name]:
            self._buffers.pop(key)
            self._turn.pop(key, None)
        threading.Thread(target=_release_group, args=(held,), name=f"release-{group_name}",
                         daemon=True).start()
        del held

    def _recv_buffer(self, group_name: str, dtype: torch.dtype, device: torch.device,
                     numel: int) -> torch.Tensor:
        key = (group_name, dtype, device)
        pair = self._buffers.setdefault(key, [None, None])
        turn = self._turn.get(key, 0)
        self._turn[key] = turn ^ 1
        buf = pair[turn]
        if buf is None or buf.numel() < numel:
            pair[turn] = None  # free the old one first
            buf = pair[turn] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def _tick(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.timing[phase] = self.timing.get(phase, 0.0) + (now - t0)
        return now

    def take_timing(self) -> dict:
        out, self.timing = self.timing, {}
        if self.posted_at:
            out["posted_ms"] = [round(1e3 * (t - self.posted_at[0]), 1) for t in self.posted_at]
            self.posted_at = []
        return out

    def receive(self, weights: Weights, group_name: str, names: list[str], dtypes: list[str],
                shapes: list[list[int]], load_format: str | None = None,
                flat_count: int | None = None) -> None:
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
        if load_format == "flattened_bucket":
            return self._receive_flat(weights, pg, group_name, names, dtypes, shapes, recv_device,
                                      len(names))
        if load_format == DIRECT_FORMAT:
            if flat_count is None or not 0 <= flat_count <= len(names):
                raise ValueError(f"flat_count: {flat_count!r} must be in [0, {len(names)}] (the number "
                                 f"of names) for load_format {DIRECT_FORMAT!r}")
            return self._receive_flat(weights, pg, group_name, names, dtypes, shapes, recv_device,
                                      flat_count)
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format: {load_format!r} is not supported for distributed updates "
                             f"(None, 'flattened_bucket' or {DIRECT_FORMAT!r})")
        self.complete_pending(weights)
        received = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=parse_dtype(dt), device=recv_device)
            dist.broadcast(t, src=0, group=pg)
            received.append((name, t))
        apply_named_tensors(weights, received)


    def _receive_flat(self, weights: Weights, pg, group_name: str, names: list[str],
                      dtypes: list[str], shapes: list[list[int]], recv_device: torch.device,
                      flat_count: int) -> None:
        kinds = {parse_dtype(d) for d in dtypes}
        if len(kinds) != 1:
            # The sender's flat tensor has no defined layout then; nothing sensible to receive.
            raise ValueError(f"dtypes: a flattened bucket holds one dtype, got {sorted(set(dtypes))}")
        dtype = kinds.pop()
        t = time.perf_counter()
        try:
            check_names_shapes(weights, [(n, tuple(s)) for n, s in zip(names, shapes)])
            bad = None
        except (KeyError, ValueError) as e:
            bad = e
        wire: list[torch.Tensor] = []
        flat = None
        if flat_count:
            flat = self._recv_buffer(group_name, dtype, recv_device,
                                     sum(math.prod(s) for s in shapes[:flat_count]))
            wire.append(flat)
        scratch = []
        for name, shape in zip(names[flat_count:], shapes[flat_count:]):
            dst = weights.lookup(name) if bad is None and not (
                weights.quant is not None and weights.quant.owns(name)) else None
            if dst is not None and dst.dtype == dtype and dst.device == recv_device \
                    and dst.is_contiguous():
                wire.append(dst.view(-1))  # straight into the parameter
            else:
                tmp = torch.empty(math.prod(shape), dtype=dtype, device=recv_device)
                wire.append(tmp)
                scratch.append((name, tmp.view(shape)))
        t = self._tick("alloc_check_s", t)
        work = broadcast_all(wire, pg)
        t = self._tick("post_s", t)
        self.timing["buckets"] = self.timing.get("buckets", 0) + 1
        self.posted_at.append(t)
        previous = self.pending.pop(group_name, None)
        if bad is None:
            self.pending[group_name] = _PendingBucket(
                work, flat, list(zip(names[:flat_count], shapes[:flat_count])), scratch)
        if previous is not None:
            self._apply_flat(weights, previous)
        if bad is not None:
            work.wait()  # drained, so both sides stay in step; then refused
            if recv_device.type == "cuda":
                torch.cuda.current_stream(recv_device).synchronize()
            raise bad

    def complete_pending(self, weights: Weights) -> None:
        """Copy in every posted flat bucket (before anything else reads or writes the weights),
        and return once the copies are done on the device."""
        for name in list(self.pending):
            self._apply_flat(weights, self.pending.pop(name))
        if weights.device.type == "cuda":
            t = time.perf_counter()
            wait_stream(torch.cuda.current_stream(weights.device))
            self._tick("final_wait_s", t)

    def _apply_flat(self, weights: Weights, p: _PendingBucket) -> None:
        t = time.perf_counter()
        p.work.wait()  # CPU: blocks until received; NCCL: the current stream waits for it
        offset = 0
        with torch.no_grad():
            # One copy kernel per tensor: measured on an H200, 15.2 GB in 7.8 ms, where one
            # _foreach_copy_ over the same tensors took 11-35 ms.
            for name, shape in p.items:
                n = math.prod(shape)
                weights.copy_in(name, p.flat[offset:offset + n].view(shape))
                offset += n
            for name, received in p.scratch:
                weights.copy_in(name, received)
        self._tick("copy_enqueue_s", t)
        # No host sync here: the copies are ordered on the compute stream (generation runs there
        # too). A host sync per bucket kept the next receive from being posted until this bucket
        # had arrived and been copied, and for however long the sync took to return.


# ---- checksums ------------------------------------------------------------------------------

def checksums(weights: Weights, names: list[str] | None = None,
              algorithm: str = "sha256") -> dict[str, str]:
    selected = names if names else list(weights.names)
    digest = CHECKSUMS[algorithm]
    return {n: digest(weights.lookup(n)) for n in selected}
