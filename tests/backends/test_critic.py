"""PPO with a critic on the FSDP backend (one rank, CPU): the value model learns the returns, its
loss falls and explained variance rises; its optimizer state and step survive a checkpoint."""

from __future__ import annotations

import pytest
import torch

from backend_helpers import make_samples
from miles.algo import LossConfig
from miles.backends.config import TrainConfig
from miles.tiny import build_tiny_model


def _cfg(**kw) -> TrainConfig:
    base = dict(model_path=str(build_tiny_model(arch="qwen3")), param_dtype="float32", lr=1e-6,
                critic_lr=2e-3, max_tokens_per_microbatch=256)
    return TrainConfig(**{**base, **kw})


PPO = LossConfig(advantage_estimator="ppo", loss_reduction="token")


def test_value_loss_falls_and_explained_variance_rises(backends):
    backend = backends(_cfg(), PPO)
    samples = make_samples(groups=2, per_group=4, vocab=400)
    history = [backend.train(samples) for _ in range(8)]
    first, last = history[0], history[-1]
    for m in history:
        assert {"value_loss", "value_clipfrac", "explained_variance", "critic_grad_norm", "pg_loss"} <= set(m)
    assert first["explained_variance"] == pytest.approx(0.0, abs=1e-9)  # a zero head: every value 0
    assert last["value_loss"] < 0.3 * first["value_loss"], [m["value_loss"] for m in history]
    assert last["explained_variance"] > 0.5, [m["explained_variance"] for m in history]
    assert last["critic_step"] == 8.0 and backend.step == 8
    assert 0.0 <= last["value_clipfrac"] <= 1.0


def test_critic_checkpoint_resumes_exactly(backends, tmp_path):
    samples = make_samples(groups=2, per_group=4, vocab=400, seed=1)
    a = backends(_cfg(), PPO)
    for _ in range(3):
        a.train(samples)
    a.save_model(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "COMPLETE").exists()
    want = a.train(samples)
    b = backends(_cfg(), PPO)
    b.load_model(tmp_path / "ckpt")
    assert b.critic.step == 3 and b.step == 3
    got = b.train(samples)
    for key in ("value_loss", "explained_variance", "pg_loss", "critic_lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_ppo_refuses_a_checkpoint_without_a_critic(backends, tmp_path):
    grpo = backends(_cfg(), LossConfig())
    grpo.save_model(tmp_path / "grpo")
    ppo = backends(_cfg(), PPO)
    with pytest.raises(FileNotFoundError, match="no complete critic"):
        ppo.load_model(tmp_path / "grpo")


def test_critic_schedule_is_its_own():
    from miles.backends.critic import critic_schedule
    from miles.backends.optim import lr_at
    cfg = _cfg(lr=1e-6, critic_lr=1e-3, critic_warmup_steps=4, warmup_steps=0)
    sched = critic_schedule(cfg)
    assert [lr_at(s, sched) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert lr_at(0, cfg) == 1e-6
    with pytest.raises(ValueError, match="critic_lr_decay_steps"):
        _cfg(critic_lr_decay_style="cosine", critic_lr_decay_steps=0)
