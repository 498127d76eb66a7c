"""Quantized weight loading for the embedded engine (`--quantization FMT`): emulated W*A16.

Design decisions:
- The engine receives SGLang's parameter names (`X.weight` quantized, `X.weight_scale_inv`, ...;
  miles/quant/formats.PARTS) on any update path (disk, tensor payload, distributed), and
  dequantizes each weight once all its parts have arrived, with the trainer's own
  `miles.quant.dequantize`, into the fused storage in the engine dtype. Matmuls then run in that
  dtype ("emulated": exact to what an FP8/FP4 GEMM multiplies, not as fast). So the bit-exact
  contract holds by construction and `/weights_checksum` (the dequantized parameter) is what
  check_weights compares with the trainer's dequantize(quantize(w)). A fused FP8 GEMM
  (`torch._scaled_mm`) is in fp8_gemm.py, off by default.
- Parts may come in different buckets (a transport splits by dtype); they are kept, as clones
  (a flat bucket's buffer is reused), until the set is whole. `pending()` names incomplete sets.
- A `.weight` in a high-precision dtype is a kept weight (the trainer's keep-in-BF16 list) and
  loads as usual; one in float8/uint8 is the quantized data. float8 parts also arrive as raw
  bytes (uint8, same shape) from wires without float8 (gloo).
- Shapes are validated before anything is copied (`check_shape`), like every other update.
"""

from __future__ import annotations

import torch

from miles.quant.formats import (FORMATS, PARTS, QuantizedTensor, dequantize, group_size_of,
                                 part_shapes)

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


class QuantLoader:
    def __init__(self, fmt: str, weights):
        if fmt not in FORMATS:
            raise ValueError(f"--quantization: {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt, self.weights = fmt, weights
        self.suffixes = sorted(PARTS[fmt], key=len, reverse=True)  # longest first
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self.loaded = 0  # weights dequantized in since start

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
        """A part name that is not itself an engine parameter (a scale, packed data)."""
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
