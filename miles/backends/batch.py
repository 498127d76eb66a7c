"""Checking a training batch at the backend's door, before any forward pass or optimizer step.

Design decisions:
- A rank receives either the whole step's batch (`TrainStep.index` None: `miles replay`, tests,
  user code) or only its data-parallel share plus a `BatchIndex` of the whole batch (what the
  driver sends). Either way it checks every sample it holds (`find_batch_error`; a shard also
  against the index: lengths, trained tokens, groups and rollouts at the stated positions, and
  exactly the positions the batch plan gives this rank, `find_shard_error`). The message is
  returned, not raised; the backend agrees on the verdict with the other ranks (one small
  all-reduce) and then every rank raises together, so one bad sample can never leave the others
  blocked in a collective.
- `CheckedBatch` is the one type the backends train from, whichever way the batch came: arrays
  over ALL samples (from the samples, or from the index) and the samples this rank holds at
  their global positions, so the plan, the denominators and the metrics are the same function
  of the same numbers on both paths.
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
from miles.wire.messages import BatchIndex, Sample, scalar_reward

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline")


@dataclass
class CheckedBatch:
    """A batch that passed `find_batch_error`, with per-sample numbers the planner needs.

    Every array covers ALL samples of the step batch, by global position. `samples[i]` and
    `loss_masks[i]` are None where another data-parallel rank holds sample i (a sharded step);
    a rank only ever touches its own samples, which the plan gives it."""
    samples: list[Sample | None]
    rewards: np.ndarray          # float64 [S] (0.0 where the sample is another rank's)
    group_index: np.ndarray      # int64 [S], groups numbered in order of first appearance
    rollout_index: np.ndarray    # int64 [S]; a sample without rollout_id is its own rollout
    loss_masks: list[np.ndarray | None]  # uint8 per sample, over the response (all ones when absent)
    lengths: list[int]           # len(tokens) per sample
    trained_tokens: np.ndarray   # int64 [S]: response tokens with loss_mask 1 (step denominators)
    with_rollout_logprobs: bool  # every sample of the batch has rollout log-probs


def sample_name(i: int, s: Sample) -> str:
    return f"sample {i} (group_id={s.group_id!r}, rollout_id={s.rollout_id!r})"


def find_batch_error(samples: Sequence[Sample], *, vocab_size: int, loss: LossConfig,
                     reward_key: str = "", need_rollout_logprobs: bool = False,
                     positions: Sequence[int] | None = None, allow_empty: bool = False) -> str | None:
    """The first problem with the batch as one clear message, or None when it can be trained on.

    `positions`: each sample's position in the whole batch, for the message (a sharded step);
    `allow_empty`: a shard may be empty (more DP ranks than groups)."""
    if len(samples) == 0 and not allow_empty:
        return "train batch is empty: a training step needs at least one sample"
    rollout_seen: dict[str, tuple[int, float, str]] = {}
    for j, s in enumerate(samples):
        i = j if positions is None else positions[j]
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


def group_numbers(samples: Sequence[Sample]) -> np.ndarray:
    """int64 [S]: groups numbered in order of first appearance (what the batch planner groups by;
    the driver computes it too, to shard R3 routing by rank)."""
    groups: dict[str, int] = {}
    out = np.empty(len(samples), np.int64)
    for i, s in enumerate(samples):
        # An empty group_id makes the sample its own group (only allowed by non-group estimators).
        out[i] = groups.setdefault(s.group_id or f"\0sample{i}", len(groups))
    return out


def rollout_numbers(samples: Sequence[Sample]) -> np.ndarray:
    """int64 [S]: rollouts numbered in order of first appearance; no rollout_id: its own."""
    rollouts: dict[str, int] = {}
    out = np.empty(len(samples), np.int64)
    for i, s in enumerate(samples):
        out[i] = rollouts.setdefault(s.rollout_id or f"\0sample{i}", len(rollouts))
    return out


def trained_tokens(s: Sample) -> int:
    return s.response_length if s.loss_mask is None else int(np.count_nonzero(s.loss_mask))


def batch_arrays(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """The whole-batch arrays of a `BatchIndex` (int32: a few bytes per sample on the wire)."""
    return {"lengths": np.array([len(s.tokens) for s in samples], np.int32),
            "group_index": group_numbers(samples).astype(np.int32),
            "rollout_index": rollout_numbers(samples).astype(np.int32),
            "trained_tokens": np.array([trained_tokens(s) for s in samples], np.int32)}


def number_batch(samples: Sequence[Sample], *, loss: LossConfig, reward_key: str = "") -> CheckedBatch:
    """The per-sample arrays of an already checked (whole) batch."""
    rewards = np.array([scalar_reward(s.reward, reward_key) if loss.loss_type == "policy" else 0.0
                        for s in samples], np.float64)
    masks = [np.ones(s.response_length, np.uint8) if s.loss_mask is None
             else s.loss_mask.astype(np.uint8) for s in samples]
    return CheckedBatch(list(samples), rewards, group_numbers(samples), rollout_numbers(samples), masks,
                        [len(s.tokens) for s in samples],
                        np.array([int(m.sum()) for m in masks], np.int64),
                        all(s.rollout_logprobs is not None for s in samples))


def number_shard(samples: Sequence[Sample], index: BatchIndex, *, loss: LossConfig,
                 reward_key: str = "") -> CheckedBatch:
    """A checked shard (`find_shard_error` passed) as the batch the index describes: global arrays
    from the index, this rank's samples at their global positions."""
    n = len(index.lengths)
    held: list[Sample | None] = [None] * n
    masks: list[np.ndarray | None] = [None] * n
    rewards = np.zeros(n, np.float64)
    local = number_batch(samples, loss=loss, reward_key=reward_key) if samples else None
    for j, i in enumerate(index.positions.tolist()):
        held[i], masks[i], rewards[i] = samples[j], local.loss_masks[j], local.rewards[j]
    return CheckedBatch(held, rewards, index.group_index.astype(np.int64),
                        index.rollout_index.astype(np.int64), masks, index.lengths.tolist(),
                        index.trained_tokens.astype(np.int64), bool(index.all_rollout_logprobs))


