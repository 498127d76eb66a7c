"""FSDP on-policy distillation with the teacher's log-probs carried by the samples
(`Sample.teacher_logprobs`, scored on the rollout side) equals the trainer-side teacher pass.

Fed the teacher's own log-probs (a plain HF forward of the same teacher, fp32, unpacked), the
first step's reverse KL and loss agree with the teacher pass to 1e-5 relative (packed vs
unpacked attention order only). A teacher-less trainer proves the pass is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

from backend_helpers import make_samples
from miles.algo import LossConfig
from miles.backends.config import TrainConfig
from miles.tiny import build_tiny_model

STUDENT = build_tiny_model(arch="qwen3")
LOSS = LossConfig(opd_kl_coef=1.0, opd_only=True, loss_reduction="token")


def _peaked_teacher(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = build_tiny_model(arch="qwen3", seed=7, num_hidden_layers=4)
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        lm.model.norm.weight.mul_(8.0)
    out = tmp_path / "teacher"
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(out)
    return out


def _with_teacher_logprobs(teacher, samples):
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32, attn_implementation="sdpa")
    out = copy.deepcopy(samples)
    with torch.no_grad():
        for s in out:
            n, r = len(s.tokens), s.response_length
            ids = torch.as_tensor(s.tokens, dtype=torch.int64)[None]
            logits = lm(input_ids=ids).logits[0, n - r - 1:n - 1].float()
            s.teacher_logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None])[:, 0].numpy()
    return out


def test_fsdp_sample_teacher_logprobs_equal_the_teacher_pass(backends, tmp_path):
    teacher = _peaked_teacher(tmp_path)
    cfg = TrainConfig(model_path=str(STUDENT), teacher_model_path=str(teacher), param_dtype="float32",
                      lr=1e-3, max_tokens_per_microbatch=256)
    samples = make_samples(groups=2, per_group=4, vocab=400)
    carried = _with_teacher_logprobs(teacher, samples)

    by_pass = backends(cfg, LOSS).train(samples)
    fed = backends(cfg, LOSS)
    fed.teacher = None   # a teacher pass would fail on None: the carried log-probs must be used
    by_samples = fed.train(carried)
    assert by_pass["teacher_reverse_kl"] > 1.0
    for key in ("teacher_reverse_kl", "loss", "pg_loss", "grad_norm"):
        assert by_samples[key] == pytest.approx(by_pass[key], rel=1e-5), key


def test_partly_carried_teacher_logprobs_fall_back_to_the_teacher_pass(backends, tmp_path):
    teacher = _peaked_teacher(tmp_path)
    cfg = TrainConfig(model_path=str(STUDENT), teacher_model_path=str(teacher), param_dtype="float32",
                      lr=1e-3, max_tokens_per_microbatch=256)
    samples = make_samples(groups=2, per_group=4, vocab=400)
    partly = _with_teacher_logprobs(teacher, samples)
    for s in partly[1:]:
        s.teacher_logprobs = None
    partly[0].teacher_logprobs = partly[0].teacher_logprobs * 0.0 - 50.0  # would show if it were used
    a = backends(cfg, LOSS).train(samples)
    b = backends(cfg, LOSS).train(partly)
    assert b["teacher_reverse_kl"] == pytest.approx(a["teacher_reverse_kl"], rel=1e-6)
