"""The FP8 GEMM guard on a host without CUDA: it stays off and the emulated path is exact."""

import torch

from miles.engines.embedded_engine.fp8_gemm import emulated_linear, fp8_gemm_available
from miles.quant.formats import dequantize, quantize


def test_cpu_stays_emulated():
    assert not fp8_gemm_available("cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.02
    x = torch.randn(5, 384, generator=g)
    q = quantize(w, "fp8")
    y = emulated_linear(x, q.parts[".weight"], q.parts[".weight_scale_inv"])
    assert torch.equal(y, torch.nn.functional.linear(x, dequantize(q)))
