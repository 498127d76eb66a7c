"""A quantized publish through real embedded engines: every format, bit-exact, checked.

The test process is trainer rank 0: it loads the tiny model with transformers, perturbs it (so
the publish is not the engine's start-up checkpoint), and publishes it with make_transport +
WeightPublisher (check_weights on) to an engine started with `--quantization FMT`. The engine's
dequantized parameters must equal the trainer's dequantize(quantize(w)) bit for bit, and kept
tensors (embeddings, norms, lm_head) the bf16 export.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.backends.hf_weights import iter_hf_weight_buckets
from miles.engines.client import EngineClient
from miles.quant.config import QuantConfig
from miles.quant.formats import fake_quantize
from miles.tiny import build_tiny_model
from miles.weights.base import send_weights
from miles.weights.checks import WeightsMismatch, tensor_sha256
from miles.weights.config import WeightsConfig
from miles.weights.factory import make_transport
from miles.weights.publisher import WeightPublishError, WeightPublisher

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from weights_helpers import start_engines, stop_engines  # noqa: E402

ROLLOUTS = [("fp8", True), ("mxfp8", True), ("mxfp4", True), ("nvfp4", True), ("int4", True),
            ("int4", False)]


def _model(path):
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return lm


def _run_update(transport, lm, version, dtype=torch.bfloat16):
    def run():
        send_weights(transport, version, iter_hf_weight_buckets(lm, 1 << 20, dtype=dtype))
    return run


async def _publish(tmp_path, lm, url, quant, *, transport="disk", version=1, tamper=None,
                   model_path=None, dtype=torch.bfloat16):
    cfg = WeightsConfig(transport=transport, check_weights=True, checksum="sha256",
                        disk_dir=str(tmp_path / "versions"), connect_timeout_s=30,
                        control_timeout_s=30, transfer_timeout_s=120, commit_timeout_s=120,
                        bucket_timeout_s=60, direct_min_bytes=0)
    tr = make_transport(cfg, rank=0, model_path=str(model_path or build_tiny_model(arch="qwen3")),
                        recipe=SimpleNamespace(quant=quant))
    if tamper:
        tamper(tr)
    pub = WeightPublisher(cfg, [url], tr)
    try:
        await pub.connect()
        return await pub.publish(version, _run_update(tr, lm, version, dtype)), tr
    finally:
        await pub.close()
        tr.close()


@pytest.mark.parametrize("rollout,symmetric", ROLLOUTS)
async def test_quantized_publish_is_bit_exact(tmp_path, rollout, symmetric):
    path = build_tiny_model(arch="qwen3")
    quant = QuantConfig(rollout=rollout, int4_symmetric=symmetric, int4_group_size=32)
    fmt = quant.format
    lm = _model(path)
    (engine,) = await start_engines(path, 1, tmp_path, "--quantization", fmt, "--dtype", "bfloat16")
    try:
        report, tr = await _publish(tmp_path, lm, engine.url, quant)
        assert report.checked, report
        quantized, kept = tr.inner.quantized, tr.inner.kept
        assert "model.layers.0.mlp.gate_proj.weight" in quantized
        assert "model.layers.0.self_attn.q_proj.weight" in quantized
        assert "model.embed_tokens.weight" in kept and "model.norm.weight" in kept
        assert not any("norm" in n or "embed" in n for n in quantized), quantized
        client = EngineClient(engine.url, timeout_s=30)
        try:
            sums = (await client.weights_checksum(algorithm="sha256"))
            info = await client.model_info()
            out = await client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0})
        finally:
            await client.close()
        assert info["quantization"] == fmt
        # Recompute one quantized and one kept tensor here, independently of the tap.
        w = dict(lm.named_parameters())["model.layers.1.mlp.down_proj.weight"].detach().to(torch.bfloat16)
        want = fake_quantize(w, fmt, group_size=32)
        assert sums["model.layers.1.mlp.down_proj.weight"] == tensor_sha256(want)
        assert not torch.equal(want, w)  # it really is quantized
        emb = dict(lm.named_parameters())["model.embed_tokens.weight"].detach()
        assert sums["model.embed_tokens.weight"] == tensor_sha256(emb, torch.bfloat16)
        assert len(out.output_ids) == 4
    finally:
        await stop_engines([engine])


async def test_check_weights_catches_a_format_disagreement(tmp_path):
    """The trainer believes the engine holds BF16 for the MLP while it holds FP8: refused."""
    path = build_tiny_model(arch="qwen3")
    lm = _model(path)
    (engine,) = await start_engines(path, 1, tmp_path, "--quantization", "fp8", "--dtype", "bfloat16")

    def tamper(tr):
        real = tr.engine_view
        tr.engine_view = lambda n, t: t if ".mlp." in n else real(n, t)
    try:
        with pytest.raises(WeightsMismatch, match=r"mlp\.(gate|up|down)_proj\.weight"):
            await _publish(tmp_path, lm, engine.url, QuantConfig(rollout="fp8"), tamper=tamper)
    finally:
        await stop_engines([engine])


async def test_nccl_on_gloo_sends_fp8_as_bytes(tmp_path):
    """gloo has no float8: the exporter sends the bytes, the engine reinterprets them."""
    path = build_tiny_model(arch="qwen3")
    lm = _model(path)
    (engine,) = await start_engines(path, 1, tmp_path, "--quantization", "nvfp4", "--dtype", "float32")
    try:
        report, tr = await _publish(tmp_path, lm, engine.url, QuantConfig(rollout="nvfp4"),
                                    transport="nccl")
        assert report.checked and tr.inner.raw_fp8 and report.buckets >= 2
    finally:
        await stop_engines([engine])


async def test_unused_keep_pattern_refuses_the_publish(tmp_path):
    path = build_tiny_model(arch="qwen3")
    lm = _model(path)
    (engine,) = await start_engines(path, 1, tmp_path, "--quantization", "fp8", "--dtype", "bfloat16")
    try:
        quant = QuantConfig(rollout="fp8", keep_bf16=["model.layers.0.mlp", "model.layers.0.mlp.gate"])
        with pytest.raises(WeightPublishError, match=r"model\.layers\.0\.mlp\.gate.*matched none"):
            await _publish(tmp_path, lm, engine.url, quant)
        # The valid prefix alone: layer 0's MLP stays BF16 and the publish is checked.
        report, tr = await _publish(tmp_path, lm, engine.url,
                                    QuantConfig(rollout="fp8", keep_bf16=["model.layers.0.mlp"]),
                                    version=2)
        assert report.checked
        assert "model.layers.0.mlp.up_proj.weight" in tr.inner.kept
        assert "model.layers.1.mlp.up_proj.weight" in tr.inner.quantized
    finally:
        await stop_engines([engine])


async def test_an_engine_without_quantization_refuses_the_parts(tmp_path):
    path = build_tiny_model(arch="qwen3")
    lm = _model(path)
    (engine,) = await start_engines(path, 1, tmp_path, "--dtype", "bfloat16")
    try:
        with pytest.raises(WeightPublishError, match=r"weight_scale_inv.*--quantization"):
            await _publish(tmp_path, lm, engine.url, QuantConfig(rollout="fp8"))
    finally:
        await stop_engines([engine])
