"""PPO's critic, on-policy distillation's teacher and LoRA on CUDA: bf16 compute over fp32 masters,
compiled norms/MLPs, sleep/wake with the critic's and teacher's tensors, merged weights out.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_algos_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.config import LoraConfig  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

MODEL = dict(arch="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_ppo_opd_lora_train_sleep_wake_on_cuda():
    student = build_tiny_model(**MODEL)
    teacher = build_tiny_model(**{**MODEL, "num_hidden_layers": 6}, seed=3)
    cfg = TrainConfig(model_path=str(student), teacher_model_path=str(teacher), lr=1e-4, critic_lr=1e-3,
                      lora=LoraConfig(rank=8, alpha=16.0))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    backend = make_backend("fsdp")
    backend.init(cfg, RankInfo(), LossConfig(advantage_estimator="ppo", opd_kl_coef=0.1))
    try:
        samples = make_samples(groups=4, per_group=8, vocab=400)
        first = backend.train(samples)
        for key in ("value_loss", "explained_variance", "teacher_reverse_kl", "trainable_params",
                    "optimizer_bytes"):
            assert key in first and first[key] == first[key], key  # present and not NaN
        assert first["trainable_params"] < 0.1 * sum(p.numel() for p in backend.policy.parameters())
        before = torch.cuda.memory_allocated() - base
        backend.sleep()
        assert torch.cuda.memory_allocated() - base < 0.2 * before  # critic and teacher moved too
        backend.wake_up()
        history = [backend.train(samples) for _ in range(6)]
        assert history[-1]["value_loss"] < first["value_loss"], [m["value_loss"] for m in history]
        names = [n for bucket in backend.iter_hf_weight_buckets() for n, t in bucket
                 if t.dtype == torch.bfloat16]
        assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora" in n for n in names)
    finally:
        backend.close()
