"""`POST /update_weights_from_delta`: disk-delta weight updates (a Miles extension, not SGLang).

    {"phase": "prepare", "path": DIR, "weight_version": "5", "threads": 4}
                                                               decode + verify while serving
    {"phase": "apply", "weight_version": "5"}                  swap the prepared weights in
    {"phase": "discard"}                                       drop what was prepared
    {"phase": "rollback", "weight_version": "5"}              undo apply of v5: back to v4

A prepare with `"keep_previous": true` also keeps the bytes each changed weight has now (the
version being replaced) on the host; after `apply` they stay for one version (until the next
prepare), so `rollback` can put the previous version back if the fleet's commit failed elsewhere
(miles/weights/disk_delta.py: all engines switch, or all stay on v-1).

Answers `{"success", "message", ...}` like SGLang's update endpoints; 400 with the reason when a
phase is refused. The delta format is miles/weights/delta_format.py. `apply` answers `swapped`,
`copied` and `scattered` (how many weights each way), `swap_s` (how long it held the
scheduler's step lock: what generation waited) and `in_flight_requests` (requests that crossed
the update).

Design decisions:
- Generation never stops for a delta. `prepare` reads the manifest, decompresses each tensor,
  XORs it with the engine's current bytes and checks the new tensor's sha256, all on worker
  threads (`threads` tensors at a time: zlib, hashlib and numpy release the GIL) while the
  scheduler keeps generating; the decoded tensors are staged in the manifest's order, at most
  2 x `threads` of them waiting in host memory ahead of the staging. `apply` needs no pause
  either: it takes the scheduler's step lock, so the swap lands between two steps (as a pause would, minus the round
  trips); running and queued requests keep their KV (computed by the old weights, as with
  SGLang's in_place pause) and their next token is the new weights', recorded under the new
  version in their `weight_versions` spans: the version is set under the same lock, with the
  swap, so no token is ever attributed to the wrong weights. The publisher sends no pause for
  this transport (miles/weights/publisher.py).
- Double-buffered weights: the staged tensors are a second copy of the changed weights. At
  `apply` a staged tensor simply becomes the live weight where it can (`Weights.swap_in`: a
  whole tensor of its own, same shape, dtype and device; the old one is freed), so the swap
  costs a pointer per weight and no bytes move. The rest are copied in (one copy per weight):
  slices of fused tensors (q/k/v, gate/up, experts), weights held in FP8 or quantized, tensors
  staged on the host for a GPU engine, and everything once a CUDA graph has captured the
  weights' addresses (the embedded engine captures decode graphs on CUDA unless
  --disable-cuda-graph; a replay would read the freed tensor) or a colocated trainer has the
  weights' storages by CUDA IPC (`/ipc_weight_targets`; it would write into the old ones).
  `apply` says how many went each way and logs it.
- Staged on the device when it can hold them (`_staging_plan`): on CUDA, when free memory
  exceeds the delta's bytes by `DEVICE_HEADROOM_BYTES`, `prepare` also moves each verified
  tensor to the GPU (on its own stream, while generation runs), so `apply` swaps pointers or
  copies device to device at HBM speed instead of host to device over PCIe (~50x shorter).
  When the whole tensors do not fit (an engine whose KV pool took the memory, or a colocated
  trainer), only the changed elements are staged there: an index and a new value each (a step
  of RL at lr 1e-6 changes ~2% of a bf16 7B's elements: 0.8 GB against 15 GB), and `apply`
  scatters them into the live weights in place (`Weights.scatter_in`; addresses unchanged, so
  CUDA graphs and IPC writers are unaffected). Only when neither fits do the whole tensors
  wait in host memory and `apply` copies them over PCIe (seconds for a 7B: on an H100 that was
  a 2.5 s stall). `--delta-staging dense|sparse` forces one form (sparse: a CPU engine too).
  `prepare`'s answer says where (`staged_on`), how many tensors wait as changes
  (`sparse_tensors`) and the bytes staged.
- Nothing is changed until every tensor of the delta has been verified: a corrupted, truncated or
  mismatched delta is refused in `prepare` and the engine keeps serving the version it has.
- A delta names its base version; `prepare` refuses one whose base is not the version this
  engine serves (and each XOR entry also checks the base bytes' sha256). `apply` refuses if any
  other update changed the weights after `prepare` (the server's `weights_serial`).
- Staging costs one copy of the changed tensors (device or host) for as long as the delta is
  prepared; after `apply` the swapped ones are the weights and only the copied ones' staging
  is freed.
- Rollback (`keep_previous`): the previous bytes are the ones an XOR entry reads anyway; they are
  copied on the decode threads during `prepare` (off the step lock; the live tensor may be
  overwritten in place by `apply`), so `apply`'s stall does not change. `rollback` copies them
  back under the step lock and sets the previous version with them; it is refused once any other
  update changed the weights after that `apply`. Host memory: one more copy of the changed
  tensors, for one version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import torch

from miles.engines.embedded_engine.protocol import BadRequest, decode_body
from miles.weights.delta_format import DeltaError, decode_entry, read_manifest

log = logging.getLogger(__name__)

DEVICE_HEADROOM_BYTES = 2 << 30  # left free for the KV cache's growth and activations
MAX_THREADS = 64
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class DeltaReq(msgspec.Struct):
    phase: Literal["prepare", "apply", "discard", "rollback"]
    path: str = ""
    weight_version: str | None = None
    threads: int = 4  # decode threads (the trainer sends weights.delta_threads)
    keep_previous: bool = False   # prepare: keep the replaced bytes for a rollback after apply


@dataclass
class _Staged:
    version: int
    path: str
    serial: int
    tensors: list[tuple[str, torch.Tensor, torch.Tensor | None]]  # name, tensor or values, index
    previous: list[tuple[str, torch.Tensor]] | None = None  # keep_previous: the replaced bytes
    previous_version: str = ""


@dataclass
class _Previous:
    """What `rollback` restores: the version before the last apply, its bytes, and the weights
    serial right after that apply (any later update makes the rollback refuse)."""
    version: str
    applied: str
    serial: int
    tensors: list[tuple[str, torch.Tensor]]


def _sparse_bytes(manifest) -> int | None:
    """Bytes of the delta staged sparse (int32 or int64 index + new value per changed element),
    or None when some entry cannot be (a raw entry, or no change count: an older trainer)."""
    total = 0
    for e in manifest.entries:
        if e.kind != "xor" or e.changed is None:
            return None
        numel, item = 1, _ITEMSIZE.get(e.dtype, 4)
        for d in e.shape:
            numel *= d
        total += e.changed * ((4 if numel < 2**31 else 8) + item)
    return total



def _staging_plan(device: torch.device, manifest, mode: str = "auto") -> tuple[torch.device, bool]:
    """(where prepared tensors wait, whether they wait as sparse changes). auto: the whole new
    tensors on the engine's GPU when it has room for them plus DEVICE_HEADROOM_BYTES, else only
    the changed elements there (index + value) when those fit, else the whole tensors on the
    host; a CPU engine keeps whole tensors on the host. dense: never sparse. sparse: the changed
    elements wherever the delta allows (every entry an XOR with a change count), on the engine's
    device (a CPU engine: its host memory)."""
    sparse = _sparse_bytes(manifest) if mode != "dense" else None
    if device.type != "cuda":
        return torch.device("cpu"), mode == "sparse" and sparse is not None
    free, _ = torch.cuda.mem_get_info(device)
    if mode == "sparse" and sparse is not None and free > sparse + DEVICE_HEADROOM_BYTES:
        return device, True
    if free > manifest.full_bytes + DEVICE_HEADROOM_BYTES:
        return device, False
    if sparse is not None and free > sparse + DEVICE_HEADROOM_BYTES:
        return device, True
    return torch.device("cpu"), False


def _staging_device(device: torch.device, manifest) -> torch.device:
    """Where whole prepared tensors wait (`_staging_plan` with sparse staging off)."""
    return _staging_plan(device, manifest, "dense")[0]


def _changes(new: np.ndarray, current: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, new values as signed ints of the item size) of the elements that differ."""
    as_int = {2: np.int16, 4: np.int32}[itemsize]
    a, b = new.view(as_int), current.view(as_int)
    idx = np.flatnonzero(a != b)
    return idx.astype(np.int32 if a.size < 2**31 else np.int64), a[idx]


