"""Reference quantizers: one contract, pure torch functions, bit-exact by construction.

    q = quantize(w, "fp8")            # QuantizedTensor: fmt, shape, parts {suffix: tensor}
    w8 = dequantize(q, torch.bfloat16)  # what the rollout engine computes with
    q.named("model.layers.0.mlp.up_proj")  # [(".weight", fp8), (".weight_scale_inv", fp32)], full names

Formats (all quantize 2-D weights [out, in] along the input dim, the GEMM's contraction axis):

| fmt       | elements              | blocks            | scale                       | parts (SGLang names)        |
|-----------|-----------------------|-------------------|-----------------------------|-----------------------------|
| fp8       | E4M3 (float8_e4m3fn)  | 128x128           | fp32 `weight_scale_inv`     | weight, weight_scale_inv    |
| mxfp8     | E4M3                  | 1x32              | E8M0 (uint8) `weight_scale` | weight, weight_scale        |
| mxfp4     | E2M1, 2 per byte      | 1x32              | E8M0 (uint8)                | weight, weight_scale        |
| nvfp4     | E2M1, 2 per byte      | 1x16              | E4M3 block + fp32 tensor    | weight, weight_scale, weight_scale_2 |
| int4      | int4, 8 per int32     | 1xG (G=128)       | fp32 per group, symmetric   | weight_packed, weight_scale, weight_shape |
| int4_asym | uint4, 8 per int32    | 1xG               | fp32 + uint4 zero point     | ... + weight_zero_point     |

Design decisions:
- `dequantize` computes in fp32 and casts once at the end, so the trainer's check
  (dequantize(q, fp32).to(dtype)) and the engine's load (dequantize(q, dtype)) are the same bits.
- Device-independent: a CUDA trainer and a CPU engine (or the reverse) compute the same bits.
  Every op is exact or correctly rounded in fp32 (abs, amax, IEEE division and multiplication,
  round-half-even casts); scales divide by tensors, never by Python numbers (see `_div`).
- FP8 block-wise is DeepSeek-V3's / SGLang's checkpoint layout: `weight_scale_inv` is the
  multiplier (w = q * s), [ceil(N/128), ceil(K/128)]; s = max(amax, 1e-10) / 448 and q =
  clamp(x / s, +-448) cast with round-to-nearest-even. Partial edge blocks take their amax over
  the elements they have; the data keeps its shape.
- MX follows the OCP MX v1.0 "minimally supported" scale (torchao's FLOOR mode): X = 2^(floor(
  log2(amax)) - emax_elem), read off amax's fp32 exponent bits, clamped to E8M0's range; a block
  holding a NaN gets the NaN scale 0xFF, so it dequantizes to NaN (the spec's rule). Elements
  are x / X saturated to the element's max (448 for E4M3, 6 for E2M1), rounded to nearest even.
- NVFP4 follows NVIDIA's two-level recipe as torchao implements it: tensor scale
  S = amax / (448 * 6) (`weight_scale_2`), block scale (amax_b / 6) / S rounded to E4M3
  (`weight_scale`, clamped to [2^-6, 448]), elements x * ((1 / S) / block) (a reciprocal
  multiply, as the kernels do).
- E2M1 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (+ sign bit 8); element 2k goes in the low nibble of
  byte k (torchao's pack_uint4, ModelOpt's checkpoints).
- INT4 uses compressed-tensors' pack-quantized layout (what SGLang's W4A16 loaders read): int32
  words holding 8 nibbles along the input dim, element 8k+j at bits 4j; `weight_shape` holds the
  original [out, in]; an asymmetric zero point is packed the same way along the output dim.
  Symmetric: s = amax / 7, q = clamp(round(x / s), -8, 7) (stored as q + 8). Asymmetric:
  s = (max - min) / 15, z = clamp(round(-min / s), 0, 15), q = clamp(round(x / s) + z, 0, 15).
  Scales are fp32 (compressed-tensors stores the model dtype; fp32 loses nothing and is
  converted by a loader that wants otherwise). round() is round-half-even.
- A last dim that is not a multiple of the block is zero-padded to one for MX, NV and INT4; the
  packed data and scales keep the padded width and `dequantize` crops back to `shape`.
- Non-finite weights have no encoding in fp8 block / NVFP4 / INT4; `quantize` does not check
  (it is a pure function), the exporter refuses them (export.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FORMATS = ("fp8", "mxfp8", "mxfp4", "nvfp4", "int4", "int4_asym")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
MX_BLOCK = 32
NV_BLOCK = 16
INT4_GROUP = 128
_E4M3_EPS = 2.0 ** -6           # smallest normal E4M3: NVFP4's block-scale floor (torchao)
_F32_MIN_NORMAL = 2.0 ** -126
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2

# Which parts each format writes, as suffixes of the module name (".weight" is the quantized data).
PARTS: dict[str, tuple[str, ...]] = {
    "fp8": (".weight", ".weight_scale_inv"),
    "mxfp8": (".weight", ".weight_scale"),
    "mxfp4": (".weight", ".weight_scale"),
    "nvfp4": (".weight", ".weight_scale", ".weight_scale_2"),
    "int4": (".weight_packed", ".weight_scale", ".weight_shape"),
    "int4_asym": (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape"),
}


@dataclass
class QuantizedTensor:
    """A quantized 2-D weight: its format, original shape, and parts by name suffix."""
    fmt: str
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    group_size: int = INT4_GROUP  # int4 only

    def named(self, module: str) -> list[tuple[str, torch.Tensor]]:
        """The parts under full checkpoint names: `module` + suffix, in PARTS order."""
        return [(module + s, self.parts[s]) for s in PARTS[self.fmt]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def check_format(fmt: str, where: str = "quant format") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{where}: {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def _check_weight(t: torch.Tensor, fmt: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"quantize({fmt!r}): expected a 2-D weight [out, in], got shape {list(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"quantize({fmt!r}): expected a floating-point tensor, got {t.dtype}")


def quantize(t: torch.Tensor, fmt: str, *, group_size: int = INT4_GROUP) -> QuantizedTensor:
    check_format(fmt)
    _check_weight(t, fmt)
    x = t.detach().float()
    shape = tuple(t.shape)
    if fmt == "fp8":
        q, s = _fp8_block(x)
        return QuantizedTensor(fmt, shape, {".weight": q, ".weight_scale_inv": s})
    if fmt in ("mxfp8", "mxfp4"):
        q, s = _mx(x, fmt)
        return QuantizedTensor(fmt, shape, {".weight": q, ".weight_scale": s})
    if fmt == "nvfp4":
        q, s, s2 = _nvfp4(x)
        return QuantizedTensor(fmt, shape, {".weight": q, ".weight_scale": s, ".weight_scale_2": s2})
    if group_size < 1 or group_size % 8:
        raise ValueError(f"quant.int4_group_size: {group_size} must be a positive multiple of 8")
    parts = _int4(x, group_size, symmetric=fmt == "int4")
    parts[".weight_shape"] = torch.tensor(shape, dtype=torch.int32)
    return QuantizedTensor(fmt, shape, parts, group_size)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    p = q.parts
    if q.fmt == "fp8":
        out = _fp8_block_dequant(p[".weight"], p[".weight_scale_inv"])
    elif q.fmt in ("mxfp8", "mxfp4"):
        out = _mx_dequant(p[".weight"], p[".weight_scale"], q.fmt)
    elif q.fmt == "nvfp4":
        out = _nvfp4_dequant(p[".weight"], p[".weight_scale"], p[".weight_scale_2"])
    elif q.fmt in ("int4", "int4_asym"):
        out = _int4_dequant(p, q.group_size, symmetric=q.fmt == "int4")
    else:
        raise ValueError(check_format(q.fmt))
    return out[..., :q.shape[-1]].reshape(q.shape).to(dtype)


def fake_quantize(t: torch.Tensor, fmt: str, *, group_size: int = INT4_GROUP) -> torch.Tensor:
    """dequantize(quantize(t)) in t's dtype: what the engine will hold for `t`."""
    return dequantize(quantize(t, fmt, group_size=group_size), t.dtype)


