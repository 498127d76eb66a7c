"""Seed 0 samples by probability, through the embedded engine's own `sample()`: on logits where
token 0 is nearly impossible it is never drawn, and the first-token frequencies over many seeds
(and seed 0's over many steps) match the softmax. (seed 0, step 0) once drew exactly u = 0.0, so
inverse-CDF sampling returned token 0 whatever its probability."""

from __future__ import annotations

import numpy as np
import torch

from miles.engines.embedded_engine.sampling import SamplingBatch, sample
from miles.seeds import sample_seed

LOGITS = torch.tensor([-30.0, 0.0, 1.0, 2.0, -1.0, 0.5, 1.5, -0.5])   # p(0) ~ 1e-14


def batch(seeds, steps, **kw) -> SamplingBatch:
    n = len(seeds)
    return SamplingBatch(temperatures=[1.0] * n, top_ps=kw.get("top_p", [1.0] * n),
                         top_ks=kw.get("top_k", [1 << 30] * n), min_ps=[0.0] * n, seeds=list(seeds),
                         steps=list(steps), banned=[], biases=[])


def check_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    n = len(tokens)
    freq = np.bincount(tokens, minlength=len(probs)) / n
    # 6 binomial standard deviations per token (+1/n): a correct sampler fails this with
    # probability < 1e-8; the old one put seed 0's draw on token 0
    tol = 6 * np.sqrt(probs * (1 - probs) / n) + 1.0 / n
    assert np.all(np.abs(freq - probs) <= tol), (freq, probs, tol)


def test_seed_0_never_draws_an_impossible_token_and_draws_by_probability():
    probs = torch.softmax(LOGITS, -1).numpy()
    n = 20_000
    logits = LOGITS.repeat(n, 1)
    # many seeds (0 first), the first token of each
    first = sample(logits, batch(range(n), [0] * n)).tokens.numpy()
    assert first[0] != 0 and not (first == 0).any()
    check_frequencies(first, probs)
    # seed 0 over many output positions
    steps = sample(logits, batch([0] * n, range(n))).tokens.numpy()
    assert not (steps == 0).any()
    check_frequencies(steps, probs)
    # the seeds a run really sends: sample j of prompt p at run seed 0
    seeds = [sample_seed(0, p, j, 0) for p in range(n // 8) for j in range(8)]
    run = sample(logits, batch(seeds, [0] * n)).tokens.numpy()
    assert not (run == 0).any()
    check_frequencies(run, probs)


def test_seed_0_with_top_p_and_top_k_samples_the_kept_tokens_by_probability():
    """Truncating rows take the sorted path: seed 0 there once took the argmax every time."""
    n = 20_000
    logits = LOGITS.repeat(n, 1)
    out = sample(logits, batch(range(n), [0] * n, top_k=[3] * n)).tokens.numpy()
    kept = torch.softmax(LOGITS, -1).numpy() * np.isin(np.arange(8), [3, 6, 2])
    check_frequencies(out, kept / kept.sum())
    assert out[0] in (2, 3, 6)
