"""The in-memory trainer snapshot file: double-buffered, a sequence number per slot, in the node
daemon's /dev/shm directory (`MILES_SNAPSHOT_DIR`), so it outlives the trainer process that
writes it and a restarted rank heals from it (`loop.snapshot`; what goes in it:
miles/backends/snapshot.py; the heal: miles/rl/heal.py).

Layout of one rank's file (`trainer-<rank>.snap`):
    header (4 KiB): MAGIC, FORMAT, slot_bytes
    slot 0, slot 1 (slot_bytes each): begin seq, end seq, meta bytes, data bytes, meta crc32,
        then the msgpack meta, then every tensor's raw bytes (64-byte aligned)

Design decisions:
- Double buffering with a sequence number (a seqlock): write k goes to slot k % 2, opened by
  writing `begin = k` and closed by writing `end = k` after the last byte. A writer killed
  mid-copy leaves begin != end: that slot is torn and the other one, one step older, is whole.
  So a rank always holds its newest complete step or the one before, and the driver picks the
  newest step every rank holds (`common_step`).
- No checksum of the tensor bytes: a torn copy is what a kill leaves, and the seqlock finds it;
  a crc32 of a 7B model's 84 GB of fp32 parameters and moments would cost more than the copy.
  The meta (names, shapes, offsets) is checked by a crc32, since a bad offset would restore
  garbage silently.
- Raw bytes and a msgpack table, no pickle: the same rule as the wire.
- Growth (the warm start's optimizer gone, RL's built) rewrites the file under a new name and
  renames it over the old one, so a reader sees the old file or the new whole one.
- A /dev/shm without room for two slots is one clear line (`SnapshotTooBig`), and the job keeps
  its disk checkpoints: the driver falls back to them when a rank dies.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

MAGIC = b"MILESNAP"
FORMAT = 1
HEADER_BYTES = 4096
SLOT_HEADER = struct.Struct("<QQQQI")  # begin seq, end seq, meta bytes, data bytes, meta crc32
SLOT_HEADER_BYTES = 64
ALIGN = 64
ENV_DIR = "MILES_SNAPSHOT_DIR"


class SnapshotTooBig(RuntimeError):
    """Two slots of this snapshot do not fit in the snapshot directory's free memory."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Image:
    """One complete snapshot read back: its sequence number, meta table and a view of its bytes."""
    seq: int
    meta: dict
    data: memoryview


class SnapshotFile:
    """One rank's double-buffered snapshot file (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.seq = max((i.seq for i in self.images()), default=0)

    # ----- writing -----------------------------------------------------------------------------
    def write(self, meta: dict, arrays: list[np.ndarray]) -> int:
        """Write one snapshot (`arrays` in `meta["tensors"]` order); returns its sequence number."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total = _aligned(total + a.nbytes)
        meta = {**meta, "offsets": offsets}
        body = msgspec.msgpack.encode(meta)
        need = SLOT_HEADER_BYTES + _aligned(len(body)) + total
        seq = self.seq + 1
        if not self.path.exists() or self._slot_bytes() < need:
            self._create(need + need // 8)  # room to grow a little without rewriting
        with open(self.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            base = HEADER_BYTES + (seq % 2) * self._slot_bytes(mm)
            mm[base:base + SLOT_HEADER_BYTES] = SLOT_HEADER.pack(seq, 0, 0, 0, 0).ljust(SLOT_HEADER_BYTES, b"\0")
            at = base + SLOT_HEADER_BYTES
            mm[at:at + len(body)] = body
            at += _aligned(len(body))
            for a, off in zip(arrays, offsets):
                flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                mm[at + off:at + off + flat.nbytes] = memoryview(flat)
            mm[base:base + SLOT_HEADER.size] = SLOT_HEADER.pack(seq, seq, len(body), total,
                                                                zlib.crc32(body))
        self.seq = seq
        return seq

    def _slot_bytes(self, mm=None) -> int:
        if mm is None:
            try:
                with open(self.path, "rb") as f:
                    head = f.read(24)
            except FileNotFoundError:
                return 0
        else:
            head = bytes(mm[:24])
        if len(head) < 24 or head[:8] != MAGIC:
            return 0
        return struct.unpack("<IQ", head[8:20].ljust(12, b"\0"))[1]

    def _create(self, slot_bytes: int) -> None:
        size = HEADER_BYTES + 2 * slot_bytes
        free = os.statvfs(self.path.parent)
        have = free.f_bavail * free.f_frsize + (self.path.stat().st_size if self.path.exists() else 0)
        if size > have:
            raise SnapshotTooBig(f"a trainer snapshot needs {size / 2**20:.1f} MiB (two slots of "
                                 f"{slot_bytes / 2**20:.1f} MiB) in {self.path.parent}, which has "
                                 f"{have / 2**20:.1f} MiB free; loop.snapshot = false turns "
                                 "them off (a dead rank then restarts the job from disk)")
        tmp = self.path.with_suffix(".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, MAGIC + struct.pack("<IQ", FORMAT, slot_bytes), 0)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    # ----- reading -----------------------------------------------------------------------------
    def images(self) -> list[Image]:
        """The complete snapshots in the file, newest first (at most two)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            try:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable views: no torch warning
            except ValueError:  # an empty file
                return []
        slot_bytes = self._slot_bytes(mm)
        out = []
        for slot in range(2 if slot_bytes else 0):
            base = HEADER_BYTES + slot * slot_bytes
            begin, end, meta_len, data_len, crc = SLOT_HEADER.unpack(mm[base:base + SLOT_HEADER.size])
            if begin == 0 or begin != end:
                continue  # never written, or torn (its writer died mid-copy)
            at = base + SLOT_HEADER_BYTES
            body = mm[at:at + meta_len]
            if zlib.crc32(body) != crc:
                continue
            data_at = at + _aligned(meta_len)
            out.append(Image(seq=begin, meta=msgspec.msgpack.decode(body),
                             data=memoryview(mm)[data_at:data_at + data_len]))
        return sorted(out, key=lambda i: -i.seq)

    def newest(self) -> Image | None:
        images = self.images()
        return images[0] if images else None


def common_step(per_rank: list[list[int]]) -> int | None:
    """The newest train call every rank holds a snapshot of (None: there is none)."""
    common = set(per_rank[0]) if per_rank else set()
    for steps in per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None


def snapshot_bytes(arrays: list[np.ndarray]) -> int:
    """What `arrays` take in one slot (each 64-byte aligned)."""
    return sum(_aligned(a.nbytes) for a in arrays)
