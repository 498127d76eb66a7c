"""Quantized weight loading for the embedded engine (`--quantization FMT`): emulated W*A16.

Design decisions:
- The engine receives SGLang's parameter names (`X.weight` quantized, `X.weight_scale_inv`, ...;
  miles/quant/formats.PARTS) on any update path (disk, tensor payload, distributed), and
  dequantizes each weight once all its parts have arrived, with the trainer's own
  `miles.quant.dequantize`, into the fused storage in the engine dtype. Matmuls then run in that
  dtype ("emulated": exact to what an FP8/FP4 GEMM multiplies, not as fast). So the bit-exact
  contract holds by construction and `/weights_checksum` (the dequantized parameter) is what
  check_weights compares with the trainer's dequantize(quantize(w)).
- `--fp8-gemm` (fp8 only; auto = on when fp8_gemm.fp8_gemm_available probes the engine's CUDA
  device in bf16): the dense linears (q|k|v, o, gate|up, down) are held as FP8 rows plus their
  128x128 `weight_scale_inv` blocks (`FP8Linear`, half the bytes of bf16; fused parts concatenated
  along N) and the forward runs fp8_gemm.fp8_block_linear for them (model.Model._linear is the one
  seam). A linear with any part's N, or its K, not a multiple of 128 stays emulated, as do
  lm_head, the embeddings, norms, the MoE router and the experts. The bf16 copy is gone, so
  `Weights.lookup` of such a weight is dequantize(FP8 rows, scales) computed on demand: the
  checksum is still the trainer's dequantize of what the engine multiplies. A high-precision
  update of such a weight (the starting bf16 checkpoint, a weight on the trainer's keep list) is
  quantized on arrival with the trainer's own `quantize` (so its checksum is that of
  fake_quantize(w), not w: use --fp8-gemm off to keep such weights exact). The choice is fixed at
  start, before CUDA graphs capture the forward; updates copy into the same storage.
- Parts may come in different buckets (a transport splits by dtype); they are kept, as clones
  (a flat bucket's buffer is reused), until the set is whole. `pending()` names incomplete sets.
- A `.weight` in a high-precision dtype is a kept weight (the trainer's keep-in-BF16 list) and
  loads as usual; one in float8/uint8 is the quantized data. float8 parts also arrive as raw
  bytes (uint8, same shape) from wires without float8 (gloo).
- Shapes are validated before anything is copied (`check_shape`), like every other update.
"""

from __future__ import annotations

import logging

import torch

from miles.quant.formats import (FORMATS, FP8_BLOCK, PARTS, QuantizedTensor, dequantize,
                                 group_size_of, part_shapes, quantize)

log = logging.getLogger(__name__)

_QUANT_DATA_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int32)
# The dtype each part must have (float8 parts may come as uint8 bytes); None: any floating dtype.
_PART_DTYPES = {
    "fp8": {".weight": torch.float8_e4m3fn, ".weight_scale_inv": None},
    "mxfp8": {".weight": torch.float8_e4m3fn, ".weight_scale": torch.uint8},
    "mxfp4": {".weight": torch.uint8, ".weight_scale": torch.uint8},
    "nvfp4": {".weight": torch.uint8, ".weight_scale": torch.float8_e4m3fn, ".weight_scale_2": None},
    "int4": {".weight_packed": torch.int32, ".weight_scale": None, ".weight_shape": torch.int32},
    "int4_asym": {".weight_packed": torch.int32, ".weight_scale": None,
                  ".weight_zero_point": torch.int32, ".weight_shape": torch.int32},
}


# The dense linears of a layer's storage (params.Weights) that --fp8-gemm may hold in FP8.
FP8_LINEARS = ("qkv_w", "o_w", "gate_up_w", "down_w")
FP8_GEMM_MODES = ("auto", "on", "off")


def fp8_gemm_for(mode: str, fmt: str | None, device: torch.device, dtype: torch.dtype):
    """The FP8 GEMM to run the dense linears with (fp8_gemm.fp8_block_linear), or None.

    auto: on when --quantization fp8, a CUDA device, --dtype bfloat16 and the probe passes;
    on: the same, but anything missing is an error naming it; off: None."""
    if mode not in FP8_GEMM_MODES:
        raise ValueError(f"--fp8-gemm: {mode!r} is not one of {', '.join(FP8_GEMM_MODES)}")
    if mode == "off":
        return None
    from miles.engines.embedded_engine.fp8_gemm import fp8_block_linear, fp8_gemm_available
    device = torch.device(device)
    why = None
    if fmt != "fp8":
        why = f"needs --quantization fp8 (got {fmt or 'none'})"
    elif device.type != "cuda":
        why = f"needs a CUDA device (this engine runs on {device})"
    elif dtype != torch.bfloat16:
        why = f"needs --dtype bfloat16 (got {str(dtype).removeprefix('torch.')})"
    elif not fp8_gemm_available(device):
        why = f"the FP8 block GEMM probe failed on {device} (its warning above says why)"
    if why is None:
        return fp8_block_linear
    if mode == "on":
        raise ValueError(f"--fp8-gemm on: {why}")
    if fmt == "fp8":
        log.info("FP8 GEMM off (--fp8-gemm auto): %s; fp8 weights are dequantized, matmuls emulated", why)
    return None


