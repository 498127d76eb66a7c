"""Fused Triton log-prob kernels on CUDA: a real micro-batch (bf16 [6144, 151936] logits, the Qwen
vocab) against the chunked torch path, values and the gradients written into the logits buffer;
and a small odd-sized vocab against plain autograd.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_logprobs_fused_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import logprobs_and_grad  # noqa: E402

from miles.backends import logprobs  # noqa: E402
from miles.backends.logprobs import reference_token_logprobs, token_logprobs  # noqa: E402


def _inputs(rows: int, vocab: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    coef_lp = torch.randn(rows, generator=gen, device="cuda")
    coef_ent = torch.randn(rows, generator=gen, device="cuda")
    return logits, targets, coef_lp, coef_ent


_run = logprobs_and_grad


def _assert_close(got, want, grad_rel):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    assert got[2].dtype == want[2].dtype and torch.isfinite(got[2]).all()
    err = (got[2].float() - want[2].float()).abs().max().item()
    assert err <= grad_rel * want[2].float().abs().max().item(), err


@pytest.mark.parametrize("temperature,entropy_weight", [(1.0, 0.0), (0.7, 0.3)])
def test_fused_matches_torch_path_at_full_size(monkeypatch, temperature, entropy_weight):
    inputs = _inputs(6144, 151936, torch.bfloat16)
    monkeypatch.setattr(logprobs, "FUSED", None)  # auto: CUDA logits take the Triton path
    assert logprobs._fused_kernels(inputs[0]) is not None
    fused = _run(token_logprobs, *inputs, temperature, entropy_weight)
    monkeypatch.setattr(logprobs, "FUSED", False)
    chunked = _run(token_logprobs, *inputs, temperature, entropy_weight)
    assert (fused[1] >= 0).all()
    _assert_close(fused, chunked, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_autograd_odd_vocab(monkeypatch, dtype):
    """A vocab that is no multiple of 16 nor of the block: the compiled masked tail."""
    monkeypatch.setattr(logprobs, "FUSED", True)
    logits, targets, coef_lp, coef_ent = _inputs(37, 4099, dtype)
    got = _run(token_logprobs, logits, targets, coef_lp, coef_ent, 0.7, 0.3)
    ref = _run(reference_token_logprobs, logits.float(), targets, coef_lp, coef_ent, 0.7, 0.3)
    _assert_close(got, (ref[0], ref[1], ref[2].to(dtype)), 1e-5 if dtype == torch.float32 else 1e-2)
