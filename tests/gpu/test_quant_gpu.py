"""Low precision on one CUDA GPU (H200): the FP8 block GEMM and torchao float8 training.

    .venv/bin/pytest -q tests/gpu/test_quant_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fp8_block_gemm_matches_the_emulated_path():
    from miles.engines.embedded_engine.fp8_gemm import (emulated_linear, fp8_block_linear,
                                                        fp8_gemm_available)
    from miles.quant.formats import quantize
    assert fp8_gemm_available("cuda"), "the probe disabled the FP8 block GEMM (see the log)"
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 2048, generator=g) * 0.02).cuda()
    x = torch.randn(8, 33, 2048, generator=g).cuda().to(torch.bfloat16)
    q = quantize(w, "fp8")
    fast = fp8_block_linear(x, q.parts[".weight"], q.parts[".weight_scale_inv"]).float()
    ref = emulated_linear(x.float(), q.parts[".weight"], q.parts[".weight_scale_inv"])
    assert fast.shape == (8, 33, 1024)
    assert ((fast - ref).norm() / ref.norm()).item() < 0.03


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
    from miles.quant.train import training_transform
    from miles.tiny import build_tiny_model
    backend = make_backend("fsdp")
    backend.lm_transform = training_transform(QuantConfig(train="fp8"))
    backend.init(TrainConfig(model_path=str(build_tiny_model(arch="qwen3")), param_dtype="bfloat16",
                             lr=1e-3), RankInfo(), LossConfig())
    try:
        kinds = {type(m).__name__ for m in backend.policy.lm.modules()}
        assert "Float8Linear" in kinds, kinds
        metrics = backend.train(make_samples(vocab=200), None)
        assert metrics and all(v == v for v in metrics.values() if isinstance(v, float))
    finally:
        backend.close()
