"""The chunked log-prob/entropy function equals plain autograd through log_softmax, values and grads."""

import pytest
import torch

from miles.backends.logprobs import chunk_rows, reference_token_logprobs, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_chunked_matches_autograd(temperature, entropy_weight):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    coef = torch.randn(37, generator=gen, dtype=torch.float64)

    def run(fn, **kw):
        lp, ent = fn(hidden @ weight.T, targets, temperature=temperature, **kw)
        loss = (lp * coef).sum() + entropy_weight * ent.sum()
        grads = torch.autograd.grad(loss, (hidden, weight))
        return lp.detach(), ent.detach(), grads

    # chunk_bytes small enough for 5 rows per chunk: the chunk loop runs 8 times
    got = run(token_logprobs, chunk_bytes=5 * 3 * 4 * 50)
    want = run(reference_token_logprobs)
    assert chunk_rows(50, 5 * 3 * 4 * 50) == 5
    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-6, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_bf16_logits_stay_bf16_and_close():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 300, generator=gen) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=gen)
    lp, ent = token_logprobs(logits * 1, targets)  # "* 1": the function reuses its input buffer
    lp.sum().backward()
    ref_lp, ref_ent = reference_token_logprobs(logits.detach().float(), targets)
    assert lp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
