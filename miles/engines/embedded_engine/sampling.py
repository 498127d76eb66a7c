"""Batched sampling with per-request parameters and per-request seeded randomness.

Design decisions:
- Logprob convention (one for both engines, see miles/engines/sglang.py): the logprob reported
  for a token is `log_softmax(raw_logits / T)[token]`, the temperature-scaled distribution before
  top-k, top-p, min-p, logit_bias and min_new_tokens masking. That is what the trainer recomputes
  (`log_softmax(logits / train.temperature)`, miles/backends/logprobs.py) and what the importance
  ratios need; SGLang returns the same unless `SGLANG_RETURN_ORIGINAL_LOGPROB` is set (its
  truncation and penalties happen after that point, logit_bias before it; RL recipes use none).
  Greedy rows (T == 0) report temperature-1 logprobs, as SGLang does (it turns T = 0 into T = 1
  with top_k = 1). `top_k == 1` with T > 0 is greedy sampling too, but reports the scaled
  distribution: it is what a trainer at that temperature recomputes. Top logprobs use the same
  distribution. It is computed from the very logits the token was sampled from (same forward).
- Randomness is inverse-CDF sampling with one uniform per (request, step) drawn from a counter-based
  hash of (sampling_seed, output position) on the host. So a request's tokens depend only on its
  own seed and logits, never on which other requests share the batch, and a retracted request
  resamples exactly what it would have. Requests without `sampling_seed` get a seed from the
  server's RNG (`--random-seed`).
- Rows that truncate the distribution (top_k / top_p / min_p) are sampled in sorted order, the
  others in vocabulary order; each row always takes the same path, whatever its batch neighbours do.
- temperature == 0 (or top_k == 1) is greedy: argmax of the processed logits (first index on ties,
  like transformers).
- A "plain" batch (no top-k/top-p/min-p truncation on its sampled rows, no banned tokens, no
  logit_bias, no top logprobs: every RL rollout) is sampled by `sample_plain`, static-shape tensor
  ops with the per-row parameters as tensors, so the CUDA decode graph runs it after the lm_head
  (runner.py); it computes the same function as `sample` row for row (greedy rows take the
  argmax, sampled rows the inverse CDF of softmax(logits / T), logprobs at the rows' T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TOP_K_ALL = 1 << 30  # SGLang's default top_k (1073741824) means "no top-k"

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix_uniform(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Uniform floats strictly inside (0, 1) from (seed, step), counter-based (splitmix64 finaliser).

    The finaliser maps 0 to 0, so the mixed input carries a constant: without it (seed 0, step 0)
    drew exactly 0.0, and inverse-CDF sampling then picked vocabulary id 0 whatever its
    probability. The 53-bit integer is centred in its cell ((k + 0.5) / 2**53), so no draw is 0."""
    with np.errstate(over="ignore"):
        x = (seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + steps.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03) + np.uint64(0x2545F4914F6CDD1D))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row parameters of one step (host side), built by the scheduler."""
    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    seeds: list[int]
    steps: list[int]                       # output position being sampled, per row
    banned: list[tuple[int, int]]          # (row, token) pairs masked to -inf (min_new_tokens)
    biases: list[tuple[int, int, float]]   # (row, token, bias) from logit_bias
    top_logprobs_num: int = 0


@dataclass
class SampleOut:
    tokens: torch.Tensor      # [B] int64
    logprobs: torch.Tensor    # [B] fp32, logprob of the token at its row's temperature
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def device_uniforms(sb: SamplingBatch, device: torch.device) -> torch.Tensor | None:
    """The step's uniforms (one per non-greedy row) on `device`, for `sample(..., uniforms=)`.

    A host-to-device copy from pageable memory waits for the stream to drain: made before the
    forward is launched it costs nothing, made inside `sample` it would wait for the forward and
    then launch the sampling kernels onto an idle GPU."""
    temps = np.asarray(sb.temperatures, dtype=np.float32)
    sampled = np.nonzero(~((temps <= 0.0) | (np.asarray(sb.top_ks) == 1)))[0]
    if not len(sampled):
        return None
    u = splitmix_uniform(np.asarray(sb.seeds, dtype=np.int64)[sampled],
                         np.asarray(sb.steps, dtype=np.int64)[sampled])
    return torch.from_numpy(u).to(device=device, dtype=torch.float32)


def sample(logits: torch.Tensor, sb: SamplingBatch, uniforms: torch.Tensor | None = None) -> SampleOut:
    """Sample one token per row of fp32 `logits` [B, V]; `uniforms` from `device_uniforms`, or
    computed here."""
    B, V = logits.shape
    dev = logits.device
    temps = np.asarray(sb.temperatures, dtype=np.float32)
    # The logprob distribution (convention above): logits / T, T = 1 for greedy rows. All-1 (the
    # usual RL setting) costs nothing; otherwise one [B, V] division, shared with the sampler below.
    lp_temps = np.where(temps > 0.0, temps, np.float32(1.0))
    lp_logits = logits if (lp_temps == 1.0).all() else \
        logits / torch.from_numpy(lp_temps).to(dev)[:, None]
    # log_softmax(x)[t] = x[t] - logsumexp(x): one reduction instead of a [B, V] write.
    lse = torch.logsumexp(lp_logits, dim=-1)
    proc = logits
    if sb.banned or sb.biases:
        proc = logits.clone()
        if sb.biases:
            r, t, b = zip(*sb.biases)
            proc.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                            torch.tensor(b, device=dev, dtype=proc.dtype), accumulate=True)
        if sb.banned:
            r, t = zip(*sb.banned)
            proc[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    greedy = (temps <= 0.0) | (np.asarray(sb.top_ks) == 1)
    sampled = np.nonzero(~greedy)[0]
    tokens = torch.argmax(proc, dim=-1) if greedy.any() else None
    if len(sampled):
        u = uniforms if uniforms is not None else device_uniforms(sb, dev)
        every_row = len(sampled) == B
        rows = None if every_row else torch.from_numpy(sampled).to(dev)
        if proc is logits:  # sampled rows have T > 0, so their lp_logits rows are logits / T
            scaled = lp_logits if every_row else lp_logits[rows]
        else:
            scaled = proc if every_row else proc[rows]
            if not (temps[sampled] == 1.0).all():
                scaled = scaled / torch.from_numpy(temps[sampled]).to(dev)[:, None]
        top_ps = np.asarray(sb.top_ps, dtype=np.float32)[sampled]
        top_ks = np.minimum(np.asarray(sb.top_ks, dtype=np.int64)[sampled], V)
        min_ps = np.asarray(sb.min_ps, dtype=np.float32)[sampled]
        truncating = (top_ps < 1.0) | (top_ks < V) | (min_ps > 0.0)
        if not truncating.any():
            picked = _inverse_cdf(torch.softmax(scaled, dim=-1), u)
        else:
            picked = torch.empty(len(sampled), dtype=torch.long, device=dev)
            plain = np.nonzero(~truncating)[0]
            if len(plain):
                idx = torch.from_numpy(plain).to(dev)
                picked[idx] = _inverse_cdf(torch.softmax(scaled[idx], dim=-1), u[idx])
            trunc = np.nonzero(truncating)[0]
            idx = torch.from_numpy(trunc).to(dev)
            picked[idx] = _sample_truncated(scaled[idx], u[idx], top_ps[trunc], top_ks[trunc],
                                            min_ps[trunc])
        tokens = picked if every_row else tokens.index_copy(0, rows, picked)
    logprobs = lp_logits.gather(1, tokens[:, None])[:, 0] - lse
    out = SampleOut(tokens=tokens, logprobs=logprobs)
    if sb.top_logprobs_num > 0:
        top_logits, out.top_ids = torch.topk(lp_logits, min(sb.top_logprobs_num, V), dim=-1)
        out.top_logprobs = top_logits - lse[:, None]
    return out


def is_plain(sb: SamplingBatch, vocab_size: int) -> bool:
    """Can `sample_plain` sample this batch (see the module docstring)?"""
    if sb.banned or sb.biases or sb.top_logprobs_num > 0:
        return False
    for t, k, p, m in zip(sb.temperatures, sb.top_ks, sb.top_ps, sb.min_ps):
        if t > 0.0 and k != 1 and (p < 1.0 or k < vocab_size or m > 0.0):
            return False
    return True


def plain_params(sb: SamplingBatch) -> np.ndarray:
    """[3, B] float32 rows for `sample_plain`: logprob temperature (T, 1 for greedy rows), uniform,
    greedy flag (1.0: argmax). Uniforms are drawn for every row (greedy rows ignore theirs)."""
    temps = np.asarray(sb.temperatures, dtype=np.float32)
    greedy = (temps <= 0.0) | (np.asarray(sb.top_ks) == 1)
    out = np.empty((3, len(temps)), dtype=np.float32)
    out[0] = np.where(temps > 0.0, temps, np.float32(1.0))
    out[1] = splitmix_uniform(np.asarray(sb.seeds, dtype=np.int64), np.asarray(sb.steps, dtype=np.int64))
    out[2] = greedy
    return out


def sample_plain(logits: torch.Tensor, lp_temps: torch.Tensor, uniforms: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for a plain batch, every per-row parameter a [B] tensor (no host data, no
    data-dependent shapes: it is captured in the decode graph). Returns (tokens int64, logprobs)."""
    lp_logits = logits / lp_temps[:, None]  # exact for T = 1: the same values `sample` uses
    lse = torch.logsumexp(lp_logits, dim=-1)
    drawn = _inverse_cdf(torch.softmax(lp_logits, dim=-1), uniforms)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), drawn)
    return tokens, lp_logits.gather(1, tokens[:, None])[:, 0] - lse


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # fp32 cumsum: rounding only moves the boundary between two adjacent tokens by ~1e-7 of mass,
    # and the result is still a deterministic function of (logits, seed, step).
    cdf = torch.cumsum(probs.float(), dim=-1)
    total = cdf[:, -1]
    # Keep the target strictly below the total: then the first cdf entry above it is a step up,
    # i.e. a token with positive probability (never one past the end, never a masked one).
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


def _sample_truncated(scaled: torch.Tensor, u: torch.Tensor, top_ps, top_ks, min_ps) -> torch.Tensor:
    dev = scaled.device
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    V = probs.shape[-1]
    rank = torch.arange(V, device=dev)[None, :]
    keep = rank < torch.from_numpy(top_ks).to(dev)[:, None]
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep &= before < torch.from_numpy(top_ps).to(dev)[:, None]
    keep &= sorted_p >= torch.from_numpy(min_ps).to(dev)[:, None] * sorted_p[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    kept = sorted_p * keep
    pos = _inverse_cdf(kept, u)
    return order.gather(1, pos[:, None])[:, 0]
