"""Context parallelism on the local layer spec (no Transformer Engine): all-gather K and V.

    layout = cp_layout(seq_lens, cp, cp_rank, device)   # once per micro-batch row
    ids = ids[:, layout.local_index]                     # this CP rank's L / cp tokens
    attach(params, layout)                               # our core attention and rope read it
    ... the model runs ...
    logp = layout.gather_rows(logp_mine, mine, rows)     # every CP rank: the whole row's values

Design decisions:
- Row-level load balance: a packed row of L tokens (padded to a multiple of 2 x cp, times tp
  under sequence parallelism) is cut into 2 x cp equal chunks, and CP rank r holds chunks r and
  2cp - 1 - r: megatron's zigzag order, applied to the row rather than to each sample, so no
  sample needs padding of its own. For a row holding one long sample (what CP is for) each rank
  gets the same causal work; packed short samples come out close.
- Attention all-gathers K and V over the CP group once per layer (Llama 3's CP, megatron's
  "all_gather" cp_comm_type). A sample's tokens on this rank form at most two contiguous runs;
  each run is a query segment whose key segment is the sample's prefix ending where the run
  ends, so every segment is causal aligned bottom-right. One FlashAttention varlen call on CUDA
  when the start-up probe shows torch's kernel is bottom-right causal for unequal lengths
  (`attention.varlen_qk_ready`), else one SDPA per segment with an explicit lower-right mask.
  The gather's backward reduce-scatters the K/V gradients (megatron's
  gather_from_sequence_parallel_region on the CP group), so a key's gradient sums the queries of
  every rank that read it.
- Rope: each local token's position inside its sample rides on the cu_seqlens tensor that
  megatron hands to apply_rotary_pos_emb (`miles_positions`); our thd rope reads it.
- Loss: each rank computes the log-probs of the response rows it holds; `gather_rows` puts them
  in the micro-batch's row order and all-reduces over CP forward, identity backward (megatron's
  reduce_from_tensor_model_parallel_region on the CP group). Every CP rank then computes the same
  loss from the same values, and each rank's gradient flows only through its own rows. Metrics
  come from CP rank 0; parameter gradients are summed over DP x CP by megatron's DDP.
- R3: the padded row's routing rows are taken at `local_index` before the SP split
  (megatron_replay.rows_for).
- The layout is built on the host from the row's sample lengths (ints the batch plan already
  has), once per micro-batch; nothing per layer syncs the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles.backends import attention as miles_attention


@dataclass(frozen=True)
class CpLayout:
    """Which tokens of one packed row this CP rank holds, and whom each of them attends to."""

    cp: int
    rank: int
    length: int                  # the whole (padded) row
    local_index: torch.Tensor    # [L / cp] int64: the row positions held here, in local order
    local_index_host: torch.Tensor   # the same on the host (R3's routing rows live there)
    positions: torch.Tensor      # [L / cp] int64: each one's position inside its sample
    local_of_row: torch.Tensor   # [L] int64: a row position's index here, -1 on another rank
    kv_index: torch.Tensor       # [K] int64: into the gathered (rank-major) keys, per segment
    cu_q: torch.Tensor           # [S + 1] int32: query segments over the local tokens
    cu_k: torch.Tensor           # [S + 1] int32: their key segments over kv_index
    segments: tuple[tuple[int, int, int, int], ...]   # (q start, q end, k start, k end), host ints
    max_q: int
    max_k: int


def cp_chunk_multiple(cp: int, tp_if_sp: int = 1) -> int:
    """What a row's length must be a multiple of: 2 x cp chunks, each split over TP under SP."""
    return 2 * cp * tp_if_sp


def local_rows(length: int, cp: int, rank: int) -> np.ndarray:
    """The row positions CP rank `rank` holds: chunks rank and 2cp - 1 - rank of 2cp."""
    if length % (2 * cp):
        raise ValueError(f"a row of {length} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks")
    c = length // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return np.concatenate([np.arange(first, first + c), np.arange(second, second + c)])


