"""`transport = "colocated"`: the trainer and its engine share a GPU; buckets go by CUDA IPC.

Design decisions:
- Each bucket is flattened into one fresh device tensor and shared through a CUDA IPC handle
  (miles/weights/cuda_ipc.py: the handle's fields as JSON, never pickle) in
  `/update_weights_from_tensor` with `load_format: "miles_cuda_ipc"`; the engine maps that memory
  and copies device to device. The weights never touch host memory.
- Every trainer rank that shares its GPU with an engine is a sender (FSDP gathers full tensors on
  every rank), and sends to its own engine only: with one engine per trainer rank,
  `engine_urls[rank]`. The publisher on rank 0 still pauses, versions and resumes all engines.
- The engine answers once it has copied the bucket, so the trainer keeps the bucket's memory
  exactly that long; the next bucket is gathered and flattened meanwhile (the send pipeline).
- Direct writes (`weights.colocated_direct`, on by default): the engine shares its own weight
  storages once (`GET /ipc_weight_targets`, cuda_ipc.IpcTargets), and the trainer writes every
  exported tensor whose name, shape and dtype match straight into the engine's view of it once
  the engines are paused: one device copy per byte, no flat bucket, no engine-side copy. One
  `miles_cuda_ipc_direct` call per publish, posted as the writes start, checks the engine
  instance's token, flushes its prefix cache and sets the version (`traits.sets_version`), so it
  costs the stall nothing. Buckets handed over while the engines are still pausing are matched and held
  (up to queue_depth buckets' bytes), not waited on: the trainer gathers the next ones meanwhile,
  and the writes start at the gate. Whatever has no view (FP8-held linears, quantized formats)
  still goes by flat buckets. Each publish first checks the engine's token (overlapped with the pause), and maps a
  restarted engine's storages again.
- Only a rank the publisher gates writes directly (the one that pauses the engines): another rank
  has no signal that its engine is paused, so it keeps flat buckets, which the engine applies
  under its step lock.
- There is no CUDA IPC on CPU: `connect` says so and names the transports that work there.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from miles.engines.client import EngineRequestError
from miles.weights import cuda_ipc
from miles.weights.base import BucketStream, TransferStats, TransportTraits
from miles.weights.buckets import Coalescer, FlatBucket, SendPipeline, wait_stream
from miles.weights.config import WeightsConfig
from miles.weights.cuda_ipc import FORMAT, encode_bucket
from miles.weights.engine_calls import EngineCallError, EngineCalls

log = logging.getLogger(__name__)


class ColocatedTransport(BucketStream):

    def __init__(self, config: WeightsConfig, *, rank: int = 0, world_size: int = 1):
        self.cfg = config
        self.rank, self.world_size = rank, world_size
        self.engine_url = ""
        self._calls: EngineCalls | None = None
        self._stats = TransferStats()
        self._pipeline: SendPipeline | None = None
        self._coalescer: Coalescer | None = None
        self._error: BaseException | None = None
        self._version = -1
        self._targets: dict[str, torch.Tensor] = {}  # name -> the engine's own weight (mapped)
        self._token = ""                             # the engine instance those views belong to
        self._direct_call = None                     # this publish's miles_cuda_ipc_direct call
        self._direct_written = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # matched, not yet written
        self._pending_bytes = 0
        self._t0, self.phases = 0.0, {}

    @property
    def traits(self) -> TransportTraits:  # type: ignore[override]
        # Every rank sends (to its own engine); no engine call before the publisher has paused
        # them all. The direct call sets the version on this rank's engine (even when no tensor
        # went direct); with several trainer ranks the publisher still sets it on every engine.
        return TransportTraits(send_gate=True,
                               sets_version=bool(self._token) and self.world_size == 1)

    def connect(self, engine_urls: list[str]) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("weights.transport='colocated' shares GPU memory through CUDA IPC, and "
                               "this process has no CUDA; on CPU use transport='nccl' (it runs on "
                               "gloo there), 'disk' or 'disk_delta'")
        if len(engine_urls) == self.world_size:
            self.engine_url = engine_urls[self.rank]
        elif len(engine_urls) == 1 and self.world_size == 1:
            self.engine_url = engine_urls[0]
        else:
            raise ValueError(f"connect: transport='colocated' needs one engine per trainer rank "
                             f"(rank r sends to engine_urls[r]); got {len(engine_urls)} engine(s) for "
                             f"{self.world_size} trainer rank(s)")
        self._calls = EngineCalls([self.engine_url], timeout_s=self.cfg.bucket_timeout_s,
                                  name="weights-ipc")
        info = self._calls.call_all("model_info", what="model_info")[0]
        if info.get("device") and not str(info["device"]).startswith("cuda"):
            raise RuntimeError(f"transport='colocated': engine {self.engine_url} runs on "
                               f"{info['device']}, not on a GPU")
        self._targets, self._token = {}, ""
        if self.cfg.colocated_direct and self.rank == 0:
            self._map_targets()

    def _map_targets(self) -> None:
        """Fetch the engine's IpcTargets; map them when they belong to an engine instance other
        than the one mapped (the first time, or after a restart)."""
        try:
            raw = self._calls.call_all("ipc_weight_targets", self._token, what="ipc_weight_targets")[0]
        except EngineCallError as e:
            cause = e.__cause__
            if self._token or not (isinstance(cause, EngineRequestError) and cause.status == 404):
                raise
            log.warning("colocated: engine %s has no /ipc_weight_targets (not Miles' embedded "
                        "engine); publishing by flat buckets", self.engine_url)
            return
        targets = msgspec.convert(raw, cuda_ipc.IpcTargets)
        if targets.unchanged and targets.token == self._token:
            return
        if targets.token != self._token or not self._targets:
            self._targets, self._token = {}, ""   # unmap a previous instance's storages first
            self._targets = cuda_ipc.open_targets(targets)
            self._token = targets.token
            log.info("colocated: mapped %d weights of engine %s in %d storages (direct writes)",
                     len(self._targets), self.engine_url, len(targets.storages))

    def begin(self, version: int) -> None:
        if self._calls is None:
            raise RuntimeError("begin: the colocated transport is not connected; call connect(engine_urls)")
        self._version, self._error = version, None
        self._stats = TransferStats()
        self._direct_call, self._direct_written = None, 0
        self._pending, self._pending_bytes = [], 0
        self._t0, self.phases = time.perf_counter(), {}  # seconds since begin (bench/weights.py)
        if self._token:  # overlapped with the pause: the publisher pauses while this runs
            self._map_targets()
        self._pipeline = SendPipeline(self._send, depth=self.cfg.queue_depth,
                                      timeout_s=self.cfg.bucket_timeout_s, name="weights-ipc-send")
        self._pipeline.start()
        # Buckets stay on the trainer's GPU (wherever its tensors are): IPC shares device memory.
        self._coalescer = Coalescer(self.cfg.bucket_bytes, self._pipeline.put, None)

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._coalescer is None:
            raise RuntimeError("send_bucket before begin")
        self._stats.tensors += len(named_tensors)
        self._stats.bytes += sum(t.numel() * t.element_size() for _, t in named_tensors)
        if self._error is not None:
            return  # keep the backend iterating (collective gather); finish() reports
        try:
            rest = named_tensors
            if self._targets:
                direct, rest = [], []
                for name, t in named_tensors:
                    dst = self._targets.get(name)
                    if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype \
                            and dst.device == t.device:
                        direct.append((dst, t))
                    else:
                        rest.append((name, t))
                if direct:
                    self._pending += direct
                    self._pending_bytes += sum(t.nbytes for _, t in direct)
                    # while the engines are still pausing, gather the next buckets (up to
                    # queue_depth of them): that work then costs the stall nothing
                    if self._direct_call is not None or self.send_gate is None or \
                            self.send_gate.is_set() or \
                            self._pending_bytes >= self.cfg.queue_depth * self.cfg.bucket_bytes:
                        self._write_pending()
            if rest:
                self._coalescer.add(rest)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _write_pending(self) -> None:
        """Wait for the gate (once), then write what the buckets so far matched."""
        if not self._pending:
            return
        self._start_direct()
        self._copy(self._pending)
        self._direct_written += len(self._pending)
        self._pending, self._pending_bytes = [], 0
        self.phases["last_issue"] = time.perf_counter() - self._t0

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A copy_ per tensor, except those below `colocated_batch_below_bytes`, which go in one
        _foreach_copy_ (one launch for the held buckets' norms and biases instead of one each). All on the
        current stream, so a source tensor is not freed before its copy is done. (A _foreach_copy_
        of whole buckets made the 7B publish 18 ms instead of 12.6: slow on large tensors.)"""
        below = self.cfg.colocated_batch_below_bytes
        small = [(d, t) for d, t in pairs if t.nbytes < below]
        with torch.no_grad():
            if len(small) > 1:
                torch._foreach_copy_([d for d, _ in small], [t for _, t in small], non_blocking=True)
            else:
                small = []
            for dst, t in pairs:
                if small and t.nbytes < below:
                    continue
                dst.copy_(t, non_blocking=True)

    def _start_direct(self) -> None:
        """Once per publish, before the first direct write: wait until the engines are paused,
        then post the call that flushes the engine's cache and sets the version."""
        if self._direct_call is not None:
            return
        if self.send_gate is not None:
            self.send_gate.wait(self.cfg.pause_timeout_s + 30.0)
        self.phases["gate"] = time.perf_counter() - self._t0
        payload = msgspec.json.encode(cuda_ipc.DirectWrite(self._token)).decode()
        self._direct_call = self._calls.submit(
            0, "update_weights_from_tensor", [payload], load_format=cuda_ipc.DIRECT_FORMAT,
            weight_version=self._version, timeout_s=self.cfg.bucket_timeout_s)

    def finish(self, version: int) -> None:
        if self._coalescer is None or self._pipeline is None:
            raise RuntimeError("finish before begin")
        try:
            if self._error is None:
                self._coalescer.flush()
                self._write_pending()
                if self._token:
                    self._start_direct()  # sets the version even when nothing went direct
                t = time.perf_counter()  # the engines copying the last buckets out of the handles
                self._pipeline.drain()
                if self._direct_call is not None:
                    wait_stream(torch.cuda.current_stream())  # the direct writes are in
                    self.phases["written"] = time.perf_counter() - self._t0
                    self._calls.wait([self._direct_call], f"version {self._version}: the engine's "
                                     f"{cuda_ipc.DIRECT_FORMAT} call", self.cfg.bucket_timeout_s)
                    self.phases["answered"] = time.perf_counter() - self._t0
                self._stats.load_s = time.perf_counter() - t
                self._stats.direct_tensors = self._direct_written
                self._stats.buckets = self._coalescer.buckets
                self._stats.payload_bytes = self._stats.bytes
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            self._coalescer = None
            self._pending, self._pending_bytes = [], 0
        if self._error is not None:
            raise self._error

    def abandon(self, version: int) -> None:
        if self._coalescer is not None:
            self._fail(RuntimeError(f"version {version} abandoned by the publisher"))
            self._coalescer = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._pending, self._pending_bytes = [], 0   # nothing more is written this version
        if self._pipeline is not None:
            self._pipeline.abort()

    def _send(self, bucket: FlatBucket):
        if self.send_gate is not None:
            self.send_gate.wait(self.cfg.pause_timeout_s + 30.0)
        if not bucket.flat.is_cuda:
            raise RuntimeError(f"transport='colocated': the trainer's tensors are on "
                               f"{bucket.flat.device}, not on a GPU; CUDA IPC shares device memory")
        if bucket.ready is not None:
            bucket.ready.synchronize()  # the flatten is done before the engine reads the memory
        payload = encode_bucket(bucket.flat, bucket.names, bucket.shapes)
        fut = self._calls.submit(0, "update_weights_from_tensor", [payload], load_format=FORMAT,
                                 timeout_s=self.cfg.bucket_timeout_s)
        self._calls.wait([fut], f"version {self._version} bucket {bucket.index} ({len(bucket.names)} "
                                f"tensors, first {bucket.names[0]!r})", self.cfg.bucket_timeout_s)
        bucket.flat = None  # the engine has copied it
        return None

    def close(self) -> None:
        self._targets, self._token = {}, ""
        if self._calls is not None:
            self._calls.close()
            self._calls = None
