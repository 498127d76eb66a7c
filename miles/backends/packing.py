"""Planning a training batch: optimizer steps, data-parallel ranks, packed micro-batches.

Design decisions:
- The plan is a pure function of the batch's group numbers and lengths and the world size, so
  every rank computes the same plan for all ranks without talking to the others (from the whole
  batch, or from the `BatchIndex` sent with its shard); each rank then runs its own row of it. The
  driver computes it once too (`sample_owners`) to send each DP rank only its samples.
- Steps (when one train() call takes several optimizer steps) and ranks receive whole groups: group
  statistics (GRPO means/stds) then never need a collective, and a rollout's siblings, which always
  share a group, stay together. Groups go to the least-loaded rank by tokens, largest first.
- Within a rank, samples are packed first-fit-decreasing into micro-batches of at most
  `max_tokens` tokens (a longer sample gets a micro-batch of its own; it cannot be split). No
  padding: one row per micro-batch, `position_ids` restarting at 0 for each sample.
- FSDP runs collectives in every forward and backward, so all ranks must run the same number of
  micro-batches. Ranks with fewer get `None` entries, which the backend runs as a two-token dummy
  with zero loss weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles.backends.policy import PackedInputs

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


@dataclass
class PackedMicroBatch:
    """Model inputs plus the per-response-token tensors the loss needs, for one micro-batch."""
    inputs: PackedInputs
    sample_indices: list[int]          # into the step batch; empty for a dummy
    response_cu_seqlens: torch.Tensor  # int64 [n + 1] over the response tokens (algo layout)
    loss_mask: torch.Tensor            # float32 [R]
    rollout_logprobs: torch.Tensor | None  # float32 [R], when every sample has them
    num_tokens: int                    # tokens in the row (prompt + response)

    @property
    def is_dummy(self) -> bool:
        return not self.sample_indices


def pack_samples(tokens: Sequence[np.ndarray], response_lengths: Sequence[int],
                 loss_masks: Sequence[np.ndarray], rollout_logprobs: Sequence[np.ndarray | None],
                 sample_indices: list[int], device: torch.device) -> PackedMicroBatch:
    """Concatenate whole samples into one row (position_ids restart per sample)."""
    lengths = [len(t) for t in tokens]
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    rows, targets = [], []
    for start, toks, n_resp in zip(bounds[:-1], tokens, response_lengths):
        n = len(toks)
        rows.append(np.arange(start + n - n_resp - 1, start + n - 1, dtype=np.int64))
        targets.append(toks[n - n_resp:].astype(np.int64))
    have_lp = all(lp is not None for lp in rollout_logprobs)

    def dev(a, dtype):
        return torch.as_tensor(a, dtype=dtype).to(device, non_blocking=True)

    inputs = PackedInputs(
        input_ids=dev(np.concatenate(tokens).astype(np.int64), torch.int64)[None],
        position_ids=dev(positions, torch.int64)[None],
        cu_seqlens=dev(bounds, torch.int32),
        seq_bounds=tuple(int(b) for b in bounds),
        max_seqlen=int(max(lengths)),
        logprob_rows=dev(np.concatenate(rows), torch.int64),
        targets=dev(np.concatenate(targets), torch.int64),
    )
    return PackedMicroBatch(
        inputs=inputs,
        sample_indices=list(sample_indices),
        response_cu_seqlens=dev(np.concatenate([[0], np.cumsum(response_lengths)]), torch.int64),
        loss_mask=dev(np.concatenate(loss_masks), torch.float32),
        rollout_logprobs=dev(np.concatenate(rollout_logprobs), torch.float32) if have_lp else None,
        num_tokens=int(bounds[-1]),
    )


def dummy_microbatch(device: torch.device) -> PackedMicroBatch:
    """Two tokens, one response token, zero loss mask: keeps a rank in step with the collectives."""
    return pack_samples([np.zeros(2, np.int64)], [1], [np.zeros(1, np.uint8)], [None], [], device)


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
