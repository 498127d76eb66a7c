"""check_weights: every engine parameter's checksum equals the trainer's, after every publish.

Design decisions:
- The trainer's side is computed on the very tensors that stream through `send` (HF names,
  full tensors), cast to the engines' dtype first, so nothing extra is gathered and the
  check covers renaming and expert splitting too. `ChecksumTap` wraps any transport to do that.
- With a quantized rollout (miles/quant/export.py) the tap checksums `engine_view(name, tensor)`,
  the trainer's dequantize(quantize(w)), against the engine's dequantized parameter: the
  bit-exact contract of the formats, checked at every publish.
- The engine's side is `/weights_checksum` (an embedded-engine extension: sha256 of each
  parameter's raw bytes, by checkpoint name). A mismatch raises naming the engine, how many
  parameters differ and the first few, with both digests; a parameter on one side only is a
  mismatch too (a name the engine does not know was never loaded; one the trainer never sent was
  never updated).
- Two digests (`weights.checksum`). "device" is computed where the tensor lives,
  on both sides, with integer arithmetic that cannot overflow or depend on reduction order: each
  32-bit word w_i at position i maps to ((w_i * A + i * B) mod P)^2 mod P, P = 2^31 - 1, summed
  mod P, with two (A, B) pairs. Position-weighted and non-linear, so a changed, swapped or
  truncated word shows up (a mismatch can only hide with probability ~2^-62); not
  cryptographic, which a trainer checking its own engines does not need. On an H200 it reads a
  7B model in milliseconds, where "sha256" (a host copy and a sha256 of every tensor, the
  original check) takes seconds: "device" makes the check affordable at every step. On a CPU
  it is the slower one (~20x sha256, integer passes on one core), so "auto" (the default) picks
  "device" when the trainer's tensors are on a GPU and "sha256" otherwise, at the first tensor
  sent; the publisher then asks the engines for the same algorithm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from miles.weights.base import DelegatingTransport, NamedTensors, WeightTransport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsMismatch(RuntimeError):
    """An engine's weights differ from what the trainer sent."""


def tensor_sha256(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    if dtype is not None:
        t = t.to(dtype)
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


_P = (1 << 31) - 1
_KEYS = ((1_103_515_245, 12_345), (2_147_483_629, 1_013_904_223))  # (A, B) pairs, both < P
_CHUNK_WORDS = 1 << 22  # bounds the int64 temporaries (32 MiB each, a few alive at once)


def device_digest(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """The "device" checksum of a tensor's raw bytes, computed on its own device (see above)."""
    if dtype is not None:
        t = t.to(dtype)
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    if nbytes % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - nbytes % 4)])
    words = raw.view(torch.int32)
    acc = torch.zeros(len(_KEYS), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        w = w % _P
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) % _P
        for k, (a, b) in enumerate(_KEYS):
            h = (w * a % _P + i * b % _P) % _P   # every product < 2^62: no overflow
            h = h * h % _P
            acc[k] = (acc[k] + h.sum() % _P) % _P  # a chunk's sum < 2^22 * 2^31 = 2^53
    a0, a1 = (int(x) for x in acc.tolist())
    return f"{str(t.dtype).removeprefix('torch.')}:{nbytes}:{a0:08x}{a1:08x}"


CHECKSUMS = {"device": device_digest, "sha256": tensor_sha256}


class ChecksumTap(DelegatingTransport):
    """Forwards every call to `inner` and records the checksum of each tensor it sends."""

    def __init__(self, inner: WeightTransport, algorithm: str = "auto", *, engine_view=None):
        if algorithm not in (*CHECKSUMS, "auto"):
            raise ValueError(f"weights.checksum={algorithm!r} is not one of auto, {', '.join(CHECKSUMS)}")
        self.inner = inner
        self.algorithm = algorithm
        self.checksum_dtype: torch.dtype | None = None   # the publisher sets the engines' dtype
        self.sent_checksums: dict[str, str] = {}
        self.engine_view = engine_view  # (name, tensor) -> what the engine holds; None: itself

    def send(self, version: int, buckets: Iterable[NamedTensors]) -> None:
        self.sent_checksums = {}
        self.inner.send(version, (self._record(bucket) for bucket in buckets))

    def _record(self, named_tensors: NamedTensors) -> NamedTensors:
        for name, t in named_tensors:
            if self.algorithm == "auto":
                self.algorithm = "device" if t.is_cuda else "sha256"
            view = t if self.engine_view is None else self.engine_view(name, t)
            self.sent_checksums[name] = CHECKSUMS[self.algorithm](view, self.checksum_dtype)
        return named_tensors


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
