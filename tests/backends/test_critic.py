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


def test_ppo_with_lora_and_a_teacher_starts_from_the_merged_policy(backends):
    """The CPU twin of tests/gpu/test_algos_gpu.py. With train.lora the policy's adapted linears are
    peft wrappers (`q_proj.base_layer.weight` plus lora_A / lora_B), yet the dense critic starts
    from the policy's merged weights W + (alpha / rank) * B @ A; sleep frees the critic's and the
    teacher's bytes too; the weights that leave are merged, under HF names with no 'lora' in them."""
    from miles.backends.config import LoraConfig
    from miles.backends.lora import merged_hf_parameters

    teacher = build_tiny_model(arch="qwen3", num_hidden_layers=3, seed=3)
    cfg = _cfg(teacher_model_path=str(teacher), lora=LoraConfig(rank=4, alpha=8.0))
    backend = backends(cfg, LossConfig(advantage_estimator="ppo", opd_kl_coef=0.1, loss_reduction="token"))
    lm = backend.policy.lm
    # peft starts B at zero; a nonzero B (as after a LoRA SFT warm-start) makes the merge visible
    for name, p in lm.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p.to_local() if hasattr(p, "to_local") else p, std=0.05)
    merged = {n.removeprefix("model."): _full(t) for n, t in merged_hf_parameters(lm) if n.startswith("model.")}
    base_q = _full(dict(lm.named_parameters())["model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert not torch.allclose(merged["layers.0.self_attn.q_proj.weight"], base_q)

    backend.critic.start_from(lm.model)  # what the first train() call does
    mine = {n: _full(p) for n, p in backend.critic.model.decoder.named_parameters()}
    assert mine.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=0, msg=name)

    samples = make_samples(groups=2, per_group=4, vocab=400)
    first = backend.train(samples)
    for key in ("value_loss", "explained_variance", "teacher_reverse_kl", "trainable_params"):
        assert key in first and first[key] == first[key], key  # present and not NaN
    assert first["trainable_params"] < 0.1 * sum(p.numel() for p in backend.policy.parameters())

    backend.sleep()
    adam = [v for state in backend.critic.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]
    held = [*backend.critic.model.parameters(), *backend.teacher.parameters(), *adam]
    assert adam and all(_local(t).untyped_storage().nbytes() == 0 for t in held)
    backend.wake_up()
    history = [backend.train(samples) for _ in range(3)]
    losses = [first["value_loss"]] + [m["value_loss"] for m in history]
    assert losses[-1] < 0.5 * losses[0], losses  # measured 0.138 -> 0.022
    names = [n for bucket in backend.iter_hf_weight_buckets() for n, _ in bucket]
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora" in n for n in names)


def _full(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).float().clone()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
