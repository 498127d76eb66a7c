"""The buffer's slot table rows and its journal records (one per transition; see the state
table in `miles.actors.buffer`, whose `Buffer._apply` makes each of them, live and on replay).

Design decisions:
- Records are wire `Message`s, so the journal encodes them with the wire codec (arrays as raw
  frames, no pickle); their tags are their class names, unique like every message's.
- A record says what happened, not how to undo it: replaying the journal from the last snapshot
  rebuilds the state exactly, counters included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from miles.wire.messages import Group, Message

STATES = ("reserved", "generating", "retry", "queued", "out")
HOLDING = ("reserved", "generating", "retry")      # hold the admission window (rule B)


class JournalReserved(Message):
    slot: int
    version: int
    prompt_index: int = -1
    attempt: int = 0
    owner: int = -1
    request_id: str = ""
    stale_prompt: bool = False               # the prompt came from the stale-retry list
    data_state: dict[str, Any] | None = None  # the rollout's data position after this prompt
    replay: list[int] = []


class JournalRetry(Message):
    slot: int
    attempt: int


class JournalQueued(Message):
    slot: int
    group: Group


class JournalHandedBack(Message):
    slot: int
    why: str                                 # "dropped" | "filtered" | "stale"
    retry_prompt: int = -1


class JournalBatchOut(Message):
    request_id: str
    slots: list[int]
    staleness: list[int]
    version: int


class JournalBatchTrained(Message):
    request_id: str


class JournalVersion(Message):
    version: int


class JournalRollout(Message):
    owner: int
    data_state: dict[str, Any] | None = None
    replay: list[int] = []


class SlotRow(msgspec.Struct, kw_only=True):
    """One live slot of the table (`Buffer.table`); its group once it was accepted."""
    slot: int
    state: str
    prompt_index: int = -1
    attempt: int = 0
    owner: int = -1
    request_id: str = ""
    batch: str = ""
    group: Group | None = None


class JournalSnapshot(Message):
    version: int
    base_version: int | None
    next_slot: int
    handed_back: int
    back_slots: list[int]
    stale_prompts: list[int]
    slots: list[SlotRow]
    batches: dict[str, tuple[list[int], list[int], int]]
    counts: dict[str, int]
    staleness_sum: int
    staleness_max: int
    rollout_owner: int
    rollout_started: bool
    data_state: dict[str, Any]
    replay: list[int]
