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
- The format carries a number: the first record of a file is a `JournalFormat` (what the file
  is, its format version). A file without one is format 1 (written before the header existed) and
  is read as such; a file of a newer format than the reader knows is refused with one line naming
  the file and both numbers. The owner says which format it writes (`Journal(path, kind, format)`)
  and reads `journal.format` after `read()` to upgrade old records if it must.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Iterable

from miles.wire.codec import Codec
from miles.wire.messages import Message

class JournalFormat(Message):
    """The first record of a journal file: what it is and its format version."""
    kind: str
    format: int


class JournalFormatError(ValueError):
    pass


_HEAD = struct.Struct("<II")
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")


class Journal:
    def __init__(self, path: str | Path, kind: str = "", format: int = 0):
        # kind "" / format 0: a plain reader (any journal, any format) that writes no header
        self.kind, self.writes_format = kind, format
        self.format = format        # of the file, as read (1: no header, an old file)
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
        self.format = 1
        if not self.path.exists():
            self.format = self.writes_format or 1
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
            rec = self.codec.decode(frames)[1]
            pos += _HEAD.size + n
            if isinstance(rec, JournalFormat):
                self._check_format(rec)
                continue
            out.append(rec)
        if pos < len(data):
            self.torn_at = pos
            if cut_torn_tail:
                with open(self.path, "r+b") as f:
                    f.truncate(pos)
        return out

    def _check_format(self, rec: JournalFormat) -> None:
        if self.kind and (rec.format > self.writes_format or rec.kind != self.kind):
            raise JournalFormatError(
                f"{self.path}: a {rec.kind!r} journal of format {rec.format}; this Miles reads "
                f"{self.kind!r} journals of format <= {self.writes_format} (a newer Miles wrote it)")
        self.format = rec.format

    def _header(self) -> bytes:
        return self._encode(JournalFormat(kind=self.kind, format=self.writes_format))

    def append(self, msg: Message) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if self.writes_format and os.fstat(self._fd).st_size == 0:
                os.write(self._fd, self._header())
        record = memoryview(self._encode(msg))
        while record:
            record = record[os.write(self._fd, record):]
        self.records += 1

    def rewrite(self, records: Iterable[Message]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            if self.writes_format:
                f.write(self._header())
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
