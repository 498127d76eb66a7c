"""LoRA on the FSDP backend (one rank, CPU): only the adapters train and hold optimizer state; the
weights that leave (weight sync, HF export) are merged, checked against peft's own merge of the
exported adapter, and a real embedded engine serves exactly those (by checksum)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backend_helpers import make_samples
from miles.algo import LossConfig
from miles.backends.config import LoraConfig, TrainConfig
from miles.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from weights_helpers import start_engines, stop_engines  # noqa: E402

MODEL = build_tiny_model(arch="qwen3")
Q = "model.layers.0.self_attn.q_proj.weight"


def _cfg(lora: LoraConfig | None) -> TrainConfig:
    return TrainConfig(model_path=str(MODEL), param_dtype="float32", lr=1e-2, max_tokens_per_microbatch=256,
                       lora=lora)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()


def test_only_the_adapters_train_and_hold_optimizer_state(backends):
    samples = make_samples(groups=2, per_group=4, vocab=400)
    dense = backends(_cfg(None), LossConfig()).train(samples)
    backend = backends(_cfg(LoraConfig(rank=4, alpha=8.0)), LossConfig())
    named = dict(backend.policy.lm.named_parameters())
    adapters = {n for n in named if ".lora_" in n}
    assert adapters and {n for n, p in named.items() if p.requires_grad} == adapters
    before = {n: _full(p) for n, p in named.items()}
    m = backend.train(samples)
    changed = {n for n, p in named.items() if not torch.equal(before[n], _full(p))}
    assert changed and changed <= adapters, sorted(changed - adapters)
    assert any(".lora_B." in n for n in changed)  # B leaves zero: the adapted model now differs
    want = sum(named[n].numel() for n in adapters)
    # 2 layers x rank 4 x (in + out) of q, k, v, o, gate, up, down (hidden 128, kv 64, mlp 256)
    per_layer = (128 + 128) + 2 * (128 + 64) + (128 + 128) + 3 * (128 + 256)
    assert m["trainable_params"] == want == 2 * 4 * per_layer
    assert m["optimizer_bytes"] == 2 * 4 * want + 4 * len(adapters)  # exp_avg, exp_avg_sq, step
    assert dense["trainable_params"] > 20 * want  # 361,216 against 16,384
    assert m["optimizer_bytes"] < 0.1 * dense["optimizer_bytes"]


def test_bad_lora_config_is_refused(backends):
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="target_modules"):
        backends(_cfg(LoraConfig(target_modules=["no_such_proj"])), LossConfig())


async def test_engine_serves_the_merged_weights(backends, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles.engines.client import EngineClient
    from miles.quant.config import QuantConfig
    from miles.weights.checks import tensor_sha256
    from miles.weights.config import WeightsConfig
    from miles.weights.factory import make_transport
    from miles.weights.publisher import WeightPublisher

    backend = backends(_cfg(LoraConfig(rank=4, alpha=8.0)), LossConfig())
    for _ in range(2):
        backend.train(make_samples(groups=2, per_group=4, vocab=400))
    backend.save_model(tmp_path / "hf", hf=True)
    names = [n for bucket in backend.iter_hf_weight_buckets() for n, _ in bucket]
    assert Q in names and not any("lora" in n or "base_layer" in n for n in names)

    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    base_q = base.state_dict()[Q].clone()
    reference = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter")).merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(reference[Q], base_q)

    (engine,) = await start_engines(MODEL, 1, tmp_path, "--dtype", "float32")
    cfg = WeightsConfig(transport="disk", check_weights=True, checksum="sha256",
                        disk_dir=str(tmp_path / "versions"), connect_timeout_s=30, control_timeout_s=30,
                        transfer_timeout_s=120, commit_timeout_s=120, bucket_timeout_s=60)
    transport = make_transport(cfg, rank=0, model_path=str(MODEL), recipe=SimpleNamespace(quant=QuantConfig()))
    publisher = WeightPublisher(cfg, [engine.url], transport)
    client = EngineClient(engine.url, timeout_s=30)
    try:
        await publisher.connect()
        report = await publisher.publish(1, lambda: backend.update_weights(transport, 1))
        assert report.checked  # every tensor the engine holds is what the trainer sent
        sums = await client.weights_checksum(algorithm="sha256")
        for name in (Q, "model.layers.1.mlp.down_proj.weight"):
            assert sums[name] == tensor_sha256(reference[name].contiguous()), name  # peft's merge
        assert sums[Q] != tensor_sha256(base_q)
    finally:
        await client.close()
        await publisher.close()
        transport.close()
        await stop_engines([engine])
