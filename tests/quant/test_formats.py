"""The reference quantizers against their published definitions, bit for bit.

- MXFP8 / MXFP4 / NVFP4 against torchao 0.18's reference implementations (to_mx in FLOOR mode,
  nvfp4_quantize with a per-tensor scale): bytes pinned in data/torchao_ref.safetensors by
  make_torchao_ref.py, and compared live when torchao is importable.
- The OCP MX v1.0 rules by hand: E8M0 scale = floor(log2 amax) - emax, E2M1's grid and
  round-half-to-even ties, saturation, zeros, NaN blocks.
- FP8 128x128 against DeepSeek-V3's `weight_dequant` definition (w = q * s per block) and
  SGLang's per-token-group activation quant; INT4 against compressed-tensors' pack layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miles.quant import formats as F
from miles.quant.formats import FORMATS, dequantize, fake_quantize, part_shapes, quantize

REF = Path(__file__).with_name("data") / "torchao_ref.safetensors"


def _ref():
    from safetensors.torch import load_file
    return load_file(str(REF))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("key", ["wide", "edge", "zeros"])
def test_matches_torchao_reference_bytes(fmt, key):
    ref = _ref()
    if f"{key}.{fmt}.data" not in ref:
        pytest.skip("torchao's nvfp4 needs a nonzero per-tensor amax")
    q = quantize(ref[f"input.{key}"], fmt)
    assert torch.equal(q.parts[".weight"].view(torch.uint8), ref[f"{key}.{fmt}.data"])
    assert torch.equal(q.parts[".weight_scale"].view(torch.uint8), ref[f"{key}.{fmt}.scale"])
    if fmt == "nvfp4":
        assert q.parts[".weight_scale_2"].item() == ref[f"{key}.nvfp4.scale_2"].item()


def test_matches_torchao_live_when_installed():
    pytest.importorskip("torchao")
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from make_torchao_ref import reference_inputs, torchao_outputs
    x = reference_inputs()
    live, pinned = torchao_outputs(x), _ref()
    assert all(torch.equal(live[k], pinned[k]) for k in live)


def test_e2m1_grid_and_ties_to_even():
    x = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0,
                      7.0, 1e9, -0.25, -5.0, -0.0, 0.26, 4.9, 5.1])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 3.0, 4.0, 4.0, 4.0, 6.0,
            6.0, 6.0, -0.0, -4.0, -0.0, 0.5, 4.0, 6.0]
    got = F.e2m1_values(F.e2m1_codes(x))
    assert got.tolist() == want
    assert F.e2m1_codes(torch.tensor([-0.0])).item() == 8  # sign kept on negative zero
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(F.unpack_nibbles(F.pack_nibbles(codes)), codes)
    assert F.pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # low nibble first


def test_mx_scale_is_ocp_floor_and_elements_saturate():
    # amax 6.0: floor(log2 6) = 2, E2M1 emax = 2 -> X = 2^0 (E8M0 127); 7.0 saturates to 6.0.
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([6.0, 7.0, -1.5, 0.5])
    q = quantize(row, "mxfp4")
    assert q.parts[".weight_scale"].tolist() == [[127]]
    assert dequantize(q)[0, :4].tolist() == [6.0, 6.0, -1.5, 0.5]
    # MXFP8: amax 448 * 2^-10 -> X = 2^(8 - 10 - 8) = 2^-10, every E4M3 value times X is exact.
    vals = torch.tensor([448.0, -1.0, 0.015625, 2.0 ** -9]) * 2.0 ** -10
    row = torch.zeros(1, 32)
    row[0, :4] = vals
    q = quantize(row, "mxfp8")
    assert q.parts[".weight_scale"].item() == 127 - 10
    assert torch.equal(dequantize(q)[0, :4], vals)


def test_mx_zeros_and_nan_blocks():
    x = torch.zeros(2, 64)
    x[1, 40] = float("nan")
    for fmt in ("mxfp8", "mxfp4"):
        q = quantize(x, fmt)
        s = q.parts[".weight_scale"]
        assert s[0].tolist() == [0, 0]      # all-zero block: the smallest scale, exact zeros
        assert s[1].tolist() == [0, 255]    # a NaN in the block: the NaN scale (OCP MX 6.3)
        d = dequantize(q)
        assert torch.equal(d[0], torch.zeros(64)) and torch.equal(d[1, :32], torch.zeros(32))
        assert torch.isnan(d[1, 32:]).all()
    assert F.e8m0_to_float(torch.tensor([0, 1, 127, 254], dtype=torch.uint8)).tolist() == \
        [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]


def _deepseek_weight_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's definition, one block at a time: y[i:i+128, j:j+128] = q * s[i/128, j/128]."""
    out = torch.empty(q.shape)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[rows, cols] = q[rows, cols].float() * s[bi, bj]
    return out


