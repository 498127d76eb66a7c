"""The weight-transport contract: how a trainer hands new weights to rollout engines.

A transport moves named tensors (HF checkpoint names, full unsharded tensors) in buckets. The
training backend drives it from `update_weights`: every trainer rank takes part in gathering the
shards, and the ranks for which `is_sender` is true call `send_bucket`. The WeightPublisher owns
the engine session around it (pause -> begin -> buckets -> version -> continue).

The methods are synchronous because they run on trainer ranks next to blocking torch code; a
transport that must talk HTTP to engines while a collective is in flight uses its own thread.
`send_bucket` does not raise when the link to the engines fails: the backend must keep iterating
(gathering shards is collective on every trainer rank, and a rank that stops early hangs the
others), so a transport drops the remaining buckets and raises the failure from `finish`.

Optional, with defaults that keep the four-method contract whole (only the publisher calls them):
- `pause_during_transfer = False` says the engines keep generating throughout (disk-delta:
  they only read files, and swap between two of their own steps). The publisher then runs
  `prepare(version)` and `commit(version)` with the engines serving, and never pauses them.
- `sets_version = True` says the transport already set the version on every engine (the nccl
  transport's final barrier is `/update_weight_version`; disk-delta's commit sets it with the
  swap), so the publisher skips that call.
- `send_gate`: a transport that sets `uses_send_gate = True` promises to touch no engine before
  `send_gate.wait()` returns; the publisher then starts the gather at once and opens the gate
  when every engine has paused, so the first buckets are gathered while the engines pause.
- `checksum_dtype` / `sent_checksums` belong to the check-weights tap (miles/weights/checks.py).
- `stats` counts what the last publish moved; `close()` releases links (a process group, threads).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

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


class WeightTransport(ABC):
    is_sender: bool = True
    pause_during_transfer: bool = True
    sets_version: bool = False
    uses_send_gate: bool = False
    send_gate: SendGate | None = None

    @abstractmethod
    def connect(self, engine_urls: list[str]) -> None:
        """Set up whatever links the engines (a process group, a directory); once per run."""

    @abstractmethod
    def begin(self, version: int) -> None:
        """Start publishing `version`; engines are already paused by the publisher."""

    @abstractmethod
    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Move one bucket of full tensors (HF names) to every engine."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """Complete `version` on every engine (the engines then report it)."""

    def prepare(self, version: int) -> None:
        """(pause_during_transfer=False only) engines make `version` ready while serving."""

    def commit(self, version: int) -> None:
        """(pause_during_transfer=False only) engines swap `version` in, between two of their steps."""

    def abandon(self, version: int) -> None:
        """The publish of `version` failed: drop whatever was staged for it (best effort)."""

    @property
    def stats(self) -> TransferStats:
        return getattr(self, "_stats", None) or TransferStats()

    def close(self) -> None:
        """Release the links made by `connect` (optional)."""


class DelegatingTransport(WeightTransport):
    """A transport that wraps another (quantize-on-export, the checksum tap): every call and
    attribute goes to `inner` unless the wrapper overrides it, so a wrapper states only what it adds."""

    def __init__(self, inner: WeightTransport):
        self.inner = inner

    @property
    def is_sender(self) -> bool:  # type: ignore[override]
        return self.inner.is_sender

    @property
    def pause_during_transfer(self) -> bool:  # type: ignore[override]
        return self.inner.pause_during_transfer

    @property
    def sets_version(self) -> bool:  # type: ignore[override]
        return self.inner.sets_version

    @property
    def uses_send_gate(self) -> bool:  # type: ignore[override]
        return self.inner.uses_send_gate

    @property
    def send_gate(self):  # type: ignore[override]
        return self.inner.send_gate

    @send_gate.setter
    def send_gate(self, gate) -> None:
        self.inner.send_gate = gate

    @property
    def stats(self) -> TransferStats:
        return self.inner.stats

    def connect(self, engine_urls: list[str]) -> None:
        self.inner.connect(engine_urls)

    def begin(self, version: int) -> None:
        self.inner.begin(version)

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.inner.send_bucket(named_tensors)

    def finish(self, version: int) -> None:
        self.inner.finish(version)

    def prepare(self, version: int) -> None:
        self.inner.prepare(version)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abandon(self, version: int) -> None:
        self.inner.abandon(version)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # transport-specific attributes (engine_dtype, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
