"""An append-only file of wire messages: the buffer's journal (what a restarted buffer needs to
come back) and the flight recorder's `.mlw` files (`miles/wire/recorder.py`) both use it.

Design decisions:
- A record is one `Message` encoded by the wire codec (`miles.wire.codec.Codec`: msgpack body,
  numpy arrays as raw frames), never pickle. On disk: `<u32 length><u32 crc32><blob>`, where the
  blob is `<u32 frame count>` then `<u64 length><bytes>` per frame.
- Each record goes to the file in one `write` on an `O_APPEND` descriptor before the actor
  replies, so a SIGKILL at any point leaves whole records plus at most one torn tail; reading
  stops at the first record whose length or checksum does not match and cuts the file there.
  There is no fsync: the journal is for a killed process, not a lost machine.
- `rewrite(records)` replaces the file atomically (write a sibling, `os.replace`): compaction.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Iterable

from miles.wire.codec import Codec
from miles.wire.messages import Message

_HEAD = struct.Struct("<II")
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")


class Journal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.codec = Codec()
        self.records = 0            # appended since the last rewrite
        self.torn_at: int | None = None
        self._fd: int | None = None

    def _encode(self, msg: Message) -> bytes:
        frames = self.codec.encode("tell", msg)
        parts = [_COUNT.pack(len(frames))]
        for f in frames:
            parts += [_LEN.pack(len(f) if isinstance(f, bytes) else f.nbytes), f]
        blob = b"".join(parts)
        return _HEAD.pack(len(blob), zlib.crc32(blob)) + blob

    def read(self, cut_torn_tail: bool = True) -> list[Message]:
        """Every whole record, oldest first. A torn tail (killed mid-write) is cut off the file,
        or with `cut_torn_tail=False` left there (a reader of a recording changes nothing);
        `torn_at` is the byte offset where it starts, None when there is none."""
        self.torn_at = None
        if not self.path.exists():
            return []
        data = memoryview(self.path.read_bytes())
        out, pos = [], 0
        while pos + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, pos)
            blob = data[pos + _HEAD.size: pos + _HEAD.size + n]
            if len(blob) < n or zlib.crc32(blob) != crc:
                break
            (count,), at, frames = _COUNT.unpack_from(blob, 0), _COUNT.size, []
            for _ in range(count):
                (size,) = _LEN.unpack_from(blob, at)
                at += _LEN.size
                frames.append(bytes(blob[at: at + size]))
                at += size
            out.append(self.codec.decode(frames)[1])
            pos += _HEAD.size + n
        if pos < len(data):
            self.torn_at = pos
            if cut_torn_tail:
                with open(self.path, "r+b") as f:
                    f.truncate(pos)
        return out

    def append(self, msg: Message) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        record = memoryview(self._encode(msg))
        while record:
            record = record[os.write(self._fd, record):]
        self.records += 1

    def rewrite(self, records: Iterable[Message]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for msg in records:
                f.write(self._encode(msg))
        self.close()
        os.replace(tmp, self.path)
        self.records = 0

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
