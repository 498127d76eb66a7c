"""Optimizer-state offload: AdamW whose moments live in host memory or in files, streamed per bucket.

    train.optimizer_offload = "none" | "cpu" | "nvme"     train.offload_dir (for "nvme")

Design decisions:
- The math is torch's own. Each bucket is stepped by `torch.optim.adam.adam(...)` with the
  arguments AdamW.step passes (the same foreach / fused choice, the same per-parameter step
  tensors) on the bucket's parameters. Adam is elementwise, so stepping bucket by bucket gives the
  bits of one call: parameters after a step are bit-identical with offload none, cpu and nvme.
- A bucket's moments are one flat buffer [exp_avg | exp_avg_sq] in the parameters' dtype (FSDP2's
  fp32 sharded master weights: each rank streams only its own shards). The step count stays on
  the optimizer (`state[p]["step"]`, a scalar, where AdamW keeps it).
- `bucket_bytes` is a bound, not a hint: a parameter larger than a bucket (an embedding, a fused
  MLP weight) is cut into pieces of the bucket's size, each starting a bucket of its own, so the
  device never holds more than BUFFERS x 2 x bucket_bytes of moments, whatever the model's largest
  tensor. Adam is elementwise, so a piece steps like the same elements of the whole tensor; the
  pieces are a multiple of PIECE_ALIGN elements long, so a vectorized CPU kernel's scalar tail
  falls on the same elements as in the whole tensor (bit identity on CPU as well as CUDA). Every
  piece but the parameter's last steps with a copy of the step count, so it advances once per
  step. A non-contiguous parameter (no flat view to cut) stays whole.
- Pipelined with two threads and three device buffers that rotate (allocated for the step,
  released after it): a reader brings bucket k+1
  from its store onto the device while bucket k steps and a writer takes bucket k-1 back, so the
  device holds three buckets of moments, never the whole state. A buffer is read into only once
  its previous bucket is written back (a queue of free buffers), and every wait has a deadline.
- On CUDA the copies run on side streams of their own and are ordered with the step by events;
  host buffers are pinned. On CPU "device" is host memory and the same code runs (the tests).
- Stores: "cpu" keeps one host flat per bucket; "nvme" keeps one file per bucket in a directory
  of its own under offload_dir, read and written with plain positional file I/O through pinned
  staging buffers, and tells the kernel to drop those pages (posix_fadvise DONTNEED), so the page
  cache does not quietly keep the state in memory and the disk is what is measured.
- Checkpoints (torch DCP through get_state_dict / set_state_dict): `state_dict()` materializes
  exp_avg / exp_avg_sq per parameter on the host, as DTensors over host shards for FSDP2
  parameters; "cpu" hands out views of its buffers (no copy; a cut parameter's are assembled
  from its pieces), "nvme" reads its files (the state transiently in host memory, never on the
  device). `load_state_dict` writes loaded moments into the store parameter by parameter; they
  never all land on the device.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

OFFLOADS = ("none", "cpu", "nvme")
BUFFERS = 3  # device buffers: reading k+1, stepping k, writing k-1
# Pieces of a cut parameter are a multiple of this many elements: two 512-bit vectors of bf16, so
# every CPU kernel's vector loop covers the same elements in a piece as in the whole tensor.
PIECE_ALIGN = 64


@dataclass
class _Piece:
    param: torch.Tensor
    start: int   # first element of the piece in the flattened (local) parameter
    numel: int
    offset: int  # element offset of the piece in its bucket's m half
    last: bool   # the parameter's last piece: the one that advances its step count

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.last


@dataclass
class _Bucket:
    group: int
    pieces: list[_Piece] = field(default_factory=list)
    numel: int = 0

    def add(self, p: torch.Tensor, start: int, numel: int, last: bool) -> _Piece:
        piece = _Piece(p, start, numel, self.numel, last)
        self.pieces.append(piece)
        self.numel += numel
        return piece


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class HostStore:
    """Each bucket's [m | v] in one host tensor (pinned when the device is a GPU)."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, pin: bool):
        self.flats = [torch.zeros(2 * n, dtype=dtype, pin_memory=pin) for n in sizes]

    def read(self, k: int, out: torch.Tensor) -> None:
        out[:self.flats[k].numel()].copy_(self.flats[k], non_blocking=True)

    def write(self, k: int, src: torch.Tensor) -> None:
        self.flats[k].copy_(src[:self.flats[k].numel()], non_blocking=True)

    def host(self, k: int) -> torch.Tensor:
        return self.flats[k]

    def put(self, k: int, start: int, values: torch.Tensor) -> None:
        self.flats[k][start:start + values.numel()].copy_(values.reshape(-1))

    def close(self) -> None:
        self.flats = []


