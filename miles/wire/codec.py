"""Encode and decode messages as ZeroMQ multipart frames: [header, body, *array frames].

Design decisions:
- The header is a tiny msgpack array (`Header`) decoded first: a peer speaking another protocol
  version is refused before its body is looked at, with a message naming both versions.
- The body is msgpack of one `Message` (a tagged union of every registered class). Each numpy
  array in it is replaced by a msgpack ext (code 1) holding (frame index, dtype, shape); the array's
  bytes travel as their own frame. Encoding hands ZeroMQ the array's memory (no copy); decoding
  wraps the received frame with `np.frombuffer` (no copy; the array is read-only).
- Decoding is strict (unknown fields, wrong types, bad dtypes, frame count or size mismatches,
  unknown kinds are all errors) and every error is a `WireError` naming the message type and the
  field path, so a receiver can count it, drop the frame and keep serving. Whatever of the peer's
  input an error echoes (a tag, a sender, msgspec's quoted value) is clipped to `ECHO_CHARS`, so
  junk cannot make the reply or the log as large as itself.
- `peek_header` reads a header leniently (any protocol version, any frame count): a receiver that
  refuses a frame still learns the call id and kind, and can answer with an error instead of
  leaving the caller to wait for its timeout.
- `encode_call(..., shm_min_bytes)` sends a same-host call's arrays through one shared-memory
  segment instead (`miles.wire.shm`): the body is encoded a second time with each array as ext
  code 2, (reference frame index, offset, dtype, shape), and one reference frame, msgpack
  (segment name, size), replaces the array frames. Encoding twice costs a few microseconds per
  array; deciding first would need a walk of the message that msgspec already does. A reference
  that does not resolve is reported where msgspec's own errors are, at the field's path: the ext
  hook only notes the failure, and the type hook (which msgspec calls with the path) raises it.
  A segment that is not visible here at all is `ShmUnavailable`, so the sender can re-send as
  frames. A pooled segment's reference carries a third element, its use number: its arrays are
  views of one base ndarray per call, and `decode(frames, on_release)` arranges for
  `on_release(name, use)` to be called once every array of that call is gone (`shm.Pool`).
- No pickle anywhere; the dtype whitelist keeps object arrays out.
"""

from __future__ import annotations

import logging
import threading
import re
import typing
import weakref
from typing import Any, Sequence

import msgspec
import numpy as np

from miles.wire import shm
from miles.wire.messages import PROTOCOL_VERSION, Header, Kind, Message, registered_messages

log = logging.getLogger(__name__)

ARRAY_EXT = 1
SHM_EXT = 2
ECHO_CHARS = 100
KINDS = frozenset(typing.get_args(Kind))
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64")}
# bfloat16 has no numpy dtype; tensors of it travel as uint16 views with the logical dtype in metadata.


