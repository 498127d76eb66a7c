"""R3 routing data: the experts each token was routed to, from the engine's int32 to the trainer's replay.

Layout (what the FSDP replay uses, and what a Megatron replay can reuse as is)
    engine (SGLang format)  int32 [T - 1, L, k] per sample, -1 = no expert (non-MoE layer, missing)
    our wire (`Sample.routed_experts`)  uint8 [T - 1, L, k] (sentinel 255) when the model has at
        most 255 experts, else uint16 (sentinel 65535): `pack_routing` / `unpack_routing`
    replay, one packed micro-batch  int64 [sum T, L, k], -1 sentinel: each sample's rows padded by
        one sentinel row to T (the last token never had a forward pass in the engine), concatenated
        in the micro-batch's sample order: exactly the packed token stream, so row t is token t of
        `input_ids[0]` (`micro_batch_indices`). A Megatron replay takes `[:, layer]` per local MoE
        layer (PP offset) and slices rows the way its tokens are sliced (`cp_slice` for CP).

Design decisions:
- The dtype is chosen from the value range (or the model's `num_experts` when given), so one
  model's samples always agree; uint8 quarters SGLang's int32 payload for every model we train.
- Sentinels are per dtype (the type's maximum), never 0: expert 0 is a real expert.
- Agreement is over top-k *sets* (the order of the k experts carries no meaning once weights are
  gathered per index) and only over rows the rollout recorded (sentinel rows are not routing).
- Pure numpy / torch functions with no Miles imports: the wire edge, the driver, both backends and
  the benchmark use the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SENTINELS = {np.dtype(np.uint8): 255, np.dtype(np.uint16): 65535}


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 for at most 255 experts (255 is the sentinel), uint16 for at most 65535."""
    if num_experts < 1 or num_experts > 65535:
        raise ValueError(f"num_experts: {num_experts} outside [1, 65535]; routing travels as uint8/uint16")
    return np.dtype(np.uint8) if num_experts <= 255 else np.dtype(np.uint16)


def pack_routing(routed: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """Engine int32 (-1 = none) [rows, L, k] -> uint8 (255 = none) or uint16 (65535 = none)."""
    arr = np.asarray(routed)
    if arr.ndim != 3:
        raise ValueError(f"routed_experts: expected shape (tokens - 1, layers, top_k), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected integers, got dtype {arr.dtype}")
    if arr.dtype in SENTINELS:  # already ours
        return arr
    high = int(arr.max(initial=-1))
    low = int(arr.min(initial=0))
    if low < -1:
        raise ValueError(f"routed_experts: value {low} < -1 (-1 is the only sentinel)")
    dtype = routing_dtype(num_experts if num_experts is not None else high + 1 if high >= 0 else 1)
    sentinel = SENTINELS[dtype]
    if high >= sentinel or (num_experts is not None and high >= num_experts):
        raise ValueError(f"routed_experts: expert id {high} outside [0, {num_experts or sentinel})")
    out = arr.astype(dtype)
    out[arr < 0] = sentinel
    return out


def unpack_routing(arr: np.ndarray) -> np.ndarray:
    """Our uint8/uint16 (or an engine's signed ints) -> int64 with -1 = no expert."""
    arr = np.asarray(arr)
    out = arr.astype(np.int64)
    if arr.dtype in SENTINELS:
        out[arr == SENTINELS[arr.dtype]] = -1
    elif arr.dtype.kind != "i":
        raise ValueError(f"routed_experts: dtype {arr.dtype} is not uint8/uint16 or a signed int")
    return out


def routing_problem(routed: np.ndarray | None, num_tokens: int, layers: int, top_k: int) -> str | None:
    """Why a sample's routing cannot be replayed (None when it can)."""
    if routed is None:
        return "routed_experts: missing (None)"
    want = (num_tokens - 1, layers, top_k)
    if tuple(routed.shape) != want:
        return (f"routed_experts: shape {tuple(routed.shape)}, expected (len(tokens) - 1, layers, "
                f"top_k) = {want}")
    return None


def micro_batch_indices(routed: Sequence[np.ndarray | None], lengths: Sequence[int], layers: int,
                        top_k: int) -> torch.Tensor:
    """int64 [sum(lengths), L, k] for one packed micro-batch, in the given sample order.

    Sample i's `routed[i]` covers its first lengths[i] - 1 tokens; its last token gets a sentinel
    row. A sample without routing (None) gets sentinel rows throughout."""
    out = torch.full((int(sum(lengths)), layers, top_k), -1, dtype=torch.int64)
    start = 0
    for r, n in zip(routed, lengths):
        if r is not None:
            problem = routing_problem(r, n, layers, top_k)
            if problem:
                raise ValueError(problem)
            out[start:start + n - 1] = torch.from_numpy(unpack_routing(r))
        start += n
    return out


def cp_slice(x: torch.Tensor, seq_bounds: Sequence[int], cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rows of a packed per-token tensor that context-parallel rank `cp_rank` holds.

    Load-balanced ("zigzag") slicing per sample, as megatron-core does for packed sequences: each
    sample is cut into 2 * cp_size equal chunks and rank r keeps chunks r and 2 * cp_size - 1 - r.
    Sample lengths must be multiples of 2 * cp_size (the packer pads them so). The same function
    slices tokens and routing, so a replayed index stays on its token."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: {cp_rank} outside [0, {cp_size})")
    pieces = []
    for a, b in zip(seq_bounds[:-1], seq_bounds[1:]):
        n = b - a
        if n % (2 * cp_size):
            raise ValueError(f"cp_slice: sample [{a}, {b}) of length {n} is not a multiple of "
                             f"2 * cp_size = {2 * cp_size}")
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(x[a + chunk * c:a + (chunk + 1) * c])
    return torch.cat(pieces) if pieces else x[:0]


def topk_set_matches(indices: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose top-k set equals the recorded one, recorded rows), over [N, k] or [N, L, k].

    Rows with a sentinel (-1) in the recorded indices are not counted."""
    valid = (recorded >= 0).all(dim=-1)
    same = (indices.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
    return (same & valid).sum(), valid.sum()