class FileStore:
    """Each bucket's [m | v] in one file; I/O through a pinned staging buffer per thread."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, root: str, pin: bool):
        if not root:
            raise ValueError("train.optimizer_offload='nvme' needs train.offload_dir (a directory on "
                             "node-local NVMe); it is empty")
        Path(root).mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.dir = Path(tempfile.mkdtemp(prefix=f"adam-rank{rank}-", dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        self.sizes = [2 * n for n in sizes]
        self.fds = []
        for k, n in enumerate(self.sizes):
            fd = os.open(self.dir / f"bucket{k:05d}.bin", os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, n * self.itemsize)  # reads as zeros: fresh moments
            self.fds.append(fd)
        biggest = max(self.sizes, default=0)
        self.pin = pin
        # one staging buffer for the reader, one for the writer (each thread owns its own)
        self._staging = {name: torch.empty(biggest, dtype=dtype, pin_memory=True) if pin else None
                         for name in ("read", "write")}

    def _bytes(self, t: torch.Tensor) -> memoryview:
        return memoryview(t.view(torch.uint8).numpy()).cast("B")

    def _pread(self, k: int, out: torch.Tensor, start: int = 0) -> None:
        view, pos, got = self._bytes(out), start * self.itemsize, 0
        while got < len(view):
            n = os.preadv(self.fds[k], [view[got:]], pos + got)
            if n <= 0:
                raise OSError(f"optimizer offload: short read of {self.dir}/bucket{k:05d}.bin")
            got += n
        os.posix_fadvise(self.fds[k], pos, len(view), os.POSIX_FADV_DONTNEED)

    def _pwrite(self, k: int, src: torch.Tensor, start: int = 0) -> None:
        view, pos, done = self._bytes(src), start * self.itemsize, 0
        while done < len(view):
            done += os.pwrite(self.fds[k], view[done:], pos + done)
        os.fdatasync(self.fds[k])  # DONTNEED drops only clean pages
        os.posix_fadvise(self.fds[k], pos, len(view), os.POSIX_FADV_DONTNEED)

    def read(self, k: int, out: torch.Tensor) -> None:
        n = self.sizes[k]
        if not self.pin:
            return self._pread(k, out[:n])
        staging = self._staging["read"][:n]
        self._pread(k, staging)
        out[:n].copy_(staging, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the staging buffer is reused next read

    def write(self, k: int, src: torch.Tensor) -> None:
        n = self.sizes[k]
        if not self.pin:
            return self._pwrite(k, src[:n])
        staging = self._staging["write"][:n]
        staging.copy_(src[:n], non_blocking=True)
        torch.cuda.current_stream().synchronize()
        self._pwrite(k, staging)

    def host(self, k: int) -> torch.Tensor:
        out = torch.empty(self.sizes[k], dtype=self.dtype)
        self._pread(k, out)
        return out

    def put(self, k: int, start: int, values: torch.Tensor) -> None:
        self._pwrite(k, values.detach().to("cpu", self.dtype).contiguous().reshape(-1), start)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self._cleanup()


def _release(reader: ThreadPoolExecutor, writer: ThreadPoolExecutor, store) -> None:
    reader.shutdown()
    writer.shutdown()
    store.close()


class OffloadedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with exp_avg / exp_avg_sq offloaded ("cpu" or "nvme") and streamed
    through the device `bucket_bytes` of moments at a time (each of m and v)."""

    def __init__(self, params, *, offload: str, offload_dir: str = "", bucket_bytes: int = 256 << 20,
                 timeout_s: float = 600.0, **kwargs):
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"train.optimizer_offload={offload!r} is not one of cpu, nvme "
                             "(none uses torch.optim.AdamW)")
        if kwargs.get("amsgrad"):
            raise ValueError("OffloadedAdamW: amsgrad is not supported")
        super().__init__(params, **kwargs)
        self.offload, self.offload_dir = offload, offload_dir
        self.bucket_bytes, self.timeout_s = int(bucket_bytes), float(timeout_s)
        self._store = None
        self._buckets: list[_Bucket] = []
        self._where: dict[int, list[tuple[int, _Piece]]] = {}  # id(param) -> its (bucket, piece)s
        # device_buffer_bytes: what the last step allocated on the device for moments (its
        # rotating buffers); the moments' whole footprint there, as no step keeps any after it
        self.stats = {"read_bytes": 0, "write_bytes": 0, "device_buffer_bytes": 0}

    # ---- layout -------------------------------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self._store is not None:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {_local(p).dtype for p in params}
        devices = {_local(p).device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"train.optimizer_offload={self.offload!r}: every parameter must share "
                             f"one dtype and device, got {sorted(map(str, dtypes))} on "
                             f"{sorted(map(str, devices))}")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        limit = max(1, self.bucket_bytes // torch.empty(0, dtype=self.dtype).element_size())
        # below PIECE_ALIGN elements the budget wins over the CPU vector loops' alignment
        piece_max = limit - limit % PIECE_ALIGN or limit
        for gi, group in enumerate(self.param_groups):
            bucket = _Bucket(gi)
            for p in group["params"]:
                local = _local(p)
                n = local.numel()
                if n <= limit or not local.is_contiguous():
                    if bucket.pieces and bucket.numel + n > limit:
                        self._buckets.append(bucket)
                        bucket = _Bucket(gi)
                    self._where[id(p)] = [(len(self._buckets), bucket.add(p, 0, n, last=True))]
                    continue
                self._where[id(p)] = []
                for start in range(0, n, piece_max):
                    if bucket.pieces:
                        self._buckets.append(bucket)
                        bucket = _Bucket(gi)
                    count = min(piece_max, n - start)
                    piece = bucket.add(p, start, count, last=start + count == n)
                    self._where[id(p)].append((len(self._buckets), piece))
            if bucket.pieces:
                self._buckets.append(bucket)
        sizes = [b.numel for b in self._buckets]
        cuda = self.device.type == "cuda"
        self._store = (HostStore(sizes, self.dtype, pin=cuda) if self.offload == "cpu"
                       else FileStore(sizes, self.dtype, self.offload_dir, pin=cuda))
        self._slots: list[torch.Tensor] | None = None  # the device buffers, during a step only
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="adam-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="adam-offload-write")
        self._streams = ({"read": torch.cuda.Stream(self.device), "write": torch.cuda.Stream(self.device)}
                         if cuda else None)
        # an optimizer dropped without close() (a finished warm-start phase) still lets its
        # threads, file descriptors and files go
        self._finalizer = weakref.finalize(self, _release, self._reader, self._writer, self._store)

    def close(self) -> None:
        if self._store is not None:
            self._finalizer()
            self._store, self._slots = None, None

    # ---- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_ready()
        # Allocated per step and dropped after it: between steps (a colocated engine generating,
        # a sleep) the device holds no moments at all.
        biggest = 2 * max(b.numel for b in self._buckets)
        self._slots = [torch.empty(biggest, dtype=self.dtype, device=self.device)
                       for _ in range(BUFFERS)]
        self.stats["device_buffer_bytes"] = sum(s.numel() * s.element_size() for s in self._slots)
        free: queue.Queue[int] = queue.Queue()
        for i in range(BUFFERS):
            free.put(i)
        live = [k for k, b in enumerate(self._buckets)
                if any(piece.param.grad is not None for piece in b.pieces)]
        reads: dict[int, Future] = {}
        writes: list[Future] = []

        def start_read(k: int) -> None:
            try:
                slot = free.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"optimizer offload: no device buffer came free within "
                                   f"{self.timeout_s} s (writing a bucket back hangs)") from None
            reads[k] = self._reader.submit(self._read, k, slot)

        try:
            if live:
                start_read(live[0])
            for i, k in enumerate(live):
                slot, ready = reads.pop(k).result(timeout=self.timeout_s)
                if ready is not None:
                    torch.cuda.current_stream().wait_event(ready)
                if i + 1 < len(live):
                    start_read(live[i + 1])
                self._step_bucket(self._buckets[k], self._slots[slot])
                done = None
                if self._streams is not None:
                    done = torch.cuda.Event()
                    done.record()
                writes.append(self._writer.submit(self._write, k, slot, done, free))
        finally:
            for f in chain(reads.values(), writes):
                f.result(timeout=self.timeout_s)
            self._slots = None
        return loss

    def _read(self, k: int, slot: int):
        out = self._slots[slot]
        if self._streams is None:
            self._store.read(k, out)
            ready = None
        else:
            with torch.cuda.stream(self._streams["read"]):
                self._store.read(k, out)
                ready = torch.cuda.Event()
                ready.record()
        self.stats["read_bytes"] += 2 * self._buckets[k].numel * out.element_size()
        return slot, ready

    def _write(self, k: int, slot: int, done, free: queue.Queue) -> None:
        src = self._slots[slot]
        if self._streams is None:
            self._store.write(k, src)
        else:
            stream = self._streams["write"]
            with torch.cuda.stream(stream):
                stream.wait_event(done)
                self._store.write(k, src)
                stream.synchronize()  # the buffer may be read into once the bytes are out
        self.stats["write_bytes"] += 2 * self._buckets[k].numel * src.element_size()
        free.put(slot)

    def _step_bucket(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        group = self.param_groups[bucket.group]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for piece in bucket.pieces:
            p = piece.param
            if p.grad is None:
                continue
            local, grad = _local(p), _local(p.grad)
            off, n = piece.offset, piece.numel
            m, v = flat[off:off + n], flat[bucket.numel + off:bucket.numel + off + n]
            if piece.whole:
                params.append(local)
                grads.append(grad)
                exp_avgs.append(m.view(local.shape))
                exp_avg_sqs.append(v.view(local.shape))
            else:
                params.append(local.view(-1)[piece.start:piece.start + n])
                grads.append(grad.reshape(-1)[piece.start:piece.start + n])
                exp_avgs.append(m)
                exp_avg_sqs.append(v)
            step = self._step_tensor(p, group)
            # adam() advances every step tensor it is given: the earlier pieces step with a copy
            # of the count (not yet advanced, as the last piece is in a later bucket)
            steps.append(step if piece.last else step.clone())
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, has_complex=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
             capturable=group["capturable"], differentiable=False, fused=group["fused"],
             grad_scale=None, found_inf=None,
             decoupled_weight_decay=group.get("decoupled_weight_decay", True))

    def _step_tensor(self, p, group) -> torch.Tensor:
        state = self.state[p]
        if "step" not in state:  # where AdamW puts it (its note on host-side steps)
            fused = bool(group["fused"])
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=_local(p).device)
                             if group["capturable"] or fused else torch.tensor(0.0, dtype=_get_scalar_dtype()))
        return state["step"]

    # ---- checkpoints --------------------------------------------------------------------------

    def _moments(self, p, host):
        """p's exp_avg and exp_avg_sq on the host: views of its bucket's host flat (`host(k)`) when
        the parameter is whole, assembled from its pieces' buckets when it was cut."""
        local = _local(p)
        pieces = self._where[id(p)]
        if len(pieces) == 1:
            k, piece = pieces[0]
            flat, half, off = host(k), self._buckets[k].numel, piece.offset
            m = flat[off:off + piece.numel].view(local.shape)
            v = flat[half + off:half + off + piece.numel].view(local.shape)
        else:
            m, v = (torch.empty(local.numel(), dtype=self.dtype) for _ in range(2))
            for k, piece in pieces:
                flat, half, off, n = host(k), self._buckets[k].numel, piece.offset, piece.numel
                m[piece.start:piece.start + n].copy_(flat[off:off + n])
                v[piece.start:piece.start + n].copy_(flat[half + off:half + off + n])
            m, v = m.view(local.shape), v.view(local.shape)
        if hasattr(p, "device_mesh"):  # FSDP2: DCP needs the shard's place in the full tensor
            from torch.distributed.tensor import DTensor
            m, v = (DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()) for t in (m, v))
        return m, v

    def state_dict(self):
        self._ensure_ready()
        sd = super().state_dict()
        cached: dict[int, torch.Tensor] = {}

        def host(k: int) -> torch.Tensor:
            # parameters come in bucket order: keeping the last bucket reads each one once
            if k not in cached:
                cached.clear()
                cached[k] = self._store.host(k)
            return cached[k]

        state = {}
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            if i in sd["state"]:
                m, v = self._moments(p, host)
                state[i] = {**sd["state"][i], "exp_avg": m, "exp_avg_sq": v}
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict) -> None:
        self._ensure_ready()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("OffloadedAdamW.load_state_dict: the saved param groups do not match "
                             "this optimizer's")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_ids = [i for g in groups for i in g["params"]]
        for i, p in zip(saved_ids, (p for g in self.param_groups for p in g["params"])):
            st = state_dict["state"].get(i)
            pieces = self._where[id(p)]
            if not st:
                self.state.pop(p, None)
                m = v = torch.zeros(_local(p).numel(), dtype=self.dtype)
            else:
                group = self.param_groups[self._buckets[pieces[0][0]].group]
                step = st["step"]
                self.state[p] = {"step": step.to(dtype=torch.float32, device=_local(p).device)
                                 if group["capturable"] or group["fused"] else step.detach().clone().cpu()}
                m, v = (_local(st[key]).detach().cpu().reshape(-1) for key in ("exp_avg", "exp_avg_sq"))
            for k, piece in pieces:
                half, span = self._buckets[k].numel, slice(piece.start, piece.start + piece.numel)
                self._store.put(k, piece.offset, m[span])
                self._store.put(k, half + piece.offset, v[span])
