"""Low precision on one CUDA GPU (H200): the FP8 block GEMM and torchao float8 training.

    .venv/bin/pytest -q tests/gpu/test_quant_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n,k,lead", [(1024, 2048, (8, 33)), (384, 640, (3, 7))])
def test_fp8_block_gemm_matches_the_emulated_path(n, k, lead):
    """K = 640 has five K blocks (scale_b padded to L4 = 8); 264 and 21 rows are padded to 16s."""
    from miles.engines.embedded_engine.fp8_gemm import (PROBE_REL_TOL, block_scaled_inputs,
                                                        emulated_block_linear, emulated_linear,
                                                        fp8_block_linear, fp8_gemm_available)
    from miles.quant.formats import quantize
    assert fp8_gemm_available("cuda"), "the probe disabled the FP8 block GEMM (see the log)"
    rows = lead[0] * lead[1]
    w, x = block_scaled_inputs(n, k, rows, seed=1)
    q = quantize(w.cuda(), "fp8")
    qw, s = q.parts[".weight"], q.parts[".weight_scale_inv"]
    x = x.cuda().to(torch.bfloat16).view(*lead, k)
    fast = fp8_block_linear(x, qw, s).float()
    assert fast.shape == (*lead, n)
    # the kernel's own arithmetic: only its bf16 output rounding and summation order differ
    same = emulated_block_linear(x, qw, s)
    assert ((fast - same).norm() / same.norm()).item() < PROBE_REL_TOL
    # against unquantized activations: E4M3's rounding (unit roundoff 2^-4) is ~0.027 RMS relative
    # per element over a binade (2^-4 / sqrt(3) * 0.74), measured 0.026 on these inputs
    hp = emulated_linear(x.float(), qw, s)
    assert ((fast - hp).norm() / hp.norm()).item() < 0.035


def test_quantizers_are_device_independent():
    """The bit-exact contract across devices: a GPU trainer and a CPU engine agree."""
    from miles.quant.formats import FORMATS, dequantize, quantize
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 520, generator=g) * 0.02).to(torch.bfloat16)
    for fmt in FORMATS:
        cpu = quantize(w, fmt, group_size=32)
        gpu = quantize(w.cuda(), fmt, group_size=32)
        for k in cpu.parts:
            assert torch.equal(cpu.parts[k], gpu.parts[k].cpu()), (fmt, k)
        assert torch.equal(dequantize(cpu, torch.bfloat16), dequantize(gpu, torch.bfloat16).cpu()), fmt


def test_torchao_float8_training_step():
    pytest.importorskip("torchao")
    from miles.quant.keep import KeepList
    from miles.quant.train import apply_fp8_training
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    n = apply_fp8_training(model, torch.device("cuda"), recipe="tensorwise", keep=KeepList())
    assert n == 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    before = model[0].weight.detach().clone()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model[0].weight)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_float8_compiled_trains_any_token_count(recipe):
    """A packed micro-batch has any number of tokens, the weight-gradient GEMM contracts over
    them, and _scaled_mm wants a multiple of 16: the inner dimension is padded (train.py). Under
    torch.compile(dynamic=True), as the FSDP backend compiles its MLPs."""
    pytest.importorskip("torchao")
    import copy
    from miles.quant.keep import KeepList
    from miles.quant.train import apply_fp8_training
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                              torch.nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    assert apply_fp8_training(model, torch.device("cuda"), recipe=recipe, keep=KeepList()) == 2
    model.compile(dynamic=True)
    for tokens in (37, 53, 64):
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        for m in (ref, model):
            m.zero_grad()
            m(x).float().pow(2).mean().backward()
        for i in (0, 2):
            got, want = model[i].weight.grad.float(), ref[i].weight.grad.float()
            # FP8 against BF16: E5M2 gradients (unit roundoff 2^-3, ~0.05 RMS relative) and E4M3
            # operands (~0.027 each); measured 0.055-0.085 with torch's CPU _scaled_mm, the same
            # for every token count. Garbage in the padding would be far larger.
            assert ((got - want).norm() / want.norm()).item() < 0.15, (recipe, tokens, i)


def test_fsdp_backend_trains_in_fp8():
    """quant.train = "fp8" in the FSDP backend: torchao's Float8Linear before fully_shard."""
    pytest.importorskip("torchao")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    from backend_helpers import make_samples
    from miles.algo.config import LossConfig
    from miles.backends import RankInfo, make_backend
    from miles.backends.config import TrainConfig
    from miles.quant.config import QuantConfig
    from miles.tiny import build_tiny_model
    backend = make_backend("fsdp")
    backend.quantize_training(QuantConfig(train="fp8"))
    backend.init(TrainConfig(model_path=str(build_tiny_model(arch="qwen3")), param_dtype="bfloat16",
                             lr=1e-3), RankInfo(), LossConfig())
    try:
        kinds = {type(m).__name__ for m in backend.policy.lm.modules()}
        assert "Float8Linear" in kinds, kinds
        metrics = backend.train(make_samples(vocab=200), None)
        assert metrics and all(v == v for v in metrics.values() if isinstance(v, float))
    finally:
        backend.close()
