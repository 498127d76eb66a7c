"""The fused Triton log-prob kernels equal plain autograd through log_softmax: values, and the
gradient they write into the logits buffer, with and without the entropy term.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set below
before the kernels are first built), so sizes stay small. Skipped where triton is not installed;
the dev extra installs it on Linux, so CI runs these in the interpreter (about 10 s).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from backend_helpers import logprobs_and_grad  # noqa: E402

from miles.backends import logprobs  # noqa: E402
from miles.backends.logprobs import reference_token_logprobs, token_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fused(monkeypatch):
    """Force the Triton path; returns a setter for the vocab block size."""
    monkeypatch.setattr(logprobs, "FUSED", True)
    return lambda block_v: monkeypatch.setattr(logprobs, "FUSED_BLOCK_V", block_v)


def _inputs(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0, scale: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    coef_lp = torch.randn(rows, generator=gen)
    coef_ent = torch.randn(rows, generator=gen)
    return [t.to(DEVICE) for t in (logits, targets, coef_lp, coef_ent)]


_run = logprobs_and_grad


def _assert_grad_close(got, want, rel):
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), err


# (rows, vocab, BLOCK_V): no vocab is a multiple of its block; 4096 is the CUDA default.
SHAPES = [(1, 4099, 4096), (37, 1000, 256), (9, 4099, 1024)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows,vocab,block_v", SHAPES)
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_fused_matches_autograd(fused, dtype, temperature, rows, vocab, block_v, entropy_weight):
    fused(block_v)
    logits, targets, coef_lp, coef_ent = _inputs(rows, vocab, dtype)
    args = (targets, coef_lp, coef_ent, temperature, entropy_weight)
    lp, ent, grad = _run(token_logprobs, logits, *args)
    # The reference sees the same (bf16) values upcast to fp32; its gradient is cast back to
    # the logits dtype, as the fused path writes it.
    ref_lp, ref_ent, ref_grad = _run(reference_token_logprobs, logits.float(), *args)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert (ent >= 0).all()
    _assert_grad_close(grad, ref_grad.to(dtype), 1e-5 if dtype == torch.float32 else 1e-2)


def test_entropy_only_loss(fused):
    """A loss without the log-probs: their incoming gradient is None, the one-hot term vanishes."""
    fused(256)
    logits, targets, _, coef_ent = _inputs(5, 700, torch.float32, seed=1)
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (token_logprobs(x * 1, targets, temperature=0.7)[1] * coef_ent).sum().backward()
    (reference_token_logprobs(y, targets, temperature=0.7)[1] * coef_ent).sum().backward()
    _assert_grad_close(x.grad, y.grad, 1e-5)


def test_sharp_rows_keep_entropy_non_negative(fused):
    """Near one-hot rows: H is a sum of non-negative terms, never a small negative difference."""
    fused(256)
    logits, targets, coef_lp, coef_ent = _inputs(6, 600, torch.float32, seed=2, scale=200.0)
    lp, ent, grad = _run(token_logprobs, logits, targets, coef_lp, coef_ent, 1.0, 0.5)
    ref_lp, ref_ent, ref_grad = _run(reference_token_logprobs, logits, targets, coef_lp, coef_ent,
                                     1.0, 0.5)
    assert (ent >= 0).all()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    _assert_grad_close(grad, ref_grad, 1e-5)


def test_masked_vocab_columns(fused):
    """-inf logits (a masked vocab tail over whole blocks) drop out: finite values, zero grad."""
    fused(128)
    logits, targets, coef_lp, coef_ent = _inputs(4, 900, torch.float32, seed=3)
    targets = targets % 500
    masked = logits.clone()
    masked[:, 500:] = float("-inf")
    lp, ent, grad = _run(token_logprobs, masked, targets, coef_lp, coef_ent, 1.0, 0.3)
    ref_lp, ref_ent, ref_grad = _run(reference_token_logprobs, logits[:, :500], targets, coef_lp,
                                     coef_ent, 1.0, 0.3)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert (grad[:, 500:] == 0).all()
    _assert_grad_close(grad[:, :500].contiguous(), ref_grad, 1e-5)


def test_dispatch(monkeypatch):
    cpu = torch.zeros(2, 3)
    assert logprobs._fused_kernels(cpu) is None  # auto: CPU tensors take the torch path
    monkeypatch.setattr(logprobs, "FUSED", True)
    assert logprobs._fused_kernels(cpu) is not None
    assert logprobs._fused_kernels(cpu.double()) is None  # fp64 keeps the fp64 torch path
    monkeypatch.setattr(logprobs, "FUSED", False)
    assert logprobs._fused_kernels(cpu.to(DEVICE)) is None
