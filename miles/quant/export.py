"""Quantize on export: a transport wrapper that sends each bucket in the rollout's format.

    transport = QuantizingTransport(inner, "fp8", KeepList(cfg.keep_bf16))

Design decisions:
- The seam is the transport, not the backends: FSDP and Megatron both end in
  `send_weights(transport, version, buckets of full tensors under HF names)`, so one wrapper
  (made by make_transport when `quant.rollout` is not "bf16") covers both, every transport,
  and the engines get SGLang's names (`.weight` + `.weight_scale_inv`, ...; formats.PARTS). A quantized weight's
  parts always travel in one bucket; a transport may still split them by dtype (nccl's flat
  buckets), and the engine reassembles them by name.
- The check-weights tap sits outside this wrapper and asks `engine_view(name, tensor)` for
  what the engine will hold: dequantize(quantize(w)). The quantization done for that view is
  kept for the bucket that follows (same name, same tensor object), so checking does not
  quantize twice.
- A refusal drops the rest of the buckets (the backend's `send_weights` still iterates them to
  the end: the gather is collective) and `send` raises it, before the inner transport finishes. A
  non-finite weight is refused (fp8 block, NVFP4 and INT4 cannot encode it, and a NaN weight
  should not reach a rollout in any format), as is a user keep pattern that matched nothing in a
  whole publish (a typo would silently quantize what was meant to stay BF16).
- `raw_fp8` sends float8 parts as their bytes (uint8, same shape) over process groups (gloo has
  no float8; NCCL moves bytes anyway); the engine reinterprets them (it knows its format).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

import torch

from miles.quant.formats import QuantizedTensor, check_format, dequantize, quantize
from miles.quant.keep import KeepList
from miles.weights.base import DelegatingTransport, NamedTensors, WeightTransport

log = logging.getLogger(__name__)


def module_of(name: str) -> str:
    return name.removesuffix(".weight")


def quantize_named(name: str, tensor: torch.Tensor, fmt: str, group_size: int) -> QuantizedTensor:
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"quant export: {name!r} has {bad} non-finite values; refusing to "
                         f"publish it in {fmt!r}")
    return quantize(tensor, fmt, group_size=group_size)


def wire_parts(q: QuantizedTensor, module: str, raw_fp8: bool) -> list[tuple[str, torch.Tensor]]:
    out = q.named(module)
    if raw_fp8:
        out = [(n, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in out]
    return out


class QuantizingTransport(DelegatingTransport):
    def __init__(self, inner: WeightTransport, fmt: str, keep: KeepList, *, group_size: int = 128,
                 raw_fp8: bool = False):
        self.inner = inner
        self.fmt = check_format(fmt, "quant.rollout")
        self.keep = keep
        self.group_size = group_size
        self.raw_fp8 = raw_fp8
        self._cache: dict[str, tuple[torch.Tensor, QuantizedTensor]] = {}
        self.quantize_s = 0.0        # the last publish: seconds spent quantizing
        self.quantized: list[str] = []  # the last publish: names sent quantized
        self.kept: list[str] = []       # ... and names sent as they were

    # --- the tap's view ---------------------------------------------------------------------

    def engine_view(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What the engine will hold for `name` after this publish (before its cast to the engine dtype)."""
        if not self.keep.quantizes(name, tensor):
            return tensor
        q = self._quantize(name, tensor)
        self._cache[name] = (tensor, q)
        return dequantize(q, torch.float32)  # the tap casts it to the engine dtype, as the engine does

    def _quantize(self, name: str, tensor: torch.Tensor) -> QuantizedTensor:
        t = time.perf_counter()
        q = quantize_named(name, tensor, self.fmt, self.group_size)
        self.quantize_s += time.perf_counter() - t
        return q

    # --- the transport ----------------------------------------------------------------------

    def send(self, version: int, buckets: Iterable[NamedTensors]) -> None:
        self._cache = {}
        self.quantize_s, self.quantized, self.kept = 0.0, [], []
        self.keep.reset()
        self.inner.send(version, self._quantized(buckets))
        log.info("version %d in %s: %d tensors quantized, %d kept, %.3f s quantizing", version,
                 self.fmt, len(self.quantized), len(self.kept), self.quantize_s)

    def _quantized(self, buckets: Iterable[NamedTensors]) -> Iterator[NamedTensors]:
        """Each bucket in the wire format; a refusal (here or an unused keep pattern at the end)
        is raised into the inner transport's `send`, so it never finishes a partial version."""
        for named_tensors in buckets:
            wire: NamedTensors = []
            for name, t in named_tensors:
                cached = self._cache.pop(name, None)
                if cached is not None and cached[0] is t:
                    q = cached[1]
                elif self.keep.quantizes(name, t):
                    q = self._quantize(name, t)
                else:
                    wire.append((name, t))
                    self.kept.append(name)
                    continue
                wire.extend(wire_parts(q, module_of(name), self.raw_fp8))
                self.quantized.append(name)
            yield wire
        unused = self.keep.unused()
        if unused:
            raise ValueError(f"quant.keep_bf16: {unused} matched none of the "
                             f"{len(self.quantized) + len(self.kept)} tensors published "
                             "(patterns match exactly, as a module prefix, or as a glob)")

    # --- everything else is the inner transport's (DelegatingTransport) ------------------------

    def abandon(self, version: int) -> None:
        self._cache = {}
        self.inner.abandon(version)


