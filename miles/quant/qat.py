"""INT4 quantization-aware training: fake-quant with a straight-through estimator.

    apply_int4_qat(lm, keep=KeepList(cfg.keep_bf16), fmt="int4", group_size=128,
                   export_dtype=torch.bfloat16)

Design decisions:
- The forward of every nn.Linear whose weight the exporter quantizes (the same KeepList rule)
  uses fake_int4(w) = dequantize(quantize(w.to(export_dtype))) in w's dtype: the exporter's own
  functions on the tensor the exporter will see (the backend exports in its compute dtype, which
  is the dtype the forward sees under FSDP's mixed precision). So the INT4 rollout serves exactly
  the trained values; test_qat.py checks the equality through the real exporter.
- Straight-through: the backward passes the gradient to w unchanged (d fake/d w := I). No clipping
  mask: symmetric absmax groups clip nothing, and asymmetric ones only round.
- The forward is patched on each Linear instance (not by swapping modules), so FSDP2's parameter
  bookkeeping, parameter names and the HF export are untouched; `qat_modules(lm)` lists them.
- Fused MoE experts (3-D parameters, not nn.Linear) are not covered: the exporter would quantize
  their per-expert slices without QAT, so such a model is refused here.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from miles.quant.formats import dequantize, quantize
from miles.quant.keep import KeepList


class FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, fmt: str, group_size: int, export_dtype: torch.dtype):
        q = quantize(w.detach().to(export_dtype), fmt, group_size=group_size)
        return dequantize(q, torch.float32).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


def fake_quant_ste(w: torch.Tensor, fmt: str = "int4", group_size: int = 128,
                   export_dtype: torch.dtype | None = None) -> torch.Tensor:
    return FakeQuantSTE.apply(w, fmt, group_size, export_dtype or w.dtype)


def _qat_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = fake_quant_ste(self.weight, self.qat_format, self.qat_group_size, self.qat_export_dtype)
    return F.linear(x, w, self.bias)


def apply_int4_qat(lm: nn.Module, *, keep: KeepList, fmt: str = "int4", group_size: int = 128,
                   export_dtype: torch.dtype) -> list[str]:
    """Patch the quantized Linears of an HF model (before or after fully_shard); their names."""
    if fmt not in ("int4", "int4_asym"):
        raise ValueError(f"quant.train = 'int4_qat': rollout format {fmt!r} is not int4")
    fused = [n for n, p in lm.named_parameters() if p.dim() == 3 and ".experts." in n + "."]
    if fused:
        raise ValueError(f"quant.train = 'int4_qat' does not cover fused MoE expert tensors yet "
                         f"(e.g. {fused[0]!r}): their INT4 rollout would not match training")
    patched = []
    for name, mod in lm.named_modules():
        if type(mod) is nn.Linear and keep.quantizes(f"{name}.weight", mod.weight):
            mod.qat_format, mod.qat_group_size, mod.qat_export_dtype = fmt, group_size, export_dtype
            mod.forward = types.MethodType(_qat_forward, mod)
            patched.append(name)
    if not patched:
        raise ValueError("quant.train = 'int4_qat': no nn.Linear of the model is quantized by the "
                         "keep list; nothing would be trained quantization-aware")
    keep.reset()
    return patched


def qat_modules(lm: nn.Module) -> list[str]:
    return [n for n, m in lm.named_modules() if hasattr(m, "qat_format")]