class WireError(ValueError):
    """A frame that cannot be decoded. `msg_type` and `field` say where."""

    def __init__(self, message: str, msg_type: str = "?", field: str = ""):
        self.msg_type, self.field = clip(msg_type), field
        where = self.msg_type if self.msg_type.startswith(("Header", "body")) else (
            f"type {self.msg_type!r}" if not self.msg_type.isidentifier() else self.msg_type)
        where += f", {field}" if field.startswith("a key") else f", field {field}" if field else ""
        super().__init__(f"bad frame ({where}): {clip(message, 2 * ECHO_CHARS)}")


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """Echoed peer input, at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


class VersionMismatch(WireError):
    pass


class ShmUnavailable(WireError):
    """A shared-memory reference whose segment this process cannot see (another host)."""


_state = threading.local()
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_any_decoder = msgspec.msgpack.Decoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[int]])
_shm_meta_decoder = msgspec.msgpack.Decoder(tuple[int, int, str, list[int]])


class _ShmRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    size: int
    use: int = 0  # > 0: a pooled segment (shm.Pool), released by the receiver after this call


_shm_ref_decoder = msgspec.msgpack.Decoder(_ShmRef)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.str not in _DTYPES:
            raise TypeError(f"array dtype {obj.dtype} cannot travel on the wire")
        arr = np.ascontiguousarray(obj)
        writer = getattr(_state, "writer", None)
        if writer is not None:
            offset = writer.put(memoryview(arr).cast("B") if arr.size else b"")
            meta = msgspec.msgpack.encode((0, offset, arr.dtype.str, list(arr.shape)))
            return msgspec.msgpack.Ext(SHM_EXT, meta)
        frames: list = _state.frames
        frames.append(memoryview(arr).cast("B") if arr.size else b"")
        meta = msgspec.msgpack.encode((len(frames) - 1, arr.dtype.str, list(arr.shape)))
        return msgspec.msgpack.Ext(ARRAY_EXT, meta)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _checked(dtype_str: str, shape: list[int]) -> tuple[np.dtype, int]:
    dtype = _DTYPES.get(dtype_str)
    if dtype is None:
        raise ValueError(f"array dtype {dtype_str!r} is not allowed")
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"array shape {shape!r} has a negative dimension")
        count *= d
    return dtype, count


class _BadRef:
    """A shared-memory array that did not resolve; `_dec_hook` raises it at its field."""

    def __init__(self, error: ValueError):
        self.error = error


def _shm_array(data: memoryview) -> Any:
    try:
        index, offset, dtype_str, shape = _shm_meta_decoder.decode(data)
        dtype, count = _checked(dtype_str, shape)
        segments: dict = _state.segments
        seg = segments.get(index)
        if seg is None:
            seg = segments[index] = _segment(index)
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > len(seg):
            raise ValueError(f"shared-memory array {dtype_str}{tuple(shape)} at offset {offset} "
                             f"({nbytes} bytes) lies outside its {len(seg)}-byte segment")
    except (ValueError, msgspec.DecodeError) as e:
        _state.missing = _state.missing or isinstance(e, shm.ShmMissing)
        bad = _BadRef(e if isinstance(e, ValueError) else ValueError(str(e)))
        _state.bad.append(bad)
        return bad
    if isinstance(seg, np.ndarray):  # a pooled segment's base array for this call
        arr = seg[offset:offset + nbytes].view(dtype)
    else:
        arr = np.frombuffer(seg, dtype=dtype, count=count, offset=offset)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _segment(index: int) -> Any:
    """Reference frame `index` resolved: a one-call segment's mapping, or for a pooled one a
    uint8 base array over the call's bytes, whose end releases the slot (`on_release`)."""
    buffers: list = _state.frames
    if not 0 <= index < len(buffers):
        raise ValueError(f"shared-memory array refers to frame {index} but "
                         f"{len(buffers)} array frames came")
    try:
        ref = _shm_ref_decoder.decode(buffers[index])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"frame {index} is not a shared-memory reference "
                         f"(name, size[, use]): {e}") from None
    if ref.use <= 0:
        return shm.open_readonly(ref.name, ref.size)
    base = np.frombuffer(shm.map_pooled(ref.name, ref.size), dtype=np.uint8, count=ref.size)
    on_release = getattr(_state, "on_release", None)
    if on_release is not None:
        weakref.finalize(base, on_release, ref.name, ref.use).atexit = False  # nobody to tell then
    return base


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == SHM_EXT:
        return _shm_array(data)
    if code != ARRAY_EXT:
        raise ValueError(f"unknown msgpack ext code {code}")
    index, dtype_str, shape = _meta_decoder.decode(data)
    buffers: list = _state.frames
    if not 0 <= index < len(buffers):
        raise ValueError(f"array refers to frame {index} but {len(buffers)} array frames came")
    dtype, count = _checked(dtype_str, shape)
    buf = buffers[index]
    if len(buf) != count * dtype.itemsize:
        raise ValueError(f"array frame {index} has {len(buf)} bytes, expected "
                         f"{count * dtype.itemsize} for {dtype_str}{tuple(shape)}")
    arr = np.frombuffer(buf, dtype=dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if isinstance(obj, _BadRef):
            _state.bad.remove(obj)
            raise obj.error
        raise ValueError(f"expected an array frame, got {type(obj).__name__}")
    raise NotImplementedError(f"cannot decode type {typ}")


class Codec:
    """Encoder/decoder for the current set of registered messages.

    The union is rebuilt lazily when a new Message subclass has been registered since.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._known: int = -1
        self._decoder: msgspec.msgpack.Decoder | None = None

    def _body_decoder(self) -> msgspec.msgpack.Decoder:
        registry = registered_messages()
        if self._decoder is None or len(registry) != self._known:
            union = tuple(registry.values())
            self._decoder = msgspec.msgpack.Decoder(
                union[0] if len(union) == 1 else typing.Union[union],
                dec_hook=_dec_hook, ext_hook=_ext_hook)
            self._known = len(registry)
        return self._decoder

    def encode(self, kind: str, msg: Message, id: int = 0, sender: str = "") -> list:
        """Frames for one message: header, body, then one frame per array (zero copy)."""
        _state.frames = frames = []
        try:
            body = self._encoder.encode(msg)
        finally:
            _state.frames = None
        header = _header_encoder.encode(Header(PROTOCOL_VERSION, kind, id, sender, len(frames)))
        return [header, body, *frames]

    def encode_call(self, kind: str, msg: Message, id: int = 0, sender: str = "",
                    shm_min_bytes: int = 0) -> tuple[list, str | None]:
        """`encode`, or with array bytes >= `shm_min_bytes` (> 0) the shared-memory form:
        [header, body, reference]. Returns the frames and the segment's name (None for frames);
        the caller unlinks it once the call has ended (`shm.unlink`)."""
        frames = self.encode(kind, msg, id, sender)
        size = shm_size(frames, shm_min_bytes)
        shared = self.encode_shared(kind, msg, id, sender, size) if size else None
        return shared[:2] if shared is not None else (frames, None)

    def encode_shared(self, kind: str, msg: Message, id: int, sender: str, size: int,
                      pool: shm.Pool | None = None) -> tuple[list, str, int] | None:
        """The shared-memory form in a free slot of `pool`, else a fresh segment, of `size`
        bytes (`shm_size`): (frames, segment name, use: > 0 for a pooled slot, 0 for a segment
        the caller unlinks); None when /dev/shm cannot take it (then frames still work). Safe
        to run in another thread: the thread gets its own encoder and its own encoding state."""
        try:
            writer = (pool.acquire(size) if pool is not None else None) or shm.create(size)
        except OSError as e:
            log.warning("shared memory unavailable (%s); sending %s as frames", e,
                        type(msg).__name__)
            return None
        encoder = getattr(_state, "encoder", None)
        if encoder is None:
            encoder = _state.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        _state.writer = writer
        try:
            body = encoder.encode(msg)
            writer.flush()
        except OSError as e:
            _drop(writer, pool)
            log.warning("shared memory full (%s); sending %s as frames", e, type(msg).__name__)
            return None
        except BaseException:
            _drop(writer, pool)
            raise
        finally:
            _state.writer = None
            writer.close()
        ref = msgspec.msgpack.encode(_ShmRef(writer.name, writer.size, writer.use))
        header = _header_encoder.encode(Header(PROTOCOL_VERSION, kind, id, sender, 1))
        return [header, body, ref], writer.name, writer.use

    def decode_header(self, frames: Sequence) -> Header:
        if len(frames) < 2:
            raise WireError(f"expected at least 2 frames (header, body), got {len(frames)}",
                            "Header")
        raw = _buf(frames[0])
        try:
            header = _header_decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise WireError(_explain(e), "Header", _field_of(e)) from None
        if header.v != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"peer {clip(header.sender) or '?'} speaks wire protocol v{header.v}, this process "
                f"speaks v{PROTOCOL_VERSION}; run the same Miles version on every node", "Header",
                "v")
        if header.kind not in KINDS:
            raise WireError(f"unknown kind {clip(header.kind)!r}, expected one of "
                            f"{', '.join(sorted(KINDS))}", "Header", "kind")
        if header.n_arrays != len(frames) - 2:
            raise WireError(f"header announces {header.n_arrays} array frames, "
                            f"{len(frames) - 2} came", "Header", "n_arrays")
        return header

    def peek_header(self, frames: Sequence) -> Header | None:
        """The header's kind, id and sender if they can be read at all (any version, any frame
        count), else None: enough to address an error reply."""
        if not frames:
            return None
        try:
            fields = _any_decoder.decode(_buf(frames[0]))
        except msgspec.DecodeError:
            return None
        if not (isinstance(fields, list) and len(fields) >= 3 and isinstance(fields[1], str)
                and type(fields[2]) is int and fields[2] > 0):
            return None
        sender = fields[3] if len(fields) > 3 and isinstance(fields[3], str) else ""
        return Header(fields[0] if type(fields[0]) is int else -1, clip(fields[1]), fields[2],
                      clip(sender))

    def decode(self, frames: Sequence, on_release: Any = None) -> tuple[Header, Message]:
        """`on_release(name, use)`: called (from whichever thread drops the last array) once a
        pooled segment's arrays of this message are all gone."""
        header = self.decode_header(frames)
        body = _buf(frames[1])
        _state.frames = [_buf(f) for f in frames[2:]]
        _state.segments, _state.bad, _state.missing = {}, [], False
        _state.on_release = on_release
        try:
            msg = self._body_decoder().decode(body)
            if _state.bad:  # a shared-memory array in an untyped (Any) field
                raise _state.bad[0].error
            return header, msg
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise (ShmUnavailable if _state.missing else WireError)(
                _explain(e), _peek_type(body), _field_of(e)) from None
        finally:
            _state.frames = _state.segments = _state.bad = _state.on_release = None


