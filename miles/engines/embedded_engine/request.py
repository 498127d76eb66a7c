"""`Request`: one generation request as the scheduler holds it: what was asked, its progress
(tokens, log-probs, weight-version spans) and its place in the KV pool (row, slots, prefix)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from miles.engines.embedded_engine.protocol import SamplingParams


@dataclass(eq=False)  # identity: `running.remove(req)` must not compare every field of every request
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # user stops + EOS unless ignore_eos
    stop_strs: tuple[str, ...] = ()
    # progress
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    spans: list[list] = field(default_factory=list)  # [version, start, end]
    routed: np.ndarray | None = None                  # [prompt+max_new, layers, top_k]
    finish: dict | None = None
    matched_stop_str: str | None = None
    num_retractions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    # placement
    row: int = 0
    slots: list[np.ndarray] = field(default_factory=list)
    prefix: object = None   # the prefix cache node this request locked (None: no hit)
    prefix_len: int = 0     # leading slots owned by the prefix cache
    kv_epoch: int = -1      # the prefix cache's epoch when this request's KV was computed
    admitted: bool = False  # counted in the hit-rate totals
    # timing / notification
    created_s: float = field(default_factory=time.time)
    finished_s: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def all_tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish is not None