class FP8Linear:
    """One fused dense linear in FP8: `weight` [N, K] e4m3 and `scale_inv` [N/128, K/128] fp32
    (DeepSeek's layout); the rows of the checkpoint weights it fuses are concatenated along N.
    Called like F.linear; `gemm` is fp8_gemm.fp8_block_linear (a test may pass a stand-in)."""

    def __init__(self, rows: int, cols: int, device: torch.device, gemm):
        self.weight = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        self.scale_inv = torch.ones(rows // FP8_BLOCK, cols // FP8_BLOCK, dtype=torch.float32,
                                    device=device)
        self.gemm = gemm

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale_inv.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.gemm(x, self.weight, self.scale_inv)
        return y if bias is None else y + bias


class FP8Rows:
    """Rows [start, start + n) of an FP8Linear: one checkpoint weight (q_proj, gate_proj, ...)."""

    def __init__(self, linear: FP8Linear, start: int, n: int):
        self.linear, self.start, self.n = linear, start, n
        self.weight = linear.weight[start:start + n]
        self.scale_inv = linear.scale_inv[start // FP8_BLOCK:(start + n) // FP8_BLOCK]

    def store(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.weight.copy_(weight)
        self.scale_inv.copy_(scale_inv)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The trainer's dequantize of these rows: what the emulated engine would hold."""
        parts = {".weight": self.weight, ".weight_scale_inv": self.scale_inv}
        return dequantize(QuantizedTensor("fp8", tuple(self.weight.shape), parts), dtype)


def hold_fp8(weights, gemm) -> tuple[list[str], list[str]]:
    """Replace each eligible dense linear of `weights` by an FP8Linear; returns (the checkpoint
    names now held in FP8, the fused linears that stay in the engine dtype because a part's N or
    the K is not a multiple of 128). Call before any weight is loaded."""
    held, emulated = [], []
    parts_of: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, view in weights.names.items():
        parts_of.setdefault(id(view if view._base is None else view._base), []).append((name, view))
    for i, L in enumerate(weights.layers):
        for key in FP8_LINEARS:
            fused = L.get(key)
            if fused is None:
                continue
            parts = parts_of.get(id(fused), [])
            n, k = fused.shape
            starts = [view.storage_offset() // k for _, view in parts]
            if (not parts or k % FP8_BLOCK or any(view.shape[0] % FP8_BLOCK for _, view in parts)
                    or sum(view.shape[0] for _, view in parts) != n):
                emulated.append(f"model.layers.{i}.{key}")
                continue
            linear = FP8Linear(n, k, fused.device, gemm)
            L[key] = linear
            for (name, view), start in zip(parts, starts):
                weights.fp8[name] = FP8Rows(linear, start, view.shape[0])
                # shape and dtype only (what shape checks read); the storage is the FP8 rows
                weights.names[name] = torch.empty(view.shape, dtype=view.dtype, device="meta")
                held.append(name)
    return held, emulated


class QuantLoader:
    def __init__(self, fmt: str, weights, gemm=None):
        """`gemm` (fp8 only, from fp8_gemm_for): hold the dense linears in FP8 and run it on them."""
        if fmt not in FORMATS:
            raise ValueError(f"--quantization: {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt, self.weights = fmt, weights
        self.suffixes = sorted(PARTS[fmt], key=len, reverse=True)  # longest first
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self.loaded = 0  # weights dequantized in since start
        self.fp8_held: list[str] = []
        if gemm is not None:
            if fmt != "fp8":
                raise ValueError(f"--fp8-gemm: needs --quantization fp8, not {fmt}")
            self.fp8_held, emulated = hold_fp8(weights, gemm)
            mib = sum(lin.nbytes() for lin in {id(r.linear): r.linear
                                               for r in weights.fp8.values()}.values()) / 2**20
            log.info("FP8 GEMM in use (fp8 block-wise 1x128 x 128x128): %d dense weights held as "
                     "FP8 + weight_scale_inv (%.1f MiB); emulated (N or K not a multiple of 128): "
                     "%s; lm_head, embeddings, norms, router and MoE experts stay in %s",
                     len(self.fp8_held), mib, ", ".join(emulated) or "none",
                     str(weights.dtype).removeprefix("torch."))

    def part(self, name: str, dtype: torch.dtype | None = None) -> tuple[str, str] | None:
        """(module, suffix) when `name` is a quantized part of a 2-D engine weight, else None.
        A `.weight` counts only with a quantized dtype (or, with no dtype, for shape checks)."""
        for suffix in self.suffixes:
            if name.endswith(suffix):
                module = name[:-len(suffix)]
                base = self.weights.names.get(module + ".weight")
                if base is None or base.dim() != 2:
                    return None
                if suffix == ".weight" and dtype is not None and dtype not in _QUANT_DATA_DTYPES:
                    return None
                return module, suffix
        return None

    def owns(self, name: str) -> bool:
        """A part name that is not itself an engine parameter (a scale, packed data), or a weight
        held in FP8 (no storage a transfer could write into directly)."""
        if name in self.weights.fp8:
            return True
        got = self.part(name)
        return got is not None and got[1] != ".weight"

    def check_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        """True when `name` is a quantized part (raising if `shape` is wrong), False otherwise."""
        got = self.part(name)
        if got is None:
            return False
        module, suffix = got
        base = tuple(self.weights.names[module + ".weight"].shape)
        shape = tuple(shape)
        if self.fmt.startswith("int4"):
            # The group size is the trainer's (quant.int4_group_size); the rows are fixed here,
            # and the load checks the rest against weight_shape (formats.group_size_of).
            ok = {".weight_packed": shape[:1] == base[:1] and len(shape) == 2
                  and shape[1] * 8 >= base[1],
                  ".weight_scale": shape[:1] == base[:1] and len(shape) == 2,
                  ".weight_zero_point": len(shape) == 2 and shape[0] * 8 >= base[0],
                  ".weight_shape": shape == (2,)}[suffix]
            if not ok:
                raise ValueError(f"weight {name!r}: shape {list(shape)} does not fit {self.fmt} "
                                 f"parts of the engine's {list(base)}")
            return True
        want = part_shapes(self.fmt, base)[suffix]
        if suffix == ".weight" and shape == base:
            return True  # fp8 / mxfp8 data, or a kept high-precision weight
        if shape != tuple(want):
            raise ValueError(f"weight {name!r}: shape {list(shape)} != {list(want)} for {self.fmt} "
                             f"parts of the engine's {list(base)}")
        return True

    def copy_in(self, name: str, tensor: torch.Tensor) -> bool:
        """Take a part (True), or leave `name` to the plain copy (False)."""
        rows = self.weights.fp8.get(name)
        if rows is not None and tensor.dtype not in _QUANT_DATA_DTYPES:
            # a high-precision weight for an FP8-held linear: quantized on arrival, from the engine
            # dtype (what the emulated engine would hold; the trainer's bf16 export)
            if tuple(tensor.shape) != tuple(rows.weight.shape):
                raise ValueError(f"weight {name!r}: shape {list(tensor.shape)} != the engine's "
                                 f"{list(rows.weight.shape)}")
            q = quantize(tensor.to(rows.weight.device, self.weights.dtype), "fp8")
            rows.store(q.parts[".weight"], q.parts[".weight_scale_inv"])
            return True
        got = self.part(name, tensor.dtype)
        if got is None:
            return False
        module, suffix = got
        want = _PART_DTYPES[self.fmt][suffix]
        t = tensor
        if want is None:
            if not t.is_floating_point():
                raise ValueError(f"weight {name!r}: dtype {t.dtype} is not a floating-point scale")
        elif t.dtype != want:
            if want == torch.float8_e4m3fn and t.dtype == torch.uint8:
                t = t.view(torch.float8_e4m3fn)  # raw bytes from a wire without float8
            else:
                raise ValueError(f"weight {name!r}: dtype {t.dtype} != {want} for {self.fmt}")
        parts = self._parts.setdefault(module, {})
        parts[suffix] = t.detach().clone()
        if len(parts) == len(PARTS[self.fmt]):
            self._load(module, self._parts.pop(module))
        return True

    def _load(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        rows = self.weights.fp8.get(module + ".weight")
        if rows is not None:  # kept as it came: the FP8 GEMM multiplies these bytes
            rows.store(parts[".weight"], parts[".weight_scale_inv"])
            self.loaded += 1
            return
        dst = self.weights.names[module + ".weight"]
        device = dst.device
        parts = {k: v.to(device) for k, v in parts.items()}
        group = group_size_of(parts) if self.fmt.startswith("int4") else 128
        if self.fmt.startswith("int4"):
            shape = tuple(int(v) for v in parts[".weight_shape"].tolist())
            if shape != tuple(dst.shape):
                raise ValueError(f"weight {module}.weight_shape: {list(shape)} != the engine's "
                                 f"{list(dst.shape)}")
        q = QuantizedTensor(self.fmt, tuple(dst.shape), parts, group)
        dst.copy_(dequantize(q, dst.dtype))
        self.loaded += 1

    def pending(self) -> list[str]:
        return sorted(self._parts)
