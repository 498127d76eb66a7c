"""The weight-transport contract: how a trainer hands new weights to rollout engines.

The contract is two abstract methods and one traits struct:

    send(version, buckets)   trainer side, every sender rank: move the buckets of named full
                             tensors (HF names) toward the engines; called inside the backend's
                             `update_weights` through `send_weights`
    commit(version)          publisher side, rank 0: make `version` live on every engine
    traits                   TransportTraits: who sends, whether the engines pause, who sets
                             the version, whether a send gate holds the first engine call

with four defaults a transport overrides when it has something to do: `connect(engine_urls)`
(links, once per run), `prepare(version)` (engines stage what was sent while they serve),
`abandon(version)` (drop what was staged for a failed version, best effort) and `close()`.
The WeightPublisher runs every transport through the same phases, one version at a time:

    [pause] -> send (run_update) -> prepare -> commit -> [update_weight_version] -> [resume]

prepare / commit / abandon are the two-phase shape of a version: a fleet-wide transaction
prepares on every engine, then commits on all or abandons on all.

Design decisions:
- Capabilities are data, not attributes to probe: one frozen `TransportTraits` per transport,
  read by the publisher and the backends, forwarded whole by wrappers (`DelegatingTransport`).
  A transport whose traits change at run time (colocated: whether its direct call set the
  version) makes `traits` a property.
- `send` takes an iterable, not one bucket per call: the backend's gather is collective on
  every trainer rank, so `send_weights` (the one entry point of the backends) iterates the
  buckets to the end on every rank, also on a rank that does not send and after a transport
  failed, and then raises the failure. A rank that stopped early would hang the others.
- The methods are synchronous because they run on trainer ranks next to blocking torch code; a
  transport that must talk HTTP to engines while a collective is in flight uses its own thread.
- `BucketStream` is the helper the built-in transports share: `send` as begin, one
  `send_bucket` per bucket, `finish`. A transport's `send_bucket` does not raise when the link
  to the engines fails (it drops the remaining buckets and `finish` raises), so the gather goes on.
- The send gate (`traits.send_gate`): such a transport promises to touch no engine before
  `send_gate.wait()` returns; the publisher then starts the gather at once and opens the gate
  when every engine has paused, so the first buckets are gathered while the engines pause.
- `stats` counts what the last publish moved.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import torch


@dataclass
class TransferStats:
    """What one publish moved, filled in by the transport on the sender rank."""
    tensors: int = 0
    bytes: int = 0          # tensor bytes handed to send_bucket (full size, export dtype)
    buckets: int = 0        # buckets that went to the engines (after coalescing)
    payload_bytes: int = 0  # bytes actually written/sent (a delta is smaller than `bytes`)
    direct_tensors: int = 0  # nccl: tensors sent zero-copy (`direct_min_bytes`)
    changed_elements: int = 0  # disk_delta: elements that differ from the engines' version
    elements: int = 0          # disk_delta: elements compared (0: not counted)
    load_s: float = 0.0     # the tail of the transfer spent waiting for the engines to load it
    #                         (final barrier, load call); the publisher reports it as load time


class GateClosed(RuntimeError):
    """The publisher closed the send gate (the engines could not be paused): send nothing."""


class SendGate:
    """Opened by the publisher once every engine is paused, or closed with the reason."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: BaseException | None = None

    def open(self) -> None:
        self._event.set()

    def close(self, reason: str) -> None:
        self.error = GateClosed(reason)
        self._event.set()

    def is_set(self) -> bool:
        """Opened or closed: `wait` would not block."""
        return self._event.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"the engines were not paused within {timeout_s} s")
        if self.error is not None:
            raise self.error


NamedTensors = list[tuple[str, torch.Tensor]]


class TransportTraits(msgspec.Struct, frozen=True, kw_only=True):
    """What a transport is, for the publisher and the backends (never probed as attributes)."""
    sender: bool = True           # this trainer rank hands its buckets to `send`
    pauses_engines: bool = True   # False: the engines serve throughout; prepare and commit land
    #                               between two of their steps (disk_delta), nothing is paused
    sets_version: bool = False    # the transport set the version on every engine (nccl's last
    #                               barrier, disk_delta's commit): no /update_weight_version
    send_gate: bool = False       # no engine call before `send_gate.wait()` returns


