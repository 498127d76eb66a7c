"""FP8 128x128 block-wise GEMM on CUDA (Hopper), guarded; the emulated path stays the default.

    if fp8_gemm_available(device):
        y = fp8_block_linear(x, w_fp8, w_scale_inv)   # ~= x @ dequantize(w).T

Design decisions:
- `torch.nn.functional.scaled_mm` with BlockWise1x128 activation groups (quantized on the fly,
  formats.quantize_fp8_activation: SGLang's per-token-group quant) and BlockWise128x128 weight
  blocks from DeepSeek's `weight_scale_inv` [N/128, K/128]. The layouts are cuBLASLt's, as
  torch's _scaled_mm checks them (ScaledBlas.cpp, `_scaled_block1x128_block128x128`):
  mat_a [M, K] row-major; mat_b [K, N] column-major (the weight [N, K] transposed, a view);
  scale_a [M, K/128] with strides (1, M) (outer-dim-major: a transposed-contiguous copy);
  scale_b [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4: `weight_scale_inv`
  zero-padded to L4 columns and transposed (a view), so its rows stay 16-byte aligned.
- Rows are zero-padded to a multiple of 16 (the scale_a stride M then keeps 16-byte alignment
  as well) and cropped off the result; a zero row quantizes to zeros and changes nothing else.
- Guarded by a probe, not only by capability: `fp8_gemm_available` runs one small GEMM whose
  blocks differ in magnitude (a misplaced scale cannot hide) and with padded rows and scales,
  and compares it with `emulated_block_linear` (the same activation quantization in fp32); any
  error, or a difference beyond the bf16 output rounding, disables the path, with the reason
  logged. The embedded engine runs it for its dense linears under --fp8-gemm (quantized.py);
  tests/gpu/test_quant_gpu.py checks it on an H200, and bench/quant.py times it against the
  BF16 matmul. Nothing in it syncs with the host, so CUDA graphs capture it.
- Shapes must be multiples of 128 in N and K (the kernel's blocks); other shapes stay emulated.
"""

from __future__ import annotations

import logging

import torch

from miles.quant.formats import FP8_BLOCK, _fp8_block_dequant, quantize, quantize_fp8_activation

log = logging.getLogger(__name__)
_PROBED: dict[str, bool] = {}
_ROW_ALIGN = 16


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    import torch.nn.functional as F
    n, k = w.shape
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"fp8_block_linear: weight shape {list(w.shape)} is not a multiple of 128")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m % _ROW_ALIGN:
        x2 = F.pad(x2, (0, 0, 0, _ROW_ALIGN - m % _ROW_ALIGN))
    xq, xs = quantize_fp8_activation(x2)
    xs = xs.t().contiguous().t()  # [M, K/128], strides (1, M)
    if bias is not None:
        bias = bias.to(out_dtype)
    y = F.scaled_mm(xq, w.contiguous().t(), xs, F.ScalingType.BlockWise1x128,
                    weight_scales_for_gemm(w_scale_inv), F.ScalingType.BlockWise128x128,
                    bias=bias, output_dtype=out_dtype)
    return y[:m].reshape(*lead, n)


def weight_scales_for_gemm(w_scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek's [N/128, K/128] `weight_scale_inv` as cuBLASLt's 128x128 scale_b: [L4, N/128]
    with strides (1, L4), L4 = K/128 rounded up to a multiple of 4 (the padding is never read)."""
    s = w_scale_inv.float().contiguous()
    pad = -s.shape[1] % 4
    if pad:
        s = torch.nn.functional.pad(s, (0, pad))
    return s.t()


def emulated_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    wd = _fp8_block_dequant(w, w_scale_inv).to(x.dtype)
    return torch.nn.functional.linear(x, wd, bias)


def fp8_gemm_available(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    key = str(device)
    if key not in _PROBED:
        _PROBED[key] = _probe(device)
    return _PROBED[key]


def emulated_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """What fp8_block_linear computes, in fp32 on any device: the activations quantized per 1x128
    group the same way, the weight dequantized, one fp32 matmul. The kernel differs from it only
    by its summation order and the rounding of its output to bf16."""
    k = w.shape[1]
    xq, xs = quantize_fp8_activation(x.reshape(-1, k))
    xd = (xq.float().view(-1, k // FP8_BLOCK, FP8_BLOCK) * xs.unsqueeze(-1)).view(-1, k)
    return emulated_linear(xd, w, w_scale_inv).reshape(*x.shape[:-1], w.shape[0])


def block_scaled_inputs(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] and activations [rows, k] whose 128x128 blocks and 1x128 groups differ in
    magnitude by powers of two (1/8 .. 8), so a scale read from the wrong block shows up as a
    large error instead of hiding among blocks of the same amax."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = n // FP8_BLOCK, -(-k // FP8_BLOCK)
    wf = 2.0 ** ((torch.arange(bn).view(-1, 1) * 3 + torch.arange(bk)) % 7 - 3).float()
    xf = 2.0 ** ((torch.arange(rows).view(-1, 1) * 2 + torch.arange(bk)) % 5 - 2).float()
    w = torch.randn(n, k, generator=g) * 0.02 * wf.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:, :k]
    x = torch.randn(rows, k, generator=g) * xf.repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return w, x


# fast vs emulated_block_linear: the bf16 output rounding is <= 2^-8 relative per element (about
# 2e-3 as a norm), the fp32 summation order far less; a scale read from the wrong block is off by
# a factor of 2 to 64 on block_scaled_inputs (a relative error near 1).
PROBE_REL_TOL = 0.01


def _probe(device: torch.device) -> bool:
    try:
        # K = 640: five K blocks, so scale_b is padded to L4 = 8; 40 rows are padded to 48
        w, x = block_scaled_inputs(256, 640, 40)
        q = quantize(w.to(device), "fp8")
        qw, s = q.parts[".weight"], q.parts[".weight_scale_inv"]
        xb = x.to(device, torch.bfloat16)
        fast = fp8_block_linear(xb, qw, s).float()
        ref = emulated_block_linear(xb, qw, s)
        rel = ((fast - ref).norm() / ref.norm()).item()
        if not rel <= PROBE_REL_TOL:
            log.warning("fp8 block GEMM disabled on %s: the probe differs from the emulated GEMM "
                        "(relative error %.3g > %g)", device, rel, PROBE_REL_TOL)
            return False
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: stay emulated
        log.warning("fp8 block GEMM disabled on %s: %s", device, e)
        return False
