"""The flight recorder: every wire message of chosen steps, headers, payloads and arrays, in a file.

    recorder = WireRecorder(run_dir / "wire" / "driver.mlw", steps={12, 13})
    runtime.recorder = recorder        # ActorRef.call records each request and its reply
    recorder.step = 12                 # the driver says which step the loop is in
    ...
    for rec in read_records(path): rec.meta.step, rec.header.kind, rec.msg

File format (`.mlw`, "Miles wire log"): a `miles.wire.journal.Journal` (the buffer's journal
format: length- and CRC-framed records of codec-encoded messages, arrays as raw frames), where
each recorded message is preceded by its `RecordMeta` (time, step, direction, peer). It decodes
with the same codec a receiver uses, so arrays come back bit for bit.

Design decisions:
- Recording is off the hot path unless asked for (`logging.record_wire`): one attribute check per
  call. When on, only the chosen steps are written (`logging.record_steps`; empty = every step),
  because a step's batch can be tens of MB.
- The recorder lives in the process that drives the loop: the driver sees every message that
  makes a step (the batch from the buffer, the train call on every rank and its metrics, the
  publish, the version). That is what `miles replay` needs to re-run a step offline.
- Each record is one write: a run killed mid-step leaves a readable file up to the last complete
  record (a torn tail is reported by `read_records`, and left in the file).
- No pickle: the payloads are the codec's msgpack and raw array bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from miles.wire.journal import Journal
from miles.wire.messages import Message


class RecordMeta(Message):
    t: float            # wall-clock seconds (time.time())
    step: int           # the loop step being recorded
    direction: str      # "call" (request sent) | "reply" (answer received) | "error"
    peer: str           # the actor on the other end


@dataclass
class Record:
    meta: RecordMeta
    msg: Message


class WireRecorder:
    """Appends records for the steps chosen; `step` is set by the loop."""

    def __init__(self, path: str | Path, steps: set[int] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.steps = set(steps) if steps else None   # None: every step
        self.step = 0
        self.records = 0
        self._journal = Journal(self.path)

    @property
    def active(self) -> bool:
        return self.step > 0 and (self.steps is None or self.step in self.steps)

    def wants(self, step: int) -> bool:
        return step > 0 and (self.steps is None or step in self.steps)

    def record(self, direction: str, peer: str, msg: Message) -> None:
        if not self.active:
            return
        self._journal.append(RecordMeta(t=time.time(), step=self.step, direction=direction,
                                        peer=peer))
        self._journal.append(msg)
        self.records += 1

    def close(self) -> None:
        self._journal.close()


class TornRecord(ValueError):
    """The file ends inside a record (the run was killed while writing it)."""


def read_records(path: str | Path) -> Iterator[Record]:
    """Every complete record of a `.mlw` file, in order; a torn last record raises TornRecord
    after the complete ones were yielded (the file is left as it is)."""
    journal = Journal(path)
    messages = journal.read(cut_torn_tail=False)
    for meta, msg in zip(messages[::2], messages[1::2]):
        if not isinstance(meta, RecordMeta):
            raise ValueError(f"{path}: not a flight recording (found {type(meta).__name__} "
                             f"where a RecordMeta belongs)")
        yield Record(meta=meta, msg=msg)
    if journal.torn_at is not None or len(messages) % 2:
        where = journal.torn_at if journal.torn_at is not None else "its last message"
        raise TornRecord(f"{path}: the file ends inside a record (at byte {where}): the run was "
                         f"killed while writing it")