def test_fp8_block_layout_edges_and_saturation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(130, 200, generator=g)
    x[0, 0] = 1e-42                       # a subnormal input
    x[129, 199] = 50.0                    # the amax of the partial corner block
    x[128:, :128] = 0.0                   # an all-zero block
    q = quantize(x, "fp8")
    w, s = q.parts[".weight"], q.parts[".weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (130, 200)
    assert s.dtype == torch.float32 and s.shape == (2, 2) == part_shapes("fp8", (130, 200))[".weight_scale_inv"]
    assert s[1, 1].item() == pytest.approx(50.0 / 448, rel=1e-7)
    assert s[1, 0].item() == pytest.approx(1e-10 / 448)   # amax floor: no division by zero
    assert w[129, 199].float().item() == 448.0             # the amax maps to E4M3's max
    assert torch.equal(dequantize(q), _deepseek_weight_dequant(w, s))
    assert torch.equal(dequantize(q)[128:, :128], torch.zeros(2, 128))
    rel = (dequantize(q) - x).norm() / x.norm()
    assert rel < 0.05


def test_fp8_activation_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g)
    q, s = F.quantize_fp8_activation(x)
    assert q.shape == x.shape and s.shape == (3, 3)
    assert torch.allclose(s[:, 0], x[:, :128].abs().amax(-1) / 448)
    deq = q.float() * s.repeat_interleave(128, -1)[:, :300]
    assert ((deq - x).abs() <= x.abs() * 2 ** -3 + 1e-6).all()