def _drop(writer: shm.Writer, pool: shm.Pool | None) -> None:
    """A segment that will not be sent: a pooled slot is free again, a fresh one unlinked."""
    if writer.use and pool is not None:
        pool.release(writer.name, writer.use)
    else:
        shm.unlink(writer.name)


def shm_size(frames: list, shm_min_bytes: int) -> int:
    """The segment size for these frames' arrays, or 0 when they stay frames (below the
    threshold, or the threshold is 0)."""
    arrays = frames[2:]
    if shm_min_bytes <= 0 or sum(len(f) for f in arrays) < shm_min_bytes:
        return 0
    return sum(shm.aligned(len(f)) for f in arrays)


def _buf(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


_MSGPACK_TYPES = {"dict": "map", "list": "array", "str": "string", "bytes": "binary",
                  "NoneType": "nil"}


def _peek_type(body: Any) -> str:
    try:
        obj = _any_decoder.decode(body)
    except Exception:
        return "body (not one msgpack value)"
    if isinstance(obj, dict):
        tag = obj.get("type")
        if tag is None:
            return "body (a map without a 'type' tag)"
        return tag if isinstance(tag, str) else f"body (its 'type' tag is not a string but {type(tag).__name__})"
    name = type(obj).__name__
    return f"body (a msgpack {_MSGPACK_TYPES.get(name, name)}, not a message map)"


# msgspec ends its errors with " - at `$.path`" or " - at `key` in `$.path`" (a map key).
_AT = re.compile(r" - at `(key` in `)?([^`]*)`$")


def _field_of(e: Exception) -> str:
    m = _AT.search(str(e))
    if m is None:
        return ""
    return f"a key in {m.group(2)}" if m.group(1) else m.group(2)


_QUOTED = re.compile(r"'([^']{%d})[^']+'" % ECHO_CHARS)


def _explain(e: Exception) -> str:
    text = _AT.sub("", str(e)).replace("got `unknown`", "got a byte msgpack never uses")
    return _QUOTED.sub(r"'\1...'", text)


_default = Codec()
encode = _default.encode
decode = _default.decode
