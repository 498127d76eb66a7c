"""Regenerate tests/quant/data/torchao_ref.safetensors with torchao's reference quantizers.

    pip install torchao==0.18.0 && python tests/quant/make_torchao_ref.py

torchao is not a dependency of Miles (importing it changes what transformers loads), so its
outputs are pinned here once: test_formats.py compares our quantizers with these bytes, and
with torchao itself when it is importable.
"""

from pathlib import Path

import torch


def reference_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(16, 128, generator=g) * torch.logspace(-4, 4, 128)  # every exponent range
    edge = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 448.0, 500.0,
                         1e-40, -1e-42, 2.0 ** -126] * 8).reshape(4, 32)  # ties, saturation, subnormals
    return {"wide": wide, "edge": edge, "zeros": torch.zeros(2, 64)}


def torchao_outputs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    out = {}
    for key, t in x.items():
        for fmt, dt in (("mxfp8", torch.float8_e4m3fn), ("mxfp4", torch.float4_e2m1fn_x2)):
            s, d = to_mx(t.contiguous(), dt, 32)
            out[f"{key}.{fmt}.scale"] = s.view(torch.uint8)
            out[f"{key}.{fmt}.data"] = d.view(torch.uint8)
        if key != "zeros":
            pts = per_tensor_amax_to_scale(t.abs().amax())
            s, d = nvfp4_quantize(t.contiguous(), 16, pts)
            out[f"{key}.nvfp4.scale"] = s.view(torch.uint8)
            out[f"{key}.nvfp4.data"] = d.view(torch.uint8)
            out[f"{key}.nvfp4.scale_2"] = pts.float().reshape(())
    return out


if __name__ == "__main__":
    from safetensors.torch import save_file
    x = reference_inputs()
    save_file({**{f"input.{k}": v for k, v in x.items()}, **torchao_outputs(x)},
              str(Path(__file__).with_name("data") / "torchao_ref.safetensors"))