def part_shapes(fmt: str, shape: tuple[int, ...], group_size: int = INT4_GROUP) -> dict[str, tuple[int, ...]]:
    """The shape of each part for a weight of `shape` (what an engine validates before loading)."""
    n, k = shape
    if fmt == "fp8":
        return {".weight": (n, k), ".weight_scale_inv": (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))}
    if fmt in ("mxfp8", "mxfp4", "nvfp4"):
        block = NV_BLOCK if fmt == "nvfp4" else MX_BLOCK
        kp = -(-k // block) * block
        out = {".weight": (n, kp if fmt == "mxfp8" else kp // 2), ".weight_scale": (n, kp // block)}
        if fmt == "nvfp4":
            out[".weight_scale_2"] = ()
        return out
    kp = -(-k // group_size) * group_size
    out = {".weight_packed": (n, kp // 8), ".weight_scale": (n, kp // group_size), ".weight_shape": (2,)}
    if fmt == "int4_asym":
        out[".weight_zero_point"] = (-(-n // 8), kp // group_size)
    return out


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c, correctly rounded on every device. CUDA computes `tensor / python_number` as a
    multiplication by the rounded reciprocal (one ulp off for about half of all inputs), while the
    CPU divides; dividing by a tensor is IEEE division on both, so the scales are the same bits."""
    return t / torch.full_like(t, c)


# ---- FP8 E4M3, 128x128 blocks (DeepSeek / SGLang) ----------------------------------------------

def _pad_to(x: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    n, k = x.shape
    if n == rows and k == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - k, 0, rows - n), value=value)


def _fp8_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = x.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    blocks = _pad_to(x, bn * FP8_BLOCK, bk * FP8_BLOCK).view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10)
    s = _div(amax, E4M3_MAX)
    full = s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    q = (x / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def _fp8_block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    full = s.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return q.float() * full


def quantize_fp8_activation(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x`group` FP8 groups along the last dim (SGLang's per_token_group_quant_fp8):
    (q e4m3 like x, fp32 scales [..., ceil(K / group)]), x ~= q * scale."""
    k = x.shape[-1]
    g = -(-k // group)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, g * group - k)) if g * group != k else xf
    amax = padded.reshape(*x.shape[:-1], g, group).abs().amax(-1).clamp(min=1e-10)
    s = _div(amax, E4M3_MAX)
    q = (xf / s.repeat_interleave(group, -1)[..., :k]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), s


# ---- E2M1 ----------------------------------------------------------------------------------------

def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already scaled) -> E2M1 codes in uint8 (0..15), saturating, round-half-to-even.
    NaN maps to 0: a NaN block's scale carries the NaN (MX) or the exporter refuses it."""
    a = x.abs().clamp(max=E2M1_MAX)
    mids = _E2M1_MIDPOINTS.to(a.device)
    down = torch.bucketize(a, mids, right=False)  # a tie stays on the lower code
    up = torch.bucketize(a, mids, right=True)     # a tie goes to the upper code
    code = torch.where(down % 2 == 0, down, up)   # codes differ only on ties: take the even one
    code = torch.where(torch.isnan(a), torch.zeros_like(code), code)
    sign = (torch.signbit(x) & ~torch.isnan(x)).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = _E2M1_GRID.to(codes.device)
    c = codes.to(torch.int64)
    v = grid[c & 7]
    return torch.where((c & 8) != 0, -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# ---- MX (OCP): E8M0 shared scale per 32 elements -----------------------------------------------

def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n, k = x.shape
    kp = -(-k // block) * block
    return _pad_to(x, n, kp).view(n, kp // block, block)


def _mx(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    emax, max_pos = (8, E4M3_MAX) if fmt == "mxfp8" else (2, E2M1_MAX)
    b = _blocks(x, MX_BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127   # floor(log2(amax)) for a normal amax
    biased = (exp - emax).clamp(-127, 128) + 127
    biased = torch.where(torch.isnan(amax), torch.full_like(biased, 255), biased)
    scale = (biased.to(torch.int32) << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
    y = b / scale
    n = x.shape[0]
    if fmt == "mxfp8":
        q = y.clamp(-max_pos, max_pos).to(torch.float8_e4m3fn).reshape(n, -1)
    else:
        q = pack_nibbles(e2m1_codes(y).reshape(n, -1))
    return q, biased.squeeze(-1).to(torch.uint8)


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """E8M0 (uint8) -> fp32: 2^(b - 127); 0 -> 2^-127 (an fp32 subnormal); 255 -> NaN."""
    b = biased.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _mx_dequant(q: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    n = q.shape[0]
    vals = q.float() if fmt == "mxfp8" else e2m1_values(unpack_nibbles(q))
    vals = vals.reshape(n, -1, MX_BLOCK)
    return (vals * e8m0_to_float(scale.view(torch.uint8)).unsqueeze(-1)).reshape(n, -1)


# ---- NVFP4: E2M1, 16-element E4M3 block scale, fp32 tensor scale ------------------------------

def _nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = x.abs().amax()
    s2 = _div(amax, E4M3_MAX * E2M1_MAX)
    if s2 == 0:  # an all-zero tensor: any positive scale encodes it exactly
        s2 = torch.ones((), device=x.device)
    b = _blocks(x, NV_BLOCK)
    block = _div(b.abs().amax(-1), E2M1_MAX)
    s = (block / s2).clamp(_E4M3_EPS, E4M3_MAX).to(torch.float8_e4m3fn)
    y = b * ((torch.ones_like(s2) / s2) / s.float()).unsqueeze(-1)
    q = pack_nibbles(e2m1_codes(y.clamp(-E2M1_MAX, E2M1_MAX)).reshape(x.shape[0], -1))
    return q, s, s2.reshape(())


def _nvfp4_dequant(q: torch.Tensor, s: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    vals = e2m1_values(unpack_nibbles(q)).reshape(n, -1, NV_BLOCK)
    scale = s.view(torch.float8_e4m3fn).float() * s2.float()
    return (vals * scale.unsqueeze(-1)).reshape(n, -1)


# ---- INT4 group-wise (compressed-tensors pack-quantized) ---------------------------------------

def pack_int4_words(nibbles: torch.Tensor, dim: int) -> torch.Tensor:
    """uint4 values (0..15, any int dtype) -> int32 words of 8 along `dim` (zero-padded)."""
    v = nibbles.to(torch.int64).movedim(dim, -1)
    pad = -v.shape[-1] % 8
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim)


def unpack_int4_words(words: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    v = ((w.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[..., :count]
    return v.movedim(-1, dim)


def _int4(x: torch.Tensor, group: int, *, symmetric: bool) -> dict[str, torch.Tensor]:
    n, k = x.shape
    g = _blocks(x, group)
    if symmetric:
        s = _div(g.abs().amax(-1, keepdim=True), 7.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(g / s).clamp(-8, 7) + 8
        parts = {}
    else:
        lo = g.amin(-1, keepdim=True).clamp(max=0.0)   # the range always holds 0 (exact zeros)
        hi = g.amax(-1, keepdim=True).clamp(min=0.0)
        s = _div(hi - lo, 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        z = torch.round(-lo / s).clamp(0, 15)
        q = (torch.round(g / s) + z).clamp(0, 15)
        parts = {".weight_zero_point": pack_int4_words(z.squeeze(-1), dim=0)}
    return {".weight_packed": pack_int4_words(q.reshape(n, -1), dim=1),
            ".weight_scale": s.squeeze(-1).contiguous(), **parts}


def _int4_dequant(p: dict[str, torch.Tensor], group: int, *, symmetric: bool) -> torch.Tensor:
    scale = p[".weight_scale"].float()
    n, groups = scale.shape
    q = unpack_int4_words(p[".weight_packed"], 1, groups * group).float().view(n, groups, group)
    if symmetric:
        z = torch.full((n, groups, 1), 8.0, device=q.device)
    else:
        z = unpack_int4_words(p[".weight_zero_point"], 0, n).float().unsqueeze(-1)
    return ((q - z) * scale.unsqueeze(-1)).reshape(n, -1)


def group_size_of(parts: dict[str, torch.Tensor]) -> int:
    """An int4 weight's group size, from its parts (the engine is not told it separately)."""
    shape = [int(v) for v in parts[".weight_shape"].tolist()]
    groups = parts[".weight_scale"].shape[1]
    packed_k = parts[".weight_packed"].shape[1] * 8
    if groups < 1 or packed_k % groups:
        raise ValueError(f"int4 parts: weight_packed width {packed_k} is not a multiple of the "
                         f"{groups} scale groups (weight_shape {shape})")
    g = packed_k // groups
    if math.ceil(shape[1] / g) != groups:
        raise ValueError(f"int4 parts: group size {g} does not tile weight_shape {shape} into {groups} groups")
    return g
