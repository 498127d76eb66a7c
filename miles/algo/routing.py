"""R3 routing data: the experts each token was routed to, from the engine's int32 to the trainer's replay.

Layout (what the FSDP replay uses, and what a Megatron replay can reuse as is)
    engine (SGLang format)  int32 [T - 1, L, k] per sample, -1 = no expert (non-MoE layer, missing)
    our wire (`Sample.routed_experts`)  uint8 [T - 1, L, k] when the model has at most 256 experts
        (255 with top-1), else uint16: `pack_routing` / `unpack_routing`. A (token, layer) row
        without routing is all sentinel (the dtype's maximum in each of its k entries).
    replay, one packed micro-batch  int64 [sum T, L, k], -1 sentinel: each sample's rows padded by
        one sentinel row to T (the last token never had a forward pass in the engine), concatenated
        in the micro-batch's sample order: exactly the packed token stream, so row t is token t of
        `input_ids[0]` (`micro_batch_indices`). A Megatron replay takes `[:, layer]` per local MoE
        layer (PP offset) and picks rows the way its tokens are picked (megatron_replay.rows_for:
        the CP rank's chunks, then the SP slice).

Design decisions:
- The dtype is chosen from the model's `num_experts` (the rollout passes the engine's model
  config) or else from the value range; uint8 quarters SGLang's int32 payload, DeepSeek-V3's 256
  experts included.
- "No routing" is a property of a whole (token, layer) row: every consumer (both replays, the
  agreement count) treats a row with any -1 as native routing. So the sentinel is a row whose k
  entries are all the dtype's maximum: a real top-k set has k distinct experts, so for k >= 2 the
  maximum id (255 in uint8) stays a real expert. Never 0: expert 0 is a real expert.
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


def routing_dtype(num_experts: int, top_k: int = 1) -> np.dtype:
    """uint8 for at most 256 experts (255 with top-1, where a lone 255 is the sentinel), else uint16."""
    if num_experts < 1 or num_experts > 65535:
        raise ValueError(f"num_experts: {num_experts} outside [1, 65535]; routing travels as uint8/uint16")
    return np.dtype(np.uint8) if num_experts <= (256 if top_k >= 2 else 255) else np.dtype(np.uint16)


def pack_routing(routed: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """Engine int32 (-1 = none) [rows, L, k] -> uint8 or uint16; a row with a -1 becomes all sentinel."""
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
    top_k = arr.shape[2]
    dtype = routing_dtype(num_experts if num_experts is not None else high + 1 if high >= 0 else 1, top_k)
    sentinel = SENTINELS[dtype]
    limit = num_experts if num_experts is not None else sentinel + (top_k >= 2)
    if high >= limit:
        raise ValueError(f"routed_experts: expert id {high} outside [0, {limit})")
    out = arr.astype(dtype)
    out[(arr < 0).any(axis=-1)] = sentinel
    return out


def unpack_routing(arr: np.ndarray) -> np.ndarray:
    """Our uint8/uint16 (or an engine's signed ints) -> int64 with -1 = no expert."""
    arr = np.asarray(arr)
    out = arr.astype(np.int64)
    if arr.dtype in SENTINELS:
        out[(arr == SENTINELS[arr.dtype]).all(axis=-1)] = -1
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


def topk_set_matches(indices: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose top-k set equals the recorded one, recorded rows), over [N, k] or [N, L, k].

    Rows with a sentinel (-1) in the recorded indices are not counted."""
    valid = (recorded >= 0).all(dim=-1)
    same = (indices.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
    return (same & valid).sum(), valid.sum()
