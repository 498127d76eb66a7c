"""The disk-delta format: what changed since the previous version, compressed and checksummed.

    <disk_dir>/delta-v000005/manifest.json      DeltaManifest (JSON), written last
    <disk_dir>/delta-v000005/data-00000.bin     compressed chunks, one file per bucket

Design decisions:
- A tensor's delta is the XOR of its raw bytes with the previous version's bytes (in the dtype
  the engine holds): an unchanged element is all zero bits, and a bf16 element moved by one step
  of lr 1e-6 usually differs only in its low mantissa bits, so the XOR is mostly zeros and
  compresses to a few percent. A tensor with no previous version is stored raw ("raw" kind).
- Each tensor is cut into chunks of `chunk_bytes`, compressed independently (in parallel, with
  bounded memory, and a corrupt chunk cannot derail the next); an all-zero chunk is stored as
  length 0 and costs nothing to write or read. Every chunk of a bucket, and every tensor's
  checksum, is its own job on the pool, so a bucket of many small tensors uses every thread too.
- A raw entry's chunks are stored as they are (`stored`), never compressed: zlib level 1 shrinks
  bf16 weights by only ~20% at ~50 MB/s per thread, so a 7B first publish (15 GB) would spend
  minutes compressing what the disk writes in seconds. An XOR chunk that does not shrink is
  stored too.
- Every entry carries the sha256 of the NEW tensor, and of the base it applies to, so the engine
  can tell "the delta is corrupted" (new sha256 mismatch, undecodable chunk, file too short) from
  "my weights are not this delta's base" (base sha256 mismatch) before it changes anything.
- Decompression never trusts a length it reads: it stops at the declared raw length + 1 byte, so
  a hostile or damaged chunk cannot blow up memory.
- The codec is named in the manifest (zlib and lzma from the stdlib; zstd when the `zstandard`
  package is installed).
"""

from __future__ import annotations

import hashlib
import lzma
import os
import zlib
from concurrent.futures import Executor
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

FORMAT = "miles-delta/1"
MANIFEST = "manifest.json"


class Chunk(msgspec.Struct, array_like=True):
    offset: int        # in the entry's data file
    length: int        # compressed bytes; 0 = an all-zero chunk (nothing stored)
    raw_length: int    # bytes after decompression
    stored: bool = False  # the bytes as they are (raw entries; XOR chunks that did not shrink)


class DeltaEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    kind: Literal["xor", "raw"]
    file: str
    chunks: list[Chunk]
    sha256: str                      # of the new tensor's raw bytes
    base_sha256: str | None = None   # of the bytes the XOR applies to ("xor" only)
    changed: int | None = None       # elements that differ from the base ("xor"; the engine sizes
                                     # a sparse staging by it)


class DeltaManifest(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    base_version: int | None         # None: every entry is raw, applies to any weights
    codec: str
    full_bytes: int                  # the new tensors' size
    payload_bytes: int               # compressed bytes in the data files
    entries: list[DeltaEntry]


class DeltaError(ValueError):
    """A delta cannot be applied; the message names the delta, the tensor and why."""


# ---- codecs ---------------------------------------------------------------------------------

def compress(data: bytes | memoryview, codec: str, level: int) -> bytes:
    if codec == "zlib":
        return zlib.compress(data, level)
    if codec == "lzma":
        return lzma.compress(data, preset=level)
    if codec == "zstd":
        return _zstd().ZstdCompressor(level=level).compress(data)
    raise DeltaError(f"codec: {codec!r} is not one of zlib, lzma, zstd")


def decompress(data: bytes, codec: str, raw_length: int) -> bytes:
    """Exactly `raw_length` bytes or DeltaError (never more than raw_length + 1 in memory)."""
    try:
        if codec == "zlib":
            d = zlib.decompressobj()
            out = d.decompress(data, raw_length + 1)
            complete = d.eof
        elif codec == "lzma":
            d = lzma.LZMADecompressor()
            out = d.decompress(data, max_length=raw_length + 1)
            complete = d.eof
        elif codec == "zstd":
            out = _zstd().ZstdDecompressor().decompress(data, max_output_size=raw_length + 1)
            complete = True
        else:
            raise DeltaError(f"codec: {codec!r} is not one of zlib, lzma, zstd")
    except (zlib.error, lzma.LZMAError) as e:
        raise DeltaError(f"undecodable {codec} data ({e})") from None
    except Exception as e:  # noqa: BLE001 - zstandard's own error type
        if isinstance(e, DeltaError):
            raise
        raise DeltaError(f"undecodable {codec} data ({type(e).__name__}: {e})") from None
    if len(out) != raw_length or not complete:
        raise DeltaError(f"{codec} data decodes to {len(out)}{'+' if len(out) > raw_length else ''} "
                         f"bytes, expected {raw_length}")
    return out


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise DeltaError("codec 'zstd' needs the `zstandard` package; use 'zlib' or 'lzma'") from None
    return zstandard


def sha256(data: np.ndarray | bytes) -> str:
    return hashlib.sha256(memoryview(data).cast("B") if isinstance(data, np.ndarray) else data).hexdigest()


# ---- writing (trainer) ----------------------------------------------------------------------

# (data, raw length, stored): data is b"" for an all-zero chunk
Encoded = tuple[bytes | memoryview, int, bool]


def _spans(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk_bytes, nbytes)) for i in range(0, max(nbytes, 1), chunk_bytes)]


