"""Flat buckets and the send pipeline shared by the nccl and colocated transports.

Design decisions:
- The backend yields buckets of its own size; the transport re-buckets to `bucket_bytes`
  (coalescing small ones), so the recipe's `weights.bucket_bytes` decides what goes on the wire.
- A bucket travels as ONE flat tensor of one dtype: the tensors concatenated in name order,
  element-contiguous, exactly SGLang's `FlattenedTensorBucket` layout (`load_format:
  "flattened_bucket"`), so an engine receives it with one broadcast into one buffer and the
  per-tensor work is a device copy, never a network round trip. A dtype change closes a bucket.
- The gather (the caller's thread, collective across trainer ranks) runs ahead of the wire: it
  hands finished buckets to a sender thread through a queue of `queue_depth` buckets, so the next
  bucket is gathered and flattened while the current one is broadcast. Memory on the trainer is
  bounded by about (queue_depth + inflight + 1) buckets.
- On CUDA each bucket records an event once flattened; the sender's stream waits for that event,
  not for everything queued on the default stream, so a later gather never delays a broadcast.
- The sender's first failure is kept and raised from the caller's next `put` or from `drain`:
  the caller stops gathering instead of feeding a dead link.
- Direct tensors (`direct_min_bytes`, embedded engines only): tensors at least that large skip
  the flatten and go on the wire as themselves, each its own broadcast after the bucket's flat
  part (which packs the small ones, so a norm vector is never a broadcast of its own). The
  bucket's names are reordered to match: packed ones first, then the direct ones. The engine
  receives each direct tensor straight into its parameter storage, so neither side copies it.
- Flat buffers come from a `BufferPool` kept by the transport across versions: a bucket is
  concatenated into a buffer whose broadcast has completed (`release()` after the sender saw it
  finish), so no publish asks the allocator for fresh GiB-sized blocks. The pool holds at most as
  many buffers as were ever in flight at once (queue_depth + inflight + 1).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def wait_stream(stream, poll_s: float = 1e-4) -> None:
    """Wait for everything queued on a CUDA `stream` by polling an event (100 us), so the wait
    never depends on how fast a blocking `synchronize()` wakes its thread: a 1 GiB bucket takes
    under 3 ms on NVLink, and on virtualized hosts that wake-up is not guaranteed to be small."""
    done = torch.cuda.Event()
    done.record(stream)
    while not done.query():
        time.sleep(poll_s)


@dataclass
class FlatBucket:
    names: list[str]
    shapes: list[list[int]]
    dtype: torch.dtype
    flat: torch.Tensor | None          # 1-D, `dtype`, the packed tensors back to back (None: none)
    ready: Any = None                  # torch.cuda.Event recorded after flattening (CUDA only)
    index: int = 0
    _release: Any = None               # gives the pool buffer back (after the transfer)
    direct: list[torch.Tensor] = field(default_factory=list)  # the last len(direct) names, as is

    def release(self) -> None:
        """The transfer is complete: the flat buffer may be reused or freed."""
        if self._release is not None:
            self._release()
            self._release = None
        self.flat = None
        self.direct = []

    @property
    def flat_count(self) -> int:
        """How many of `names` (the first ones) are packed into `flat`."""
        return len(self.names) - len(self.direct)

    @property
    def wire(self) -> list[torch.Tensor]:
        """The tensors broadcast for this bucket, in order: the flat part (if any), then each direct."""
        return ([self.flat] if self.flat is not None else []) + self.direct

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.wire)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def views(self) -> NamedTensors:
        """(name, tensor) of every tensor in the bucket: views into `flat`, then the direct ones."""
        out, offset = [], 0
        for name, shape in zip(self.names[:self.flat_count], self.shapes):
            n = 1
            for d in shape:
                n *= d
            out.append((name, self.flat[offset:offset + n].view(shape)))
            offset += n
        out += [(name, t.view(shape)) for name, shape, t in
                zip(self.names[self.flat_count:], self.shapes[self.flat_count:], self.direct)]
        return out


class BufferPool:
    """Reusable flat buffers (raw bytes on one device); taken by the gather, released by the sender."""

    def __init__(self, min_bytes: int = 0):
        self.min_bytes = min_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever made (a test and the docstring's bound)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Callable[[], None]]:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        with self._lock:
            fits = [b for b in self._free if b.device == device and b.numel() >= nbytes]
            buf = min(fits, key=lambda b: b.numel()) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8, device=device)
            self.allocated += 1

        def release() -> None:
            with self._lock:
                self._free.append(buf)
        return buf[:nbytes].view(dtype), release

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def flatten(named: NamedTensors, device: torch.device | None = None, index: int = 0,
            pool: BufferPool | None = None, direct_min_bytes: int = 0) -> FlatBucket:
    """One flat tensor of `named` (all of one dtype), on `device` (default: where they are).

    `direct_min_bytes` > 0: contiguous tensors of at least that many bytes stay out of the flat
    tensor (`FlatBucket.direct`, after the packed ones in `names`)."""
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"flatten: a bucket must hold one dtype, got {sorted(map(str, dtypes))}")
    packed, direct = [], []
    for name, t in named:
        t = t.detach()
        if direct_min_bytes > 0 and t.is_contiguous() and \
                t.numel() * t.element_size() >= direct_min_bytes:
            direct.append((name, t if device is None else t.to(device)))
        else:
            packed.append((name, t))
    parts = [t.reshape(-1) for _, t in packed]
    flat, release = None, None
    if parts:
        same_device = device is None or parts[0].device == device
        if len(parts) > 1 and pool is not None and same_device:
            flat, release = pool.take(sum(p.numel() for p in parts), parts[0].dtype, parts[0].device)
            torch.cat(parts, out=flat)
        else:
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if device is not None and flat.device != device:
            flat = flat.to(device)
    first = flat if flat is not None else direct[0][1]
    ready = None
    if first.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(first.device))
    ordered = packed + direct
    return FlatBucket([n for n, _ in ordered], [list(t.shape) for _, t in ordered], first.dtype, flat,
                      ready, index, release, [t.reshape(-1) for _, t in direct])


class Coalescer:
    """Collects (name, tensor) pairs into flat buckets of about `bucket_bytes`, one dtype each."""

    def __init__(self, bucket_bytes: int, emit: Callable[[FlatBucket], None],
                 device: torch.device | None = None, pool: BufferPool | None = None,
                 direct_min_bytes: int = 0):
        self.bucket_bytes, self.emit, self.device, self.pool = bucket_bytes, emit, device, pool
        self.direct_min_bytes = direct_min_bytes
        self._open: NamedTensors = []
        self._open_bytes = 0
        self.buckets = 0

    def add(self, named: NamedTensors) -> None:
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            if self._open and (self._open_bytes + nbytes > self.bucket_bytes
                               or t.dtype != self._open[0][1].dtype):
                self.flush()
            self._open.append((name, t))
            self._open_bytes += nbytes

    def flush(self) -> None:
        if not self._open:
            return
        bucket = flatten(self._open, self.device, self.buckets, self.pool, self.direct_min_bytes)
        self._open, self._open_bytes = [], 0
        self.buckets += 1
        self.emit(bucket)


@dataclass
class _Stop:
    pass


@dataclass
class SendPipeline:
    """A sender thread fed through a bounded queue.

    `send(bucket)` runs on the sender thread and returns a completion callable (or None): the
    pipeline calls it before letting go of the bucket, `inflight` buckets later, so the transfer
    of bucket k overlaps the hand-shakes of the buckets after it.
    """

    send: Callable[[FlatBucket], Callable[[], None] | None]
    depth: int
    timeout_s: float
    name: str = "weights-send"
    inflight: int = 1
    _queue: queue.Queue = field(init=False)
    _error: BaseException | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._done = threading.Event()
        self._aborted = False

    def start(self) -> None:
        self._error = None
        self._done.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending: collections.deque[Callable[[], None] | None] = collections.deque()
        try:
            while True:
                item = self._queue.get()
                if isinstance(item, _Stop) or self._aborted:
                    break
                pending.append(self.send(item))
                while len(pending) > self.inflight:
                    if (complete := pending.popleft()) is not None:
                        complete()
            while pending and not self._aborted:
                if (complete := pending.popleft()) is not None:
                    complete()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._error = e
            while True:  # unblock a caller waiting on a full queue
                try:
                    if isinstance(self._queue.get_nowait(), _Stop):
                        break
                except queue.Empty:
                    break
        finally:
            self._done.set()

    def put(self, bucket: FlatBucket) -> None:
        self.raise_error()
        try:
            self._queue.put(bucket, timeout=self.timeout_s)
        except queue.Full:
            self.raise_error()
            raise TimeoutError(f"{self.name}: the sender took no bucket for {self.timeout_s} s "
                               "(weights.bucket_timeout_s); the link to the engines is stuck") from None

    def drain(self) -> None:
        """Wait until every bucket is sent and complete; raise the sender's error if any."""
        if self._thread is None:
            return
        if not self._done.is_set():
            try:
                self._queue.put(_Stop(), timeout=self.timeout_s)
            except queue.Full:
                self.raise_error()
                raise TimeoutError(f"{self.name}: the sender is stuck (no progress in "
                                   f"{self.timeout_s} s)") from None
        if not self._done.wait(self.timeout_s * max(1, self.depth + 1)):
            raise TimeoutError(f"{self.name}: the last buckets did not complete within "
                               f"{self.timeout_s * (self.depth + 1)} s")
        self._thread = None
        self.raise_error()

    def abort(self) -> None:
        """Stop the sender after its current bucket (after a failure elsewhere)."""
        self._aborted = True
        try:
            self._queue.put_nowait(_Stop())
        except queue.Full:
            pass  # the sender is busy; it sees `_aborted` at its next bucket

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error
