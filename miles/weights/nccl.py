"""`transport = "nccl"`: trainer rank 0 broadcasts flat buckets to every engine in one group.

Design decisions:
- One weight-update group: trainer rank 0 is rank 0 (and hosts the store), engine i joins through
  its `/init_weights_update_group` at rank_offset 1 + (ranks of the engines before it), its TP
  ranks after that (SGLang adds the TP rank). NCCL on GPUs, gloo on CPU (`group_backend`); the
  code path is the same, which is what the CPU tests exercise.
- Per bucket, rank 0 posts `/update_weights_from_distributed` (names, dtypes, shapes,
  `load_format: "flattened_bucket"`) to every engine AND broadcasts the flat bucket, concurrently:
  the engine's receive waits for the broadcast. SGLang answers once the bucket is loaded; the
  embedded engine answers as soon as its receive is posted and the previous bucket is copied in,
  so the HTTP hand-shake of bucket k+1 and the copy of bucket k hide behind the transfer of bucket
  k+1.
- Order: every engine must post its receives in broadcast order. For SGLang the next call is
  never posted before the previous one is answered. Embedded engines (`server_info` says
  `engine: miles-embedded`) take a `bucket_seq` and post receives strictly in that order, so up to
  `inflight_buckets` calls are in flight at once and no HTTP round trip ever sits between two
  broadcasts: the link stays busy with back-to-back buckets.
- Zero-copy on embedded engines (`direct_min_bytes` > 0, `load_format: "miles_direct"`): in a
  bucket, tensors of at least that size are broadcast as they are (no flatten on the trainer),
  after one flat broadcast of the small ones, all in one NCCL group per bucket; the engine posts
  each direct receive straight into its parameter storage (no copy-out). The request names them
  in wire order and says how many lead in the flat part (`flat_count`). SGLang gets flat buckets.
- `finish` drains the sender and then calls `/update_weight_version` on every engine: that call
  is the barrier after which every engine holds the whole version (on the embedded engine it
  completes the last pipelined bucket; on SGLang it is a no-op barrier), and it reports failures.
- After any failure the group is torn down (a broadcast that nobody receives would otherwise sit
  in the NCCL watchdog for `group_timeout_s`), and the next `begin` builds a fresh one; engines
  drop the old group first (`/destroy_weights_update_group`, best effort).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from miles.weights.base import BucketStream, GateClosed, TransferStats, TransportTraits
from miles.weights.buckets import BufferPool, Coalescer, FlatBucket, SendPipeline, wait_stream
from miles.weights.config import WeightsConfig
from miles.weights.engine_calls import EngineCalls
from miles.weights.process_group import (broadcast_all, create_group_with_engines, destroy_group,
                                         free_port)

log = logging.getLogger(__name__)


def resolve_group_backend(choice: str) -> str:
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("weights.group_backend='nccl' but this trainer process has no CUDA; "
                           "use 'gloo' (or 'auto')")
    return choice


class NcclTransport(BucketStream):
    def __init__(self, config: WeightsConfig, *, is_sender: bool = True):
        self.cfg = config
        # finish() ends with /update_weight_version on every engine (sets_version); no engine
        # call before the publisher has paused them all (send_gate)
        self.traits = TransportTraits(sender=is_sender, sets_version=True, send_gate=True)
        self.engine_urls: list[str] = []
        self.backend = ""
        self.group_name = ""
        self._joins = 0
        self._pg = None
        self._calls: EngineCalls | None = None
        self._broken = False
        self._stats = TransferStats()
        self._pipeline: SendPipeline | None = None
        self._coalescer: Coalescer | None = None
        self._stream = None
        self._version = -1
        self._error: BaseException | None = None
        self._ordered = False   # every engine takes `bucket_seq` (several calls in flight)
        self.timeline: list[tuple[int, int, float, float, float]] = []  # see _send
        self._pool = BufferPool()  # flat send buffers, reused across versions
        self._t0 = 0.0

    # ---- the group ---------------------------------------------------------------------------

    def connect(self, engine_urls: list[str]) -> None:
        if not self.traits.sender:
            return
        if not engine_urls:
            raise ValueError("connect: engine_urls is empty; the nccl transport needs at least one engine")
        self.engine_urls = list(engine_urls)
        self.backend = resolve_group_backend(self.cfg.group_backend)
        # gloo sends from host memory; NCCL from wherever the trainer's tensors are (the current
        # CUDA device is per thread, so it is read off the tensors, not asked for here).
        self.device = None if self.backend == "nccl" else torch.device("cpu")
        if self._calls is None:
            self._calls = EngineCalls(self.engine_urls, timeout_s=self.cfg.connect_timeout_s,
                                      name="weights-nccl")
        try:
            self._join()
        except BaseException:
            self.close()
            raise

    def _join(self) -> None:
        cfg, calls = self.cfg, self._calls
        t0 = time.perf_counter()
        infos = calls.call_all("server_info", what="server_info (before joining the weight-update "
                               "group)", timeout_s=cfg.connect_timeout_s)
        ranks = [max(1, int(info.get("tp_size", 1) or 1)) for info in infos]
        self._ordered = all(info.get("engine") == "miles-embedded" for info in infos)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world_size = 1 + sum(ranks)
        # A previous trainer (or our own failed group) may have left a group on the engines: drop
        # it first. A rebuilt group gets a new name, so no stale registration can collide.
        stale = {cfg.group_name, self.group_name} if self.group_name else {cfg.group_name}
        for name in stale:
            for fut in calls.submit_all("destroy_weights_update_group", name,
                                        timeout_s=cfg.control_timeout_s):
                try:
                    fut.result(cfg.control_timeout_s)
                except Exception:  # noqa: BLE001 - usually "is not an open group", which is fine
                    pass
        self.group_name = cfg.group_name if not self._joins else f"{cfg.group_name}.{self._joins}"
        self._joins += 1
        port = cfg.master_port or free_port(cfg.master_address)
        joins = [calls.submit(i, "init_weights_update_group", cfg.master_address, port, offsets[i],
                              world_size, group_name=self.group_name, backend=self.backend,
                              timeout_s=cfg.connect_timeout_s) for i in range(len(self.engine_urls))]
        self._pg = create_group_with_engines(
            backend=self.backend, master_address=cfg.master_address, master_port=port,
            world_size=world_size, group_name=self.group_name, timeout_s=cfg.connect_timeout_s,
            engine_joins=joins, engine_urls=self.engine_urls,
            collective_timeout_s=cfg.group_timeout_s)
        self._broken = False
        log.info("weight-update group %r: %s, %d engine rank(s), joined in %.2f s", self.group_name,
                 self.backend, world_size - 1, time.perf_counter() - t0)

    def _teardown(self) -> None:
        if self._pg is not None:
            try:
                from torch.distributed.distributed_c10d import _abort_process_group
                _abort_process_group(self._pg)
            except Exception:  # noqa: BLE001 - older torch, or already gone
                destroy_group(self._pg)
        self._pg = None
        self._broken = True

    # ---- a version ---------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        if self._calls is None:
            raise RuntimeError("begin: the nccl transport is not connected; call connect(engine_urls)")
        if self._broken:
            log.warning("rebuilding the weight-update group after a failed publish")
            self._join()
        self._version = version
        self._error: BaseException | None = None
        self._stats = TransferStats()
        self._pipeline = SendPipeline(self._send, depth=self.cfg.queue_depth,
                                      timeout_s=self.cfg.bucket_timeout_s, name="weights-nccl-send",
                                      inflight=self.cfg.inflight_buckets if self._ordered else 1)
        self.timeline = []
        self._t0 = time.perf_counter()
        self._pipeline.start()
        if self._pool.min_bytes != self.cfg.bucket_bytes:
            self._pool.clear()
            self._pool.min_bytes = self.cfg.bucket_bytes
        self._coalescer = Coalescer(self.cfg.bucket_bytes, self._pipeline.put, self.device, self._pool,
                                    self.cfg.direct_min_bytes if self._ordered else 0)

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._coalescer is None:
            raise RuntimeError("send_bucket before begin")
        self._stats.tensors += len(named_tensors)
        self._stats.bytes += sum(t.numel() * t.element_size() for _, t in named_tensors)
        if self._error is not None:
            return  # keep the backend iterating: the gather is collective on every trainer rank
        try:
            self._coalescer.add(named_tensors)
        except Exception as e:  # noqa: BLE001 - reported by finish()
            self._fail(e)

    def finish(self, version: int) -> None:
        if self._coalescer is None or self._pipeline is None:
            raise RuntimeError("finish before begin")
        try:
            if self._error is None:
                self._coalescer.flush()
                self._pipeline.drain()
                self._stats.buckets = self._coalescer.buckets
                self._stats.payload_bytes = self._stats.bytes
                self._wait_gate()  # (no bucket at all: still not before the pause)
                # The barrier: every engine completes its last bucket before it answers.
                t = time.perf_counter()
                self._calls.call_all("update_weight_version", str(version),
                                     what=f"version {version}: final barrier",
                                     timeout_s=self.cfg.bucket_timeout_s)
                self._stats.load_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            self._coalescer = None
        if self._error is not None:
            raise self._error

    def abandon(self, version: int) -> None:
        if self._coalescer is not None:
            self._fail(RuntimeError(f"version {version} abandoned by the publisher"))
            self._coalescer = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._pipeline is not None:
            self._pipeline.abort()
        if not isinstance(error, GateClosed):  # nothing was sent then: the group is intact
            self._teardown()

    # ---- the sender thread -------------------------------------------------------------------

    def _wait_gate(self) -> None:
        if self.send_gate is not None:
            self.send_gate.wait(self.cfg.pause_timeout_s + 30.0)

    def _send(self, bucket: FlatBucket):
        cfg, pg = self.cfg, self._pg
        self._wait_gate()
        what = (f"version {self._version} bucket {bucket.index} ({len(bucket.names)} tensors, "
                f"{bucket.nbytes / 2**20:.1f} MiB, first {bucket.names[0]!r})")
        t_post = time.perf_counter() - self._t0
        extra = {"bucket_seq": bucket.index} if self._ordered else {}
        load_format = "flattened_bucket"
        if bucket.direct:
            load_format, extra["flat_count"] = "miles_direct", bucket.flat_count
            self._stats.direct_tensors += len(bucket.direct)
        futures = self._calls.submit_all(
            "update_weights_from_distributed", bucket.names, [bucket.dtype_name] * len(bucket.names),
            bucket.shapes, group_name=self.group_name, load_format=load_format,
            timeout_s=cfg.bucket_timeout_s, **extra)
        wire = bucket.wire
        stream = None
        if wire[0].is_cuda:
            # A side stream that waits only for this bucket's flatten, so a later gather on the
            # default stream never delays the broadcast.
            if self._stream is None or self._stream.device != wire[0].device:
                self._stream = torch.cuda.Stream(wire[0].device)
            stream = self._stream
            with torch.cuda.stream(stream):
                stream.wait_event(bucket.ready)
                work = broadcast_all(wire, pg)
        else:
            work = broadcast_all(wire, pg)
        answered: list[float] = []
        for fut in futures:
            fut.add_done_callback(lambda _f: answered.append(time.perf_counter() - self._t0))
        if not self._ordered:  # the next call only after this one is answered (see the docstring)
            self._calls.wait(futures, what, cfg.bucket_timeout_s)

        def complete() -> None:
            # Runs `inflight` buckets later: the buckets after this one are already queued behind
            # it on the wire.
            if self._ordered:
                self._calls.wait(futures, what, cfg.bucket_timeout_s)
            if stream is not None:
                with torch.cuda.stream(stream):
                    work.wait()
                wait_stream(stream)  # polled, not a blocking synchronize (see buckets.wait_stream)
            else:
                work.wait()
            # (bucket index, bytes, posted, answered, complete), seconds since begin
            self.timeline.append((bucket.index, bucket.nbytes, t_post, max(answered, default=0.0),
                                  time.perf_counter() - self._t0))
            bucket.release()  # the buffer may be reused now

        return complete

    def close(self) -> None:
        if self._calls is not None and self.group_name:
            for fut in self._calls.submit_all("destroy_weights_update_group", self.group_name,
                                              timeout_s=self.cfg.control_timeout_s):
                try:  # best effort: the engines may be gone already
                    fut.result(self.cfg.control_timeout_s)
                except Exception:  # noqa: BLE001
                    pass
        if self._pg is not None:
            destroy_group(self._pg)
            self._pg = None
        self._pool.clear()
        if self._calls is not None:
            self._calls.close()
            self._calls = None
