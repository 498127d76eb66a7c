"""check_weights: every engine parameter's sha256 equals the trainer's, after every publish.

Design decisions:
- The trainer's side is computed on the very tensors that stream through `send_bucket` (HF
  names, full tensors), cast to the engines' dtype first, so nothing extra is gathered and the
  check covers renaming and expert splitting too. `ChecksumTap` wraps any transport to do that.
- The engine's side is `/weights_checksum` (an embedded-engine extension: sha256 of each
  parameter's raw bytes, by checkpoint name). A mismatch raises naming the engine, how many
  parameters differ and the first few, with both digests; a parameter on one side only is a
  mismatch too (a name the engine does not know was never loaded; one the trainer never sent was
  never updated).
- It costs a host copy and a sha256 of every tensor: meant for tests, bring-up and debugging, not
  for every step of a large run.
"""

from __future__ import annotations

import hashlib

import torch

from miles.weights.base import TransferStats, WeightTransport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsMismatch(RuntimeError):
    """An engine's weights differ from what the trainer sent."""


def tensor_sha256(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    if dtype is not None:
        t = t.to(dtype)
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


class ChecksumTap(WeightTransport):
    """Forwards every call to `inner` and records the sha256 of each tensor it sends."""

    def __init__(self, inner: WeightTransport):
        self.inner = inner
        self.checksum_dtype: torch.dtype | None = None   # the publisher sets the engines' dtype
        self.sent_checksums: dict[str, str] = {}

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
        self.sent_checksums = {}
        self.inner.begin(version)

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            self.sent_checksums[name] = tensor_sha256(t, self.checksum_dtype)
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


def compare_checksums(trainer: dict[str, str], engine: dict[str, str], *, url: str, version: int,
                      show: int = 3) -> None:
    """Raise WeightsMismatch naming the first differing parameters, or return."""
    differ = [n for n in trainer if n in engine and engine[n] != trainer[n]]
    unsent = [n for n in engine if n not in trainer]
    unknown = [n for n in trainer if n not in engine]
    if not (differ or unsent or unknown):
        return
    parts = []
    if differ:
        first = "; ".join(f"{n} (engine {engine[n][:12]}.. != trainer {trainer[n][:12]}..)"
                          for n in differ[:show])
        parts.append(f"{len(differ)} of {len(engine)} parameters differ from the trainer's, first: {first}")
    if unsent:
        parts.append(f"{len(unsent)} engine parameters were not sent by the trainer, e.g. {unsent[:show]}")
    if unknown:
        parts.append(f"{len(unknown)} sent tensors are not engine parameters, e.g. {unknown[:show]}")
    raise WeightsMismatch(f"check_weights: version {version} on engine {url}: " + "; ".join(parts))
