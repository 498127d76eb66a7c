"""FP8 128x128 block-wise GEMM on CUDA (Hopper), guarded; the emulated path stays the default.

    if fp8_gemm_available(device):
        y = fp8_block_linear(x, w_fp8, w_scale_inv)   # ~= x @ dequantize(w).T

Design decisions:
- `torch.nn.functional.scaled_mm` with BlockWise1x128 activation groups (quantized on the fly,
  formats.quantize_fp8_activation: SGLang's per-token-group quant) and BlockWise128x128 weight
  blocks in DeepSeek's `weight_scale_inv` layout. Activation scales are passed outer-dim-major
  (a transposed-contiguous [M, K/128]), which the Hopper kernels require.
- Guarded by a probe, not only by capability: `fp8_gemm_available` runs one small GEMM and
  compares it with the emulated result (dequantize then matmul); any error or a mismatch beyond
  FP8 rounding disables the path, with the reason logged. The embedded engine does not call it
  from its forward yet (its matmuls use the dequantized weights); tests/gpu/test_quant_gpu.py
  checks it on an H200, and bench/quant.py times it against the BF16 matmul.
- Shapes must be multiples of 128 in N and K (the kernel's blocks); other shapes stay emulated.
"""

from __future__ import annotations

import logging

import torch

from miles.quant.formats import FP8_BLOCK, _fp8_block_dequant, quantize, quantize_fp8_activation

log = logging.getLogger(__name__)
_PROBED: dict[str, bool] = {}


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    import torch.nn.functional as F
    n, k = w.shape
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"fp8_block_linear: weight shape {list(w.shape)} is not a multiple of 128")
    lead = x.shape[:-1]
    xq, xs = quantize_fp8_activation(x.reshape(-1, k))
    xs = xs.t().contiguous().t()  # outer-dim-major
    y = F.scaled_mm(xq, w.t(), xs, F.ScalingType.BlockWise1x128, w_scale_inv.float(),
                    F.ScalingType.BlockWise128x128, bias=bias, output_dtype=out_dtype)
    return y.reshape(*lead, n)


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


def _probe(device: torch.device) -> bool:
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(256, 512, generator=g).mul(0.02).to(device)
        x = torch.randn(64, 512, generator=g).to(device, torch.bfloat16)
        q = quantize(w, "fp8")
        qw, s = q.parts[".weight"], q.parts[".weight_scale_inv"]
        fast = fp8_block_linear(x, qw, s).float()
        ref = emulated_linear(x.float(), qw, s).float()
        rel = ((fast - ref).norm() / ref.norm()).item()
        if rel > 0.05:  # activation FP8 rounding is ~2^-4 per element at worst; far below this
            log.warning("fp8 block GEMM disabled: probe differs from the emulated GEMM (rel %.3g)", rel)
            return False
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: stay emulated
        log.warning("fp8 block GEMM disabled on %s: %s", device, e)
        return False
