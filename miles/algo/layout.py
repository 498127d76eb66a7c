"""Token-stream layout: packed 1-D per-token tensors with `cu_seqlens`, and the padded [B, T] bridge.

Design decisions:
- Every algo function works on flat per-token tensors plus `cu_seqlens` (int64 [num_samples + 1],
  sample i owns tokens cu_seqlens[i]:cu_seqlens[i+1]). This is what the FSDP backend packs; a padded
  [B, T] batch is the special case where every sample has length T (`padded_cu_seqlens`), with the
  padding hidden by the loss mask.
- Sequence-level ops go through `to_padded` (one index_put into a [num_samples, max_len] grid) rather
  than `index_add_`/`scatter_add_`: index_put with unique indices has no atomics, so results are
  deterministic on CUDA as well as CPU, and it is differentiable.
- A sample is never split across micro-batches (the backend packs whole samples), so a per-sample
  reduction inside one micro-batch always sees the whole sample.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from miles.algo.checks import require_1d, require_cu_seqlens


def ids_to_index(ids: Sequence[Hashable], *, empty_is_unique: bool = False) -> torch.Tensor:
    """Map ids (e.g. the wire's string group_id / rollout_id) to int64 indices, in first-seen order.

    With `empty_is_unique`, every "" or None gets its own index: a sample without a rollout_id is a
    rollout of its own.
    """
    index: dict[Hashable, int] = {}
    out = []
    for position, key in enumerate(ids):
        if empty_is_unique and (key is None or key == ""):
            key = ("<unique>", position)
        out.append(index.setdefault(key, len(index)))
    return torch.tensor(out, dtype=torch.int64)


def cu_seqlens_from_lengths(lengths: torch.Tensor | list[int]) -> torch.Tensor:
    """[num_samples] token counts -> int64 cu_seqlens [num_samples + 1]."""
    lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
    require_1d("lengths", lengths_t)
    if bool((lengths_t < 0).any()):
        raise ValueError(f"lengths must be non-negative, got {lengths_t.tolist()}")
    return torch.cat([lengths_t.new_zeros(1), torch.cumsum(lengths_t, 0)])


def padded_cu_seqlens(batch_size: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """cu_seqlens for a padded [batch_size, seq_len] batch flattened with `.reshape(-1)`."""
    if batch_size < 1 or seq_len < 0:
        raise ValueError(f"padded batch needs batch_size >= 1 and seq_len >= 0, got ({batch_size}, {seq_len})")
    return torch.arange(batch_size + 1, dtype=torch.int64, device=device) * seq_len


def sample_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens[1:] - cu_seqlens[:-1]


def token_sample_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [num_tokens]: which sample each token belongs to."""
    lengths = sample_lengths(cu_seqlens)
    samples = torch.arange(lengths.shape[0], device=cu_seqlens.device)
    return torch.repeat_interleave(samples, lengths)


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
    """[num_tokens] -> [num_samples, max_len], left-aligned, `pad_value` after each sample's end."""
    lengths = sample_lengths(cu_seqlens)
    num_samples = lengths.shape[0]
    max_len = int(lengths.max()) if num_samples else 0
    sample = token_sample_index(cu_seqlens)
    position = torch.arange(x.shape[0], device=x.device) - cu_seqlens[sample]
    grid = x.new_full((num_samples, max_len), pad_value)
    return grid.index_put((sample, position), x)


def from_padded(grid: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_padded`: [num_samples, max_len] -> [num_tokens]."""
    sample = token_sample_index(cu_seqlens)
    position = torch.arange(sample.shape[0], device=grid.device) - cu_seqlens[sample]
    return grid[sample, position]


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of a per-token tensor: [num_tokens] -> [num_samples] (differentiable)."""
    return to_padded(x, cu_seqlens).sum(dim=1)


def broadcast_to_tokens(per_sample: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[num_samples] -> [num_tokens]: every token gets its sample's value."""
    return torch.repeat_interleave(per_sample, sample_lengths(cu_seqlens))


def loss_mask_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [num_samples]: number of trained (mask = 1) tokens per sample."""
    mask = require_1d("loss_mask", loss_mask)
    cu = check_stream(cu_seqlens, mask.shape[0], mask.device)
    return segment_sum(mask.to(torch.int64), cu)


def check_stream(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Validate cu_seqlens against a token stream; return it as int64 on the tokens' device.

    The backend may keep cu_seqlens (or any per-sample metadata) on the CPU while the token tensors
    live on the GPU; every entry point moves the metadata, never the tokens.
    """
    cu = require_cu_seqlens(cu_seqlens, num_tokens)
    return cu.to(device=device, dtype=torch.int64)