def find_shard_error(samples: Sequence[Sample], index: BatchIndex, *, owners_of, dp_rank: int,
                     vocab_size: int, loss: LossConfig, reward_key: str = "",
                     need_rollout_logprobs: bool = False) -> str | None:
    """The first problem with this rank's shard or its agreement with the index, as one message.

    `owners_of(group_index, lengths)`: the DP rank of every sample under the batch plan; the
    shard must be exactly the samples the plan gives `dp_rank`."""
    fields = ("lengths", "group_index", "rollout_index", "trained_tokens")
    arrays = [getattr(index, f) for f in fields] + [index.positions]
    for name, a in zip(fields + ("positions",), arrays):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
            return f"train batch index: {name}: expected a 1-D integer array, got " \
                   f"{type(a).__name__} {getattr(a, 'dtype', '')} {getattr(a, 'shape', '')}"
    n = len(index.lengths)
    if n == 0:
        return "train batch index: lengths is empty: a training step needs at least one sample"
    for name, a in zip(fields[1:], arrays[1:4]):
        if len(a) != n:
            return f"train batch index: {name} has {len(a)} entries, lengths has {n}"
    pos = index.positions
    if len(pos) != len(samples):
        return f"train batch index: {len(pos)} positions for {len(samples)} samples in the shard"
    if len(pos) and (pos.min() < 0 or pos.max() >= n or np.any(np.diff(pos) <= 0)):
        return f"train batch index: positions {pos.tolist()[:8]}... must increase within [0, {n})"
    owned = np.flatnonzero(owners_of(index.group_index.astype(np.int64), index.lengths.tolist()) == dp_rank)
    if not np.array_equal(owned, pos):
        return (f"train batch index: this rank (DP rank {dp_rank}) holds samples {pos.tolist()[:8]} "
                f"but the batch plan gives it {owned.tolist()[:8]}")
    error = find_batch_error(samples, vocab_size=vocab_size, loss=loss, reward_key=reward_key,
                             need_rollout_logprobs=need_rollout_logprobs, positions=pos.tolist(),
                             allow_empty=True)
    if error:
        return error
    groups: dict[str, int] = {}
    numbers: dict[int, str] = {}
    rollouts: dict[str, int] = {}
    for j, s in enumerate(samples):
        i = int(pos[j])
        where = f"train batch: {sample_name(i, s)}"
        want = {"lengths": len(s.tokens), "trained_tokens": trained_tokens(s)}
        for name, value in want.items():
            if int(getattr(index, name)[i]) != value:
                return f"{where}: index {name}[{i}]={int(getattr(index, name)[i])}, the sample has {value}"
        g = int(index.group_index[i])
        key = s.group_id or f"\0sample{i}"
        seen_g, seen_key = groups.setdefault(key, g), numbers.setdefault(g, key)
        if seen_g != g or seen_key != key:
            name = "(none)" if seen_key.startswith("\0") else repr(seen_key)
            return (f"{where}: index group_index[{i}]={g} disagrees with the shard's other samples "
                    f"(group_id {s.group_id!r} is group {seen_g} there, group {g} is group_id {name})")
        r = int(index.rollout_index[i])
        if s.rollout_id and rollouts.setdefault(s.rollout_id, r) != r:
            return (f"{where}: index rollout_index[{i}]={r}, but rollout_id {s.rollout_id!r} is "
                    f"rollout {rollouts[s.rollout_id]} elsewhere in the shard")
        if index.all_rollout_logprobs and s.rollout_logprobs is None:
            return f"{where}: rollout_logprobs: missing (None), but the index says every sample has them"
    return None