def _encode_span(new: np.ndarray, base: np.ndarray | None, lo: int, hi: int, codec: str,
                 level: int) -> Encoded:
    piece = new[lo:hi] if base is None else np.bitwise_xor(new[lo:hi], base[lo:hi])
    if not piece.any():
        return b"", piece.nbytes, False
    if base is None:  # raw: see the module docstring
        return memoryview(piece), piece.nbytes, True
    data = compress(memoryview(piece), codec, level)
    if len(data) >= piece.nbytes:
        return memoryview(piece), piece.nbytes, True
    return data, piece.nbytes, False


def _kind(new: np.ndarray, base: np.ndarray | None) -> str:
    return "xor" if base is not None and base.nbytes == new.nbytes else "raw"


def encode_chunks(new: np.ndarray, base: np.ndarray | None, *, codec: str, level: int,
                  chunk_bytes: int, pool: Executor | None) -> tuple[str, list[Encoded]]:
    """(kind, chunks) for one tensor's bytes: "xor" against `base` when it has the same size."""
    kind = _kind(new, base)
    ref = base if kind == "xor" else None
    args = [(new, ref, lo, hi, codec, level) for lo, hi in _spans(new.nbytes, chunk_bytes)]
    if pool is None or len(args) == 1:
        return kind, [_encode_span(*a) for a in args]
    return kind, list(pool.map(lambda a: _encode_span(*a), args))


def encode_tensors(tensors: list[tuple[np.ndarray, np.ndarray | None]], *, codec: str, level: int,
                   chunk_bytes: int, pool: Executor) -> list[tuple[str, list[Encoded], str]]:
    """(kind, chunks, sha256 of the new bytes) per (new, base) pair; every chunk and every checksum
    is its own job on `pool` (a bucket of small tensors keeps every thread busy)."""
    jobs = []
    for new, base in tensors:
        kind = _kind(new, base)
        ref = base if kind == "xor" else None
        chunks = [pool.submit(_encode_span, new, ref, lo, hi, codec, level)
                  for lo, hi in _spans(new.nbytes, chunk_bytes)]
        jobs.append((kind, chunks, pool.submit(sha256, new)))
    return [(kind, [f.result() for f in chunks], digest.result()) for kind, chunks, digest in jobs]


