"""Sampling seeds: the one derivation of every seed a run sends with a sampled request.

    sample_seed(run_seed, prompt_index, sample_index, attempt)  a training sample (rollout)
    eval_seed(run_seed, prompt_index, sample_index)             a held-out sample (evaluator)
    turn_seed(seed, turn)                                       turn k of that sample's episode

Design decisions:
- A seed is a hash (blake2b) of a domain tag and a tuple of integers, mapped into [1, 2**31 - 1).
  A linear formula made neighbours collide and gave (0, 0, 0, 0) the seed 0; a hash gives every
  tuple its own stream, and no seed is 0 (the engines' counter-based sampler draws from it).
- Domains keep the streams apart: an eval sample never repeats the draws of a training sample
  of the same prompt index, and a turn's seed never equals a sample's but by a 2**-31 chance.
- Turn 0 keeps the sample's seed and turn k > 0 hashes (seed, k): a single-turn request is the
  one the built-in worker sends (so `miles replay --resend` rebuilds it from the recorded
  sample), and the turns of an episode draw different uniforms. The seed is already a hash of
  (run seed, prompt, sample, attempt), so a turn's seed is a function of the whole tuple.
- Pure stdlib, importing nothing of ours: the actors, the envs, the harnesses and the replay CLI
  all derive seeds here, none imports another layer for it.
"""

from __future__ import annotations

import hashlib

SEED_LIMIT = 2**31 - 1   # seeds lie in [1, SEED_LIMIT): a positive int32 on every engine


def derive_seed(domain: str, *parts: int) -> int:
    """A seed in [1, 2**31 - 1) from a domain tag and integers (any sign, any size)."""
    key = f"miles-seed/{domain}/" + ",".join(str(int(p)) for p in parts)
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (SEED_LIMIT - 1)


def sample_seed(run_seed: int, prompt_index: int, sample_index: int, attempt: int = 0) -> int:
    """Sample `sample_index` of training prompt `prompt_index`, generation attempt `attempt`."""
    return derive_seed("rollout", run_seed, prompt_index, sample_index, attempt)


def eval_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """Sample `sample_index` of held-out prompt `prompt_index` (pass@k's j-th draw)."""
    return derive_seed("eval", run_seed, prompt_index, sample_index)


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn `turn` (0-based) of an episode whose sample seed is `seed`."""
    return int(seed) if turn == 0 else derive_seed("turn", seed, turn)