class WeightTransport(ABC):
    traits: TransportTraits = TransportTraits()
    send_gate: SendGate | None = None  # set by the publisher for one publish (traits.send_gate)

    @abstractmethod
    def send(self, version: int, buckets: Iterable[NamedTensors]) -> None:
        """(sender ranks) Move every bucket of full tensors (HF names) of `version` toward the
        engines; with `traits.pauses_engines` they are paused meanwhile."""

    @abstractmethod
    def commit(self, version: int) -> None:
        """(rank 0, after send and prepare) Make `version` live on every engine; a transport
        whose `send` already left it whole there (its last engine call) has nothing to do."""

    def connect(self, engine_urls: list[str]) -> None:
        """Set up whatever links the engines (a process group, a directory); once per run."""

    def prepare(self, version: int) -> None:
        """(rank 0, after send) Engines stage `version` (decode, verify) without swapping it in."""

    def abandon(self, version: int) -> None:
        """The publish of `version` failed: drop whatever was staged for it (best effort)."""

    _stats: TransferStats | None = None

    @property
    def stats(self) -> TransferStats:
        return self._stats or TransferStats()

    def close(self) -> None:
        """Release the links made by `connect`."""


def send_weights(transport: WeightTransport, version: int, buckets: Iterable[NamedTensors]) -> None:
    """A backend's `update_weights` on every trainer rank: a sender hands `buckets` to
    `transport.send`; every rank iterates them to the end (the gather is collective), also
    after the transport failed, and then raises that failure."""
    it = iter(buckets)
    try:
        if transport.traits.sender:
            transport.send(version, it)
    finally:
        for _ in it:
            pass


class BucketStream(WeightTransport):
    """`send` as `begin(version)`, `send_bucket(bucket)` per bucket, `finish(version)`: the shape
    of every built-in transport (and what tests and bench drive by hand)."""

    def send(self, version: int, buckets: Iterable[NamedTensors]) -> None:
        self.begin(version)
        for bucket in buckets:
            self.send_bucket(bucket)
        self.finish(version)

    def commit(self, version: int) -> None:
        """`finish` ended with the engines holding `version` (they are paused): nothing left."""

    @abstractmethod
    def begin(self, version: int) -> None:
        """Start publishing `version`."""

    @abstractmethod
    def send_bucket(self, named_tensors: NamedTensors) -> None:
        """Move one bucket; on a failed link, drop it and the rest, and raise from `finish`."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """Complete what `send_bucket` moved (drain, seal, load); raise the first failure."""


class DelegatingTransport(WeightTransport):
    """A transport that wraps another (quantize-on-export, the checksum tap): the contract goes
    to `inner` unless the wrapper overrides it, so a wrapper states only what it adds (usually
    `send`, as a transform of the buckets)."""

    def __init__(self, inner: WeightTransport):
        self.inner = inner

    @property
    def traits(self) -> TransportTraits:  # type: ignore[override]
        return self.inner.traits

    @property
    def send_gate(self) -> SendGate | None:  # type: ignore[override]
        return self.inner.send_gate

    @send_gate.setter
    def send_gate(self, gate: SendGate | None) -> None:
        self.inner.send_gate = gate

    @property
    def stats(self) -> TransferStats:
        return self.inner.stats

    def send(self, version: int, buckets: Iterable[NamedTensors]) -> None:
        self.inner.send(version, buckets)

    def connect(self, engine_urls: list[str]) -> None:
        self.inner.connect(engine_urls)

    def prepare(self, version: int) -> None:
        self.inner.prepare(version)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abandon(self, version: int) -> None:
        self.inner.abandon(version)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        # The inner transport's own read-outs (staged_on, last_manifest, timeline), for logs,
        # tests and bench; nothing of the contract goes this way.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
