"""On-policy distillation on the FSDP backend (one rank, CPU): a frozen teacher's log-probs of every
response token, the reverse-KL advantage (pure distillation and reward shaping), and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_helpers import make_samples
from miles.algo import LossConfig, compute_advantages
from miles.backends.config import TrainConfig
from miles.tiny import build_tiny_model

STUDENT = build_tiny_model(arch="qwen3")


def _cfg(teacher, **kw) -> TrainConfig:
    return TrainConfig(model_path=str(STUDENT), teacher_model_path=str(teacher), param_dtype="float32",
                       lr=kw.pop("lr", 3e-4), max_tokens_per_microbatch=256, **kw)


def test_a_teacher_equal_to_the_student_has_zero_reverse_kl(backends):
    backend = backends(_cfg(STUDENT, lr=0.0), LossConfig(opd_kl_coef=1.0, opd_only=True))
    m = backend.train(make_samples(groups=2, per_group=4, vocab=400))
    assert m["teacher_reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(0.0, abs=1e-6)  # every advantage is 0


def _peaked_teacher(tmp_path) -> Path:
    """The student's 4-layer sibling with its final norm scaled by 8: logits 8x sharper, so its
    distribution is far from the near-uniform random student's (same tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = build_tiny_model(arch="qwen3", seed=7, num_hidden_layers=4)
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        lm.model.norm.weight.mul_(8.0)
    out = tmp_path / "teacher"
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(out)
    return out


def test_pure_distillation_moves_the_student_toward_the_teacher(backends, tmp_path):
    """On a fixed batch of tokens the peaked teacher finds unlikely (log pi_s > log pi_t on most),
    pure distillation (no reward at all) lowers the student's log-probs toward the teacher's, so
    the token mean of log pi_s - log pi_t falls step by step. (On-policy, where this mean is the
    reverse KL itself, recipes/algos/opd_quickstart.toml shows it falling.)"""
    backend = backends(_cfg(_peaked_teacher(tmp_path), lr=1e-3),
                       LossConfig(opd_kl_coef=1.0, opd_only=True, loss_reduction="token"))
    samples = make_samples(groups=2, per_group=4, vocab=400)
    kls = [backend.train(samples)["teacher_reverse_kl"] for _ in range(5)]
    assert kls[0] > 1.0, kls
    assert all(b < a for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] < 0.7 * kls[0], kls


def test_reward_shaping_adds_the_reverse_kl_to_the_estimators_advantage():
    cfg = LossConfig(opd_kl_coef=0.5)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    cu = torch.tensor([0, 3, 5])
    student = torch.tensor([-1.0, -2.0, -9.0, -0.5, -1.5])
    teacher = torch.tensor([-1.5, -1.0, 0.0, -0.5, -3.0])
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    plain = compute_advantages(LossConfig(), rewards=rewards, loss_mask=mask, cu_seqlens=cu, group_ids=groups)
    shaped = compute_advantages(cfg, rewards=rewards, loss_mask=mask, cu_seqlens=cu, group_ids=groups,
                                student_logprobs=student, teacher_logprobs=teacher)
    want = (plain.advantages - 0.5 * (student - teacher)) * mask
    assert torch.allclose(shaped.advantages, want)
    pure = compute_advantages(LossConfig(opd_kl_coef=0.5, opd_only=True), rewards=rewards, loss_mask=mask,
                              cu_seqlens=cu, group_ids=groups, student_logprobs=student, teacher_logprobs=teacher)
    assert torch.allclose(pure.advantages, -0.5 * (student - teacher) * mask)


def test_refusals(backends):
    with pytest.raises(ValueError, match="opd_only = true: pure distillation needs algo.opd_kl_coef > 0"):
        LossConfig(opd_only=True)
    with pytest.raises(ValueError, match="train.teacher_model_path is empty"):
        backends(TrainConfig(model_path=str(STUDENT), param_dtype="float32"), LossConfig(opd_kl_coef=1.0))
    from miles.tiny import build_tokenizer
    other = build_tiny_model(arch="qwen3", tokenizer_dir=build_tokenizer(vocab_size=400))
    with pytest.raises(ValueError, match="vocab_size .* differs from the student's"):
        backends(_cfg(other), LossConfig(opd_kl_coef=1.0))