def cp_layout(seq_lens: Sequence[int], cp: int, rank: int, device: torch.device | str) -> CpLayout:
    """The layout of one packed row whose samples (the padding segment included) have these lengths."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(seq_lens, dtype=np.int64))])
    length = int(bounds[-1])
    held = [local_rows(length, cp, r) for r in range(cp)]
    mine = held[rank]
    gathered_at = np.empty(length, dtype=np.int64)      # row position -> index in the gathered K/V
    gathered_at[np.concatenate(held)] = np.arange(length)
    sample_of = np.searchsorted(bounds[1:], mine, side="right")
    positions = mine - bounds[sample_of]
    local_of_row = np.full(length, -1, dtype=np.int64)
    local_of_row[mine] = np.arange(len(mine))
    # Query segments: maximal runs of consecutive row positions inside one sample.
    breaks = np.flatnonzero((np.diff(mine) != 1) | (np.diff(sample_of) != 0)) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(mine)]])
    segments, kv, k_at = [], [], 0
    for a, b in zip(starts.tolist(), ends.tolist()):
        sample_start = int(bounds[sample_of[a]])
        k_rows = np.arange(sample_start, int(mine[b - 1]) + 1)
        segments.append((a, b, k_at, k_at + len(k_rows)))
        kv.append(gathered_at[k_rows])
        k_at += len(k_rows)
    as_device = lambda a, dtype=torch.int64: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return CpLayout(
        cp=cp, rank=rank, length=length, local_index=as_device(mine),
        local_index_host=torch.as_tensor(mine, dtype=torch.int64), positions=as_device(positions),
        local_of_row=as_device(local_of_row), kv_index=as_device(np.concatenate(kv)),
        cu_q=as_device([0] + [s[1] for s in segments], torch.int32),
        cu_k=as_device([0] + [s[3] for s in segments], torch.int32), segments=tuple(segments),
        max_q=max(b - a for a, b, _, _ in segments), max_k=max(d - c for _, _, c, d in segments))


def attach(params, layout: CpLayout) -> None:
    """Hand the layout to our core attention (`params.miles_cp`) and rope (the positions on the
    cu_seqlens tensor megatron passes to apply_rotary_pos_emb)."""
    params.miles_cp = layout
    params.cu_seqlens_q.miles_positions = layout.positions
    params.cu_seqlens_kv.miles_positions = layout.positions


def _cp_group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CpLayout,
                 scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this rank's T = L / cp tokens -> [T, Hq * D]."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    t, hq, d = q.shape
    group = _cp_group()
    k_all = gather_from_sequence_parallel_region(k.contiguous(), True, group=group)
    v_all = gather_from_sequence_parallel_region(v.contiguous(), True, group=group)
    ks, vs = k_all.index_select(0, layout.kv_index), v_all.index_select(0, layout.kv_index)
    if q.is_cuda and miles_attention.varlen_qk_ready():
        out = miles_attention.varlen_causal_qk(q, ks, vs, layout.cu_q, layout.cu_k, layout.max_q,
                                               layout.max_k, scale)
    else:
        out = torch.cat([miles_attention.lower_right_causal(q[a:b], ks[c:e], vs[c:e], scale)
                         for a, b, c, e in layout.segments])
    return out.reshape(t, hq * d)


def response_rows(layout: CpLayout, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in `rows` held here, their local token indices) for the micro-batch's log-prob
    rows (row positions that predict a response token)."""
    local = layout.local_of_row.index_select(0, rows)
    mine = (local >= 0).nonzero().squeeze(1)
    return mine, local.index_select(0, mine)


def gather_rows(values: torch.Tensor, mine: torch.Tensor, total: int) -> torch.Tensor:
    """This rank's values at `mine` of `total` rows -> all `total` rows on every CP rank
    (all-reduce forward, identity backward: see the module docstring)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    full = values.new_zeros((total, *values.shape[1:])).index_copy(0, mine, values)
    return reduce_from_tensor_model_parallel_region(full, group=_cp_group())
