"""Checking a training batch at the backend's door, before any forward pass or optimizer step.

Design decisions:
- Every rank receives the whole step's batch and checks all of it, so every rank reaches the same
  verdict. `find_batch_error` returns the message instead of raising; the backend agrees on it with
  the other ranks (one small all-reduce) and then every rank raises together, so one bad sample can
  never leave the others blocked in a collective.
- A message names the sample (position, group_id, rollout_id), the field and the bad value.
- Group and rollout ids are strings on the wire; the algo functions want integers, so they are
  numbered here in order of first appearance (deterministic on every rank).
- Rewards become numbers through the one accessor, `Sample.scalar_reward(train.reward_key)`, as in
  the buffer, the loop and the evaluator, so every place trains on and logs the same number; a dict
  reward without a matching `reward_key` is refused with the accessor's message.
- Rollout log-probs are required (never zero-filled) where the policy loss uses them:
  `train.old_logprobs = "rollout"`, `algo.use_tis`, `algo.use_mis`. A sample without them is
  refused naming the sample and the setting. An all-zero array is NOT refused: log p = 0.0 exactly
  is what float32 gives a token of probability > 1 - 6e-8, which a confident policy (greedy-like
  sampling, a short learned answer) produces for whole responses; refusing it would stop healthy
  runs, and zero-filling is the rollout side's bug to fix at its source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from miles.algo import LossConfig
from miles.wire.messages import Sample, scalar_reward

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline")


@dataclass
class CheckedBatch:
    """A batch that passed `find_batch_error`, with per-sample numbers the planner needs."""
    samples: list[Sample]
    rewards: np.ndarray          # float64 [S]
    group_index: np.ndarray      # int64 [S], groups numbered in order of first appearance
    rollout_index: np.ndarray    # int64 [S]; a sample without rollout_id is its own rollout
    loss_masks: list[np.ndarray]  # uint8 per sample, over the response (all ones when absent)

    @property
    def lengths(self) -> list[int]:
        return [len(s.tokens) for s in self.samples]


def sample_name(i: int, s: Sample) -> str:
    return f"sample {i} (group_id={s.group_id!r}, rollout_id={s.rollout_id!r})"


def find_batch_error(samples: Sequence[Sample], *, vocab_size: int, loss: LossConfig,
                     reward_key: str = "", need_rollout_logprobs: bool = False) -> str | None:
    """The first problem with the batch as one clear message, or None when it can be trained on."""
    if len(samples) == 0:
        return "train batch is empty: a training step needs at least one sample"
    rollout_seen: dict[str, tuple[int, float, str]] = {}
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            return f"train batch: item {i} is a {type(s).__name__}, expected miles.wire Sample"
        where = sample_name(i, s)
        problem = _sample_problem(s, vocab_size=vocab_size, loss=loss, reward_key=reward_key,
                                  need_rollout_logprobs=need_rollout_logprobs)
        if problem:
            return f"train batch: {where}: {problem}"
        if s.rollout_id:
            reward = scalar_reward(s.reward, reward_key) if loss.loss_type == "policy" else 0.0
            first = rollout_seen.setdefault(s.rollout_id, (i, reward, s.group_id))
            if first[1] != reward or first[2] != s.group_id:
                return (f"train batch: {where}: siblings of rollout_id {s.rollout_id!r} disagree: "
                        f"sample {first[0]} has reward {first[1]} in group {first[2]!r}, this one "
                        f"reward {reward} in group {s.group_id!r}")
    return None


def _sample_problem(s: Sample, *, vocab_size: int, loss: LossConfig, reward_key: str,
                    need_rollout_logprobs: bool) -> str | None:
    tokens = s.tokens
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        return f"tokens: expected a 1-D integer array, got {type(tokens).__name__} " \
               f"{getattr(tokens, 'dtype', '')} {getattr(tokens, 'shape', '')}"
    n = len(tokens)
    if s.response_length < 1:
        return f"response_length={s.response_length}: empty response, nothing to train on"
    if s.response_length >= n:
        return (f"response_length={s.response_length} with len(tokens)={n}: the prompt must keep at "
                "least one token (the first response token is predicted from it)")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"tokens: id {bad} outside the vocabulary [0, {vocab_size})"
    try:
        s.validate()  # lengths of per-token fields and version spans
    except ValueError as exc:
        return str(exc).removeprefix("Sample.")
    mask = s.loss_mask
    if mask is not None:
        if mask.ndim != 1:
            return f"loss_mask: expected 1-D, got shape {mask.shape}"
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            return f"loss_mask: value {mask[bad[0]]} at response token {bad[0]}; only 0 and 1 allowed"
    keep = np.ones(s.response_length, bool) if mask is None else mask.astype(bool)
    lp = s.rollout_logprobs
    if lp is not None:
        bad = np.flatnonzero(~np.isfinite(lp) & keep)
        if bad.size:
            return f"rollout_logprobs: non-finite value {lp[bad[0]]} at trained response token {bad[0]}"
        bad = np.flatnonzero((lp > 0) & keep)
        if bad.size:
            return f"rollout_logprobs: value {lp[bad[0]]} > 0 at response token {bad[0]}; a log-prob is <= 0"
    elif loss.loss_type == "policy" and (loss.use_tis or loss.use_mis or need_rollout_logprobs):
        why = ("algo.use_tis = true" if loss.use_tis else "algo.use_mis = true" if loss.use_mis
               else "train.old_logprobs = 'rollout'")
        return (f"rollout_logprobs: missing (None), required by {why}; the engine must return the "
                "log-prob of every sampled token")
    if loss.loss_type == "policy":
        if s.reward is None:
            return "reward: missing (None); the policy loss needs a scalar reward"
        try:
            value = scalar_reward(s.reward, reward_key)
        except (TypeError, ValueError) as exc:
            return f"reward = {s.reward!r}: {exc}"
        if not math.isfinite(value):
            return f"reward={value}: not a finite number"
        if loss.advantage_estimator in GROUP_ESTIMATORS and not s.group_id:
            return f"group_id: empty, but {loss.advantage_estimator} normalizes within groups"
    return None


def check_batch(samples: Sequence[Sample], *, vocab_size: int, loss: LossConfig,
                reward_key: str = "", need_rollout_logprobs: bool = False) -> CheckedBatch:
    """Raise ValueError with `find_batch_error`'s message, else number groups and rollouts."""
    error = find_batch_error(samples, vocab_size=vocab_size, loss=loss, reward_key=reward_key,
                             need_rollout_logprobs=need_rollout_logprobs)
    if error:
        raise ValueError(error)
    return number_batch(samples, loss=loss, reward_key=reward_key)


def number_batch(samples: Sequence[Sample], *, loss: LossConfig, reward_key: str = "") -> CheckedBatch:
    """The per-sample arrays of an already checked batch."""
    groups: dict[str, int] = {}
    rollouts: dict[str, int] = {}
    group_index = np.empty(len(samples), np.int64)
    rollout_index = np.empty(len(samples), np.int64)
    for i, s in enumerate(samples):
        # An empty group_id makes the sample its own group (only allowed by non-group estimators).
        group_index[i] = groups.setdefault(s.group_id or f"\0sample{i}", len(groups))
        rollout_index[i] = rollouts.setdefault(s.rollout_id or f"\0sample{i}", len(rollouts))
    rewards = np.array([scalar_reward(s.reward, reward_key) if loss.loss_type == "policy" else 0.0
                        for s in samples], np.float64)
    masks = [np.ones(s.response_length, np.uint8) if s.loss_mask is None
             else s.loss_mask.astype(np.uint8) for s in samples]
    return CheckedBatch(list(samples), rewards, group_index, rollout_index, masks)