class DeltaWriter:
    """Appends entries to data files and writes the manifest (atomically, by rename)."""

    def __init__(self, out_dir: Path, *, version: int, base_version: int | None, codec: str):
        self.final = out_dir
        self.tmp = out_dir.with_name(out_dir.name + ".tmp")
        if self.tmp.exists():
            _rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.version, self.base_version, self.codec = version, base_version, codec
        self.entries: list[DeltaEntry] = []
        self.full_bytes = self.payload_bytes = 0
        self.files = 0

    def write_bucket(self, items: list[tuple]) -> None:
        """items: (name, dtype, shape, kind, chunks, sha256, base_sha256[, changed elements]),
        written to one file."""
        fname = f"data-{self.files:05d}.bin"
        self.files += 1
        offset = 0
        with open(self.tmp / fname, "wb") as f:
            for name, dtype, shape, kind, chunks, digest, base_digest, *changed in items:
                out = []
                for data, raw, stored in chunks:
                    f.write(data)
                    n = memoryview(data).nbytes
                    out.append(Chunk(offset, n, raw, stored))
                    offset += n
                    self.full_bytes += raw
                self.entries.append(DeltaEntry(name, dtype, list(shape), kind, fname, out, digest,
                                               base_digest, changed[0] if changed and kind == "xor" else None))
        self.payload_bytes += offset

    def close(self) -> DeltaManifest:
        manifest = DeltaManifest(FORMAT, self.version, self.base_version, self.codec,
                                 self.full_bytes, self.payload_bytes, self.entries)
        path = self.tmp / MANIFEST
        path.write_bytes(msgspec.json.encode(manifest))
        for p in self.tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if self.final.exists():
            _rmtree(self.final)
        self.tmp.rename(self.final)
        return manifest

    def abort(self) -> None:
        _rmtree(self.tmp)


def _rmtree(path: Path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


# ---- reading (engine) -----------------------------------------------------------------------

def read_manifest(delta_dir: str | Path) -> DeltaManifest:
    path = Path(delta_dir) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DeltaError(f"delta {str(delta_dir)!r}: no {MANIFEST} (not a delta directory, or not "
                         "finished writing)") from None
    try:
        manifest = msgspec.json.decode(raw, type=DeltaManifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise DeltaError(f"delta {str(delta_dir)!r}: {MANIFEST} is damaged: {e}") from None
    if manifest.format != FORMAT:
        raise DeltaError(f"delta {str(delta_dir)!r}: format {manifest.format!r}, expected {FORMAT!r}")
    for e in manifest.entries:
        if "/" in e.file or e.file.startswith("."):
            raise DeltaError(f"delta {str(delta_dir)!r}: entry {e.name!r} names file {e.file!r} "
                             "outside the delta directory")
    return manifest


def decode_entry(delta_dir: str | Path, manifest: DeltaManifest, entry: DeltaEntry,
                 current: np.ndarray | None) -> np.ndarray:
    """The new bytes of `entry` (uint8), verified; `current` = this process's bytes of the tensor."""
    where = f"delta v{manifest.version} ({str(delta_dir)!r}) tensor {entry.name!r}"
    total = sum(c.raw_length for c in entry.chunks)
    if entry.kind == "xor":
        if current is None or current.nbytes != total:
            raise DeltaError(f"{where}: the XOR needs the current {total} bytes, have "
                             f"{None if current is None else current.nbytes}")
        if entry.base_sha256 is not None and sha256(current) != entry.base_sha256:
            raise DeltaError(f"{where}: this engine's weights are not the delta's base (version "
                             f"{manifest.base_version}): base sha256 differs")
    path = Path(delta_dir) / entry.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DeltaError(f"{where}: data file {entry.file!r} is missing") from None
    out = np.empty(total, dtype=np.uint8)
    pos = 0
    with open(path, "rb") as f:
        for k, c in enumerate(entry.chunks):
            if c.offset + c.length > size:
                raise DeltaError(f"{where}: data file {entry.file!r} is truncated (chunk {k} needs bytes "
                                 f"[{c.offset}, {c.offset + c.length}), the file has {size})")
            if c.length == 0:
                out[pos:pos + c.raw_length] = 0
            elif c.stored:
                if c.length != c.raw_length:
                    raise DeltaError(f"{where}: chunk {k} is corrupted: stored with {c.length} bytes "
                                     f"for {c.raw_length}")
                f.seek(c.offset)
                f.readinto(memoryview(out)[pos:pos + c.raw_length])
            else:
                f.seek(c.offset)
                try:
                    raw = decompress(f.read(c.length), manifest.codec, c.raw_length)
                except DeltaError as e:
                    raise DeltaError(f"{where}: chunk {k} is corrupted: {e}") from None
                out[pos:pos + c.raw_length] = np.frombuffer(raw, dtype=np.uint8)
            pos += c.raw_length
    if entry.kind == "xor":
        np.bitwise_xor(out, current, out=out)
    if sha256(out) != entry.sha256:
        raise DeltaError(f"{where}: checksum mismatch after applying the delta (sha256 "
                         f"{sha256(out)[:16]}..., expected {entry.sha256[:16]}...): the delta is "
                         "corrupted")
    return out
