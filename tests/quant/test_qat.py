"""INT4 QAT: the straight-through estimator, and the trained forward equal to the INT4 rollout."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from miles.engines.client import EngineClient
from miles.quant.config import QuantConfig
from miles.quant.formats import dequantize, quantize
from miles.quant.keep import KeepList
from miles.quant.qat import apply_int4_qat, fake_quant_ste, qat_modules
from miles.quant.train import apply_fp8_training, training_transform
from miles.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from test_publish import _model, _publish  # noqa: E402
from weights_helpers import start_engines, stop_engines  # noqa: E402


@pytest.mark.parametrize("fmt", ["int4", "int4_asym"])
def test_ste_forward_is_the_exporters_fake_quant_and_backward_is_identity(fmt):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 64, generator=g) * 0.1).requires_grad_()
    c = torch.randn(16, 64, generator=g)
    y = fake_quant_ste(w, fmt, 32, torch.bfloat16)
    # quantized from the export dtype, dequantized straight into w's dtype (as an fp32 engine does)
    want = dequantize(quantize(w.detach().to(torch.bfloat16), fmt, group_size=32), torch.float32)
    assert torch.equal(y.detach(), want)
    assert not torch.equal(y.detach(), w.detach())
    (y * c).sum().backward()
    assert torch.equal(w.grad, c)


def test_apply_covers_exactly_the_exported_linears():
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(build_tiny_model(arch="qwen3")), dtype=torch.float32)
    names = apply_int4_qat(lm, keep=KeepList(["model.layers.0.mlp"]), group_size=32,
                           export_dtype=torch.float32)
    assert names == qat_modules(lm)
    assert "model.layers.1.mlp.up_proj" in names and "model.layers.0.self_attn.q_proj" in names
    assert "model.layers.0.mlp.up_proj" not in names and "lm_head" not in names
    with pytest.raises(ValueError, match="no nn.Linear"):
        apply_int4_qat(torch.nn.Sequential(torch.nn.LayerNorm(4)), keep=KeepList(),
                       export_dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(str(build_tiny_model(arch="qwen3_moe")), dtype=torch.float32)
    with pytest.raises(ValueError, match="fused MoE expert"):
        apply_int4_qat(moe, keep=KeepList(), export_dtype=torch.float32)


def test_fp8_training_is_refused_on_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA trainer"):
        apply_fp8_training(torch.nn.Linear(16, 16), torch.device("cpu"), recipe="tensorwise",
                           keep=KeepList())
    assert training_transform(QuantConfig()) is None


def _logprobs(lm, ids):
    with torch.no_grad():
        logits = lm(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


async def test_qat_forward_matches_the_int4_engine(tmp_path):
    """The QAT trainer's log-probs equal the INT4 engine's (fp32 on both sides) up to kernel
    rounding; the same model without QAT is off by the quantization error."""
    path = build_tiny_model(arch="qwen3")
    lm = _model(path)
    plain = copy.deepcopy(lm)
    apply_int4_qat(lm, keep=KeepList(), group_size=32, export_dtype=torch.float32)
    (engine,) = await start_engines(path, 1, tmp_path, "--quantization", "int4", "--dtype", "float32")
    try:
        report, _ = await _publish(tmp_path, lm, engine.url, QuantConfig(
            rollout="int4", train="int4_qat", int4_group_size=32), dtype=torch.float32)
        assert report.checked
        ids = [int(i) for i in torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0))]
        client = EngineClient(engine.url, timeout_s=30)
        try:
            res = await client.generate(ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        finally:
            await client.close()
        engine_lp = torch.tensor([v for v in res.input_logprobs if v is not None])
        assert engine_lp.shape == (len(ids) - 1,)
        qat_diff = (_logprobs(lm, ids) - engine_lp).abs().max().item()
        plain_diff = (_logprobs(plain, ids) - engine_lp).abs().max().item()
        assert qat_diff < 1e-4, qat_diff
        assert plain_diff > 20 * qat_diff, (plain_diff, qat_diff)
    finally:
        await stop_engines([engine])


def test_fsdp_backend_applies_qat_before_sharding(backends_one):
    backend, names = backends_one
    assert names and all(n.startswith("model.layers.") for n in names)
    from backend_helpers import make_samples
    before = {n: p.detach().full_tensor().clone() for n, p in backend.policy.lm.named_parameters()
              if n.endswith("mlp.up_proj.weight")}
    metrics = backend.train(make_samples(vocab=200), None)
    assert metrics
    after = {n: p.detach().full_tensor() for n, p in backend.policy.lm.named_parameters() if n in before}
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the STE passed gradients


@pytest.fixture
def backends_one():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    from miles.backends import RankInfo, make_backend
    from miles.backends.config import TrainConfig
    from miles.algo.config import LossConfig
    backend = make_backend("fsdp")
    backend.quantize_training(QuantConfig(rollout="int4", train="int4_qat", int4_group_size=32))
    backend.init(TrainConfig(model_path=str(build_tiny_model(arch="qwen3")), param_dtype="float32",
                             lr=1e-3), RankInfo(), LossConfig())
    try:
        yield backend, qat_modules(backend.policy.lm)
    finally:
        backend.close()
