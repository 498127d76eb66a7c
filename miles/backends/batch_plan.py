"""The batch plan: which data-parallel rank trains which sample, in which optimizer step and
micro-batch. A pure function of the groups and lengths, so every rank and the driver compute the
same plan (the driver sends each rank only its samples, `miles.loop.shard_batch`). A contract of
the RL layer (docs/architecture.md#layers): numpy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MicroBatchPlan = list[int] | None          # sample indices, or None for a dummy
RankPlan = list[MicroBatchPlan]
StepPlan = list[RankPlan]                  # one RankPlan per DP rank


def split_groups_into_steps(group_index: np.ndarray, steps: int) -> list[list[int]]:
    """Sample indices of each optimizer step; groups kept whole, in order, counts as even as possible."""
    order = list(dict.fromkeys(group_index.tolist()))
    if steps > len(order):
        raise ValueError(f"train.steps_per_train={steps} but the batch has only {len(order)} "
                         "group(s); each optimizer step needs at least one whole group")
    members: dict[int, list[int]] = {g: [] for g in order}
    for i, g in enumerate(group_index.tolist()):
        members[g].append(i)
    bounds = np.linspace(0, len(order), steps + 1).round().astype(int)
    return [[i for g in order[a:b] for i in members[g]] for a, b in zip(bounds[:-1], bounds[1:])]


def assign_groups_to_ranks(indices: Sequence[int], group_index: np.ndarray, lengths: Sequence[int],
                           world_size: int) -> list[list[int]]:
    """Sample indices per rank: whole groups, largest first, each to the rank with fewest tokens."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(int(group_index[i]), []).append(i)
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    by_size = sorted(groups.values(), key=lambda m: (-sum(lengths[i] for i in m), m[0]))
    for members in by_size:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[rank].extend(members)
        load[rank] += sum(lengths[i] for i in members)
    return [sorted(r) for r in out]


def pack_first_fit(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices, each bin at most max_tokens (or one long sample)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def plan_batch(group_index: np.ndarray, lengths: Sequence[int], *, world_size: int, steps: int,
               max_tokens: int) -> list[StepPlan]:
    """[step][rank][micro-batch] -> sample indices (None = dummy), equal micro-batch counts per step."""
    plan: list[StepPlan] = []
    for step_indices in split_groups_into_steps(group_index, steps):
        per_rank = [pack_first_fit(r, lengths, max_tokens)
                    for r in assign_groups_to_ranks(step_indices, group_index, lengths, world_size)]
        n = max(len(mbs) for mbs in per_rank)
        plan.append([list(mbs) + [None] * (n - len(mbs)) for mbs in per_rank])
    return plan


def sample_owners(group_index: np.ndarray, lengths: Sequence[int], *, world_size: int, steps: int,
                  max_tokens: int) -> np.ndarray:
    """int64 [S]: the data-parallel rank that trains each sample under `plan_batch` (the same pure
    function, so the driver can send each rank only its samples' routing, R3)."""
    owners = np.full(len(lengths), -1, np.int64)
    for step in plan_batch(group_index, lengths, world_size=world_size, steps=steps, max_tokens=max_tokens):
        for rank, mbs in enumerate(step):
            for mb in mbs:
                owners[mb or []] = rank
    return owners