def _json(data, status: int = 200):
    from aiohttp import web
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _fail(message: str):
    return _json({"success": False, "message": message}, 400)


class DeltaUpdates:
    def __init__(self, server):
        self.server = server
        self.staged: _Staged | None = None
        self.previous: _Previous | None = None
        self._preparing = asyncio.Lock()

    async def handle(self, request):
        b = decode_body(await request.read(), DeltaReq, "update_weights_from_delta")
        if b.phase == "prepare":
            return await self.prepare(b)
        if b.phase == "apply":
            return await self.apply(b)
        if b.phase == "rollback":
            return await self.rollback(b)
        self.staged = None
        return _json({"success": True, "message": "Discarded the prepared delta."})

    async def prepare(self, b: DeltaReq):
        if not b.path:
            raise BadRequest("path: required for phase 'prepare'", "path")
        if not 1 <= b.threads <= MAX_THREADS:
            raise BadRequest(f"threads: {b.threads} is not in [1, {MAX_THREADS}]", "threads")
        srv = self.server
        async with self._preparing:
            self.staged = None
            self.previous = None    # v-1 is kept for one version only
            serial, current = srv.weights_serial, srv.scheduler.weight_version
            t0 = time.perf_counter()
            try:
                version, tensors, staging, sparse, nbytes, previous = await asyncio.to_thread(
                    self._decode, b.path, current, b.threads, b.keep_previous)
            except (DeltaError, KeyError, ValueError, OSError) as e:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                log.warning("delta %s refused: %s", b.path, msg)
                return _fail(f"Failed to prepare the delta: {msg}")
            if b.weight_version is not None and b.weight_version != str(version):
                return _fail(f"weight_version: {b.weight_version!r} but the delta at {b.path!r} is "
                             f"version {version}")
            if srv.weights_serial != serial:
                return _fail("Failed to prepare the delta: the weights changed while it was being "
                             "prepared (another update ran); prepare again")
            self.staged = _Staged(version, b.path, serial, tensors, previous, current)
            scattered = sum(idx is not None for _, _, idx in tensors)
            log.info("delta v%s prepared: %d tensors in %.2f s, staged on %s (%s, %.1f MiB)", version,
                     len(tensors), time.perf_counter() - t0, staging,
                     f"sparse: {scattered} as changed elements" if sparse else "whole tensors",
                     nbytes / 2**20)
        return _json({"success": True, "prepared_version": str(version), "num_tensors": len(tensors),
                      "staged_on": str(staging), "sparse_tensors": scattered, "staged_bytes": nbytes,
                      "message": f"Prepared delta v{version} ({len(tensors)} tensors) in "
                                 f"{time.perf_counter() - t0:.2f} s"})

    def _decode(self, path: str, current_version: str, threads: int, keep_previous: bool = False):
        weights = self.server.runner.model.weights
        manifest = read_manifest(path)
        if manifest.base_version is not None and str(manifest.base_version) != current_version:
            raise DeltaError(f"delta {path!r} (v{manifest.version}) applies to version "
                             f"{manifest.base_version}; this engine serves version {current_version!r}")
        engine_dtype = str(weights.dtype).removeprefix("torch.")
        targets = []
        for entry in manifest.entries:  # every name and shape checked before any decoding
            dst = weights.lookup(entry.name)  # KeyError names the weight
            if list(dst.shape) != list(entry.shape) or entry.dtype != engine_dtype:
                raise DeltaError(f"delta {path!r} tensor {entry.name!r}: {entry.dtype} {entry.shape}, "
                                 f"this engine holds {engine_dtype} {list(dst.shape)}")
            targets.append((entry, dst))
        staging, sparse = _staging_plan(weights.device, manifest,
                                        getattr(self.server.args, "delta_staging", "auto"))
        stream = torch.cuda.Stream(weights.device) if staging.type == "cuda" else None

        def one(entry, dst):
            current = old = None
            if entry.kind == "xor" or keep_previous:
                current = dst.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            if keep_previous:  # a copy: on a CPU engine `current` is the live memory itself
                old = torch.from_numpy(current.copy()).view(dst.dtype).reshape(dst.shape)
            if entry.kind != "xor":
                current = None
            new = decode_entry(path, manifest, entry, current)  # verified against its sha256
            if old is not None:
                previous.append((entry.name, old))
            if sparse and weights.scatter_target(entry.name) is not None:
                idx, vals = _changes(new, current, dst.element_size())
                return torch.from_numpy(vals).view(dst.dtype), torch.from_numpy(idx)
            return torch.from_numpy(new).view(dst.dtype).reshape(dst.shape), None

        out, nbytes, previous = [], 0, []
        window = 2 * threads
        with ThreadPoolExecutor(threads, thread_name_prefix="delta-decode") as pool:
            pending = [pool.submit(one, *t) for t in targets[:window]]
            try:
                for k, (entry, _) in enumerate(targets):
                    tensor, idx = pending[k].result()
                    pending[k] = None  # the host copy goes once it is staged
                    if k + window < len(targets):
                        pending.append(pool.submit(one, *targets[k + window]))
                    # whole tensors of an entry that cannot be scattered wait on the host
                    where = staging if idx is not None or not sparse else torch.device("cpu")
                    if stream is not None and where.type == "cuda":
                        with torch.cuda.stream(stream):
                            tensor = tensor.pin_memory().to(where, non_blocking=True)
                            if idx is not None:
                                idx = idx.pin_memory().to(where, non_blocking=True)
                    nbytes += tensor.nbytes + (0 if idx is None else idx.nbytes)
                    out.append((entry.name, tensor, idx))
            finally:
                for f in pending:
                    if f is not None:
                        f.cancel()
        if stream is not None:
            stream.synchronize()  # staged and complete before apply's copies read them
        return manifest.version, out, staging, sparse, nbytes, (previous if keep_previous else None)

    async def apply(self, b: DeltaReq):
        srv, staged = self.server, self.staged
        if staged is None:
            return _fail("Failed to apply the delta: nothing is prepared (phase 'prepare' first)")
        if b.weight_version is not None and b.weight_version != str(staged.version):
            return _fail(f"weight_version: {b.weight_version!r} but the prepared delta is version "
                         f"{staged.version}")
        sch = srv.scheduler
        weights = srv.runner.model.weights
        graphs = srv.runner.graphs
        # a captured decode graph replays the old addresses; a colocated trainer writes into them
        allow_swap = (graphs is None or graphs.captured == 0) and srv._ipc_targets is None
        async with sch.step_lock:
            t0 = time.perf_counter()
            await sch.run_compute(srv.groups.complete_pending, weights)
            if srv.weights_serial != staged.serial:
                self.staged = None
                return _fail("Failed to apply the delta: the weights changed since it was prepared "
                             "(another update ran); prepare again")

            def swap():
                if weights.device.type == "cuda":
                    # every step that read the old weights is done before they can be freed
                    torch.cuda.synchronize(weights.device)
                with torch.no_grad():
                    swapped = weights.swap_in([(n, t) for n, t, idx in staged.tensors if idx is None],
                                              allow_swap=allow_swap)
                    for name, vals, idx in staged.tensors:
                        if idx is not None:
                            weights.scatter_in(name, idx, vals)
                if weights.device.type == "cuda":
                    torch.cuda.synchronize(weights.device)
                return swapped

            try:
                swapped = await sch.run_compute(swap)
            finally:
                sch.flush_prefix_cache()  # cached KV was computed with the old weights
            srv.weights_serial += 1
            sch.weight_version = b.weight_version or str(staged.version)
            self.staged = None
            if staged.previous is not None:
                self.previous = _Previous(staged.previous_version, sch.weight_version,
                                          srv.weights_serial, staged.previous)
            in_flight = len(sch.running) + len(sch.waiting)
            swap_s = time.perf_counter() - t0
        n, n_swapped = len(staged.tensors), len(swapped)
        n_scattered = sum(idx is not None for _, _, idx in staged.tensors)
        n_copied = n - n_swapped - n_scattered
        log.info("delta v%s applied in %.1f ms between two steps: %d tensors swapped in, %d copied, "
                 "%d scattered; %d requests in flight continue on it", staged.version, 1e3 * swap_s,
                 n_swapped, n_copied, n_scattered, in_flight)
        return _json({"success": True, "swapped": n_swapped, "copied": n_copied,
                      "scattered": n_scattered, "swap_s": swap_s, "in_flight_requests": in_flight,
                      "message": f"Applied delta v{staged.version}: {n_swapped} tensors swapped in, "
                                 f"{n_copied} copied, {n_scattered} scattered, in "
                                 f"{1e3 * swap_s:.1f} ms."})

    async def rollback(self, b: DeltaReq):
        """Put back the version the last `apply` replaced (kept by a `keep_previous` prepare)."""
        srv, prev = self.server, self.previous
        if prev is None:
            return _fail("Failed to roll back: nothing is kept (prepare with keep_previous, then "
                         "apply, first; a later prepare drops it)")
        if b.weight_version is not None and b.weight_version != prev.applied:
            return _fail(f"weight_version: {b.weight_version!r} but the last apply was version "
                         f"{prev.applied}")
        sch, weights = srv.scheduler, srv.runner.model.weights
        async with sch.step_lock:
            t0 = time.perf_counter()
            if srv.weights_serial != prev.serial:
                self.previous = None
                return _fail("Failed to roll back: the weights changed since the apply (another "
                             "update ran)")

            def restore():
                with torch.no_grad():
                    for name, old in prev.tensors:
                        weights.copy_in(name, old)
                if weights.device.type == "cuda":
                    torch.cuda.synchronize(weights.device)

            try:
                await sch.run_compute(restore)
            finally:
                sch.flush_prefix_cache()
            srv.weights_serial += 1
            sch.weight_version = prev.version
            self.previous = None
            took = time.perf_counter() - t0
        log.warning("delta v%s rolled back to version %s in %.1f ms (%d tensors)", prev.applied,
                    prev.version, 1e3 * took, len(prev.tensors))
        return _json({"success": True, "weight_version": prev.version, "restored": len(prev.tensors),
                      "rollback_s": took,
                      "message": f"Rolled back v{prev.applied} to v{prev.version}."})
