"""The flight recorder: every wire message of chosen steps, headers, payloads and arrays, in a file.

    recorder = WireRecorder(run_dir / "wire" / "driver.mlw", steps={12, 13})
    runtime.recorder = recorder        # ActorRef.call records each request and its reply
    recorder.step = 12                 # the driver says which step the loop is in
    ...
    for rec in read_records(path): rec.meta.step, rec.header.kind, rec.msg

File format (`.mlw`, "Miles wire log"): a sequence of records, each one
`u32 frame count, then per frame: u32 length, bytes` (little-endian). Frame 0 is a msgpack
`RecordMeta` (time, step, direction, peer); the others are the message's own frames exactly as
the codec puts them on the wire ([header, body, *array frames]), so a record decodes with the same
`Codec.decode` a receiver uses and arrays come back bit for bit.

Design decisions:
- Recording is off the hot path unless asked for (`logging.record_wire`): one attribute check per
  call. When on, only the chosen steps are written (`logging.record_steps`; empty = every step),
  because a step's batch can be tens of MB.
- The recorder lives in the process that drives the loop: the driver sees every message that
  makes a step (the batch from the buffer, the train call on every rank and its metrics, the
  publish, the version). That is what `miles replay` needs to re-run a step offline.
- Each record is flushed whole: a run killed mid-step leaves a readable file up to the last
  complete record (a torn tail is reported by `read_records`, not raised as garbage).
- No pickle: the payloads are the codec's msgpack and raw array bytes.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import msgspec

from miles.wire.codec import Codec
from miles.wire.messages import Header, Message

_U32 = struct.Struct("<I")


class RecordMeta(msgspec.Struct, array_like=True):
    t: float            # wall-clock seconds (time.time())
    step: int           # the loop step being recorded
    direction: str      # "call" (request sent) | "reply" (answer received) | "error"
    peer: str           # the actor on the other end


@dataclass
class Record:
    meta: RecordMeta
    header: Header
    msg: Message


class WireRecorder:
    """Appends records for the steps chosen; `step` is set by the loop."""

    def __init__(self, path: str | Path, steps: set[int] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.steps = set(steps) if steps else None   # None: every step
        self.step = 0
        self.records = 0
        self._codec = Codec()
        self._file: BinaryIO | None = None

    @property
    def active(self) -> bool:
        return self.step > 0 and (self.steps is None or self.step in self.steps)

    def wants(self, step: int) -> bool:
        return step > 0 and (self.steps is None or step in self.steps)

    def record(self, direction: str, peer: str, msg: Message, id: int = 0) -> None:
        if not self.active:
            return
        kind = "reply" if direction == "reply" else "error" if direction == "error" else "call"
        frames = self._codec.encode(kind, msg, id, peer)
        meta = msgspec.msgpack.encode(RecordMeta(t=time.time(), step=self.step,
                                                 direction=direction, peer=peer))
        parts = [meta, *frames]
        out = [_U32.pack(len(parts))]
        for frame in parts:
            data = bytes(frame)
            out += [_U32.pack(len(data)), data]
        if self._file is None:
            self._file = open(self.path, "ab")
        self._file.write(b"".join(out))
        self._file.flush()
        self.records += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TornRecord(ValueError):
    """The file ends inside a record (the run was killed while writing it)."""


def read_records(path: str | Path) -> Iterator[Record]:
    """Every complete record of a `.mlw` file, in order; a torn last record raises TornRecord
    after the complete ones were yielded."""
    codec = Codec()
    meta_decoder = msgspec.msgpack.Decoder(RecordMeta)
    data = Path(path).read_bytes()
    pos, n = 0, len(data)

    def take(size: int) -> bytes:
        nonlocal pos
        if pos + size > n:
            raise TornRecord(f"{path}: the file ends inside a record at byte {pos} "
                             f"(needed {size} more bytes, {n - pos} left)")
        out = data[pos:pos + size]
        pos += size
        return out

    while pos < n:
        (count,) = _U32.unpack(take(4))
        frames = [take(_U32.unpack(take(4))[0]) for _ in range(count)]
        meta = meta_decoder.decode(frames[0])
        header, msg = codec.decode(frames[1:])
        yield Record(meta=meta, header=header, msg=msg)