def test_nvfp4_two_level_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 40, generator=g)  # 40: not a multiple of 16 (padded to 48)
    q = quantize(x, "nvfp4")
    assert q.parts[".weight"].shape == (4, 24) and q.parts[".weight_scale"].shape == (4, 3)
    s2 = q.parts[".weight_scale_2"]
    assert s2.shape == () and s2.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-7)
    # The block holding the tensor's amax gets the block scale 448 (E4M3's max): full range used.
    r, c = divmod(int(x.abs().argmax()), 40)
    assert q.parts[".weight_scale"][r, c // 16].float().item() == 448.0
    assert dequantize(q).shape == x.shape
    assert (dequantize(q) - x).norm() / x.norm() < 0.15
    assert torch.equal(dequantize(quantize(torch.zeros(2, 16), "nvfp4")), torch.zeros(2, 16))


def test_int4_symmetric_known_vector_and_packing():
    x = torch.tensor([[-7.0, -3.5, 0.0, 1.0, 3.5, 7.0, 2.0, -1.0] * 2])  # one group of 16
    q = quantize(x, "int4", group_size=16)
    assert q.parts[".weight_scale"].tolist() == [[1.0]]
    assert torch.equal(dequantize(q), torch.tensor([[-7.0, -4.0, 0.0, 1.0, 4.0, 7.0, 2.0, -1.0] * 2]))
    # compressed-tensors layout: element 8k + j at bits 4j of word k, stored as q + 8
    word = q.parts[".weight_packed"][0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [1, 4, 8, 9, 12, 15, 10, 7]
    assert q.parts[".weight_shape"].tolist() == [1, 16]


def test_int4_asymmetric_zero_point_and_shapes():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(10, 40, generator=g) * 3 + 1.0   # all positive: 0 still exact (range holds it)
    q = quantize(x, "int4_asym", group_size=16)
    shapes = part_shapes("int4_asym", (10, 40), 16)
    assert {k: tuple(v.shape) for k, v in q.parts.items()} == shapes
    z = F.unpack_int4_words(q.parts[".weight_zero_point"], 0, 10)
    assert (z == 0).all()                            # min clamps to 0 -> zero point 0
    assert ((dequantize(q) - x).abs() <= q.parts[".weight_scale"].repeat_interleave(16, 1)[:, :40] / 2 + 1e-6).all()
    assert F.group_size_of(q.parts) == 16
    assert torch.equal(dequantize(quantize(torch.zeros(3, 8), "int4_asym", group_size=8)), torch.zeros(3, 8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_dtype_is_one_final_cast(fmt):
    """The bit-exact contract's premise: the engine's dequantize(q, bf16) equals the trainer's
    dequantize(q, fp32) cast to bf16, and quantizing a bf16 tensor or its fp32 copy agree."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(70, 300, generator=g) * 0.02).to(torch.bfloat16)
    q = quantize(w, fmt, group_size=32)
    assert torch.equal(dequantize(q, torch.bfloat16), dequantize(q, torch.float32).to(torch.bfloat16))
    q2 = quantize(w.float(), fmt, group_size=32)
    assert all(torch.equal(q.parts[k], q2.parts[k]) for k in q.parts)
    assert fake_quantize(w, fmt, group_size=32).dtype == torch.bfloat16
    assert {k: tuple(v.shape) for k, v in q.parts.items()} == part_shapes(fmt, (70, 300), 32)
    # and quantization is idempotent on its own output (what a re-publish of served weights sees)
    once = dequantize(q)
    if fmt in ("fp8", "mxfp8", "mxfp4"):
        assert torch.equal(dequantize(quantize(once, fmt)), once)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizers_never_divide_by_a_python_number(fmt, monkeypatch):
    """Device independence (tests/gpu/test_quant_gpu.py checks the bits on CUDA): CUDA computes
    `tensor / number` as a multiply by the rounded reciprocal, the CPU divides, so scales such as
    amax / 448 would differ by an ulp between a GPU trainer and a CPU engine. Every division in
    a quantizer must be by a tensor (formats._div)."""
    real = torch.Tensor.__truediv__

    def checked(self, other):
        assert isinstance(other, torch.Tensor), f"quantize({fmt!r}) divides by the number {other!r}"
        return real(self, other)

    monkeypatch.setattr(torch.Tensor, "__truediv__", checked)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(130, 200, generator=g) * 0.02
    quantize(w, fmt, group_size=32)
    quantize(torch.zeros(3, 64), fmt, group_size=32)
    if fmt == "fp8":
        F.quantize_fp8_activation(w)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="'fp7' is not one of"):
        quantize(torch.zeros(2, 2), "fp7")
    with pytest.raises(ValueError, match="2-D weight"):
        quantize(torch.zeros(4), "fp8")
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize(torch.zeros(2, 16), "int4", group_size=12)


def test_error_magnitudes_are_ordered():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.02
    err = {f: ((fake_quantize(w, f) - w).norm() / w.norm()).item() for f in FORMATS}
    assert err["fp8"] < 0.05 and err["mxfp8"] < 0.05
    assert max(err["fp8"], err["mxfp8"]) < min(err["mxfp4"], err["nvfp4"], err["int4"])
    assert all(math.isfinite(e) and e < 0.2 for e in err.values()), err
