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
