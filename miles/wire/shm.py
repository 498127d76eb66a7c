"""Same-host bulk arrays through one POSIX shared-memory segment per message.

A call whose arrays add up to `cluster.shm_min_bytes` or more, sent to an actor on this host,
writes every array once into a fresh segment under /dev/shm; the message then carries one small
reference frame instead of one frame per array, and the receiver wraps the arrays with
`np.frombuffer` over a read-only mapping of the segment (no copy after the sender's one write).

Design decisions:
- "Same host" is decided from the endpoint alone (`same_host`): ipc:// and inproc://, a loopback
  address (127.0.0.0/8, ::1, localhost), or the address this process itself advertises
  (MILES_HOST, which the node daemon sets to its node's address, so actors of one node reach each
  other through it). Two node daemons on loopback share one machine, so shm is right for them
  too. Where that guess is wrong (containers with host networking but private /dev/shm), the
  receiver cannot open the segment and refuses the frame with `ShmUnavailable`; the connection
  then re-sends that call as frames and stops using shm (`miles.wire.transport`).
- Only call requests use it: the call's own lifetime bounds the segment's. The receiver unlinks
  the name as soon as it has mapped it (the mapping stays valid while its arrays live); the
  sender unlinks it when the call ends in any way (reply, error, timeout, the receiver died), and
  an atexit hook unlinks whatever this process still owns. A receiver SIGKILLed before it read
  the message therefore leaks nothing. Replies, tells and streams keep frames: nobody would know
  when to unlink theirs.
- Names are `miles-shm-<job>-<pid>-<n>-<random>`: the job is MILES_JOB_ID, else the registry's port
  (one head per port per machine), else "solo"; `sweep(prefix)` removes a job's leftovers (a
  sender that was itself SIGKILLed mid-call). Created with O_EXCL and mode 0600.
- The sender writes with `pwritev` (one system call per 1,024 arrays), not through a mapping of
  its own: tmpfs allocates the pages as it copies, which measured about twice as fast as
  posix_fallocate + MAP_POPULATE + memcpy, and a full /dev/shm is an OSError (the call falls
  back to frames), never a SIGBUS in the middle of a copy.
- The receiver maps with MAP_POPULATE, so the page-table cost is paid while decoding (like a
  frame's receive), not at the trainer's first touch; PROT_READ makes the arrays read-only.
- Strict like every frame: the reference is msgpack (name, size) with a name matching
  `NAME_RE`, a regular file of exactly that size, and every array's (offset, dtype, shape) inside
  it. Anything else is a `WireError` (raised by the codec, naming the field).
- The default threshold (8 MiB, `DEFAULT_MIN_BYTES` = `cluster.shm_min_bytes`' default): on a
  2-core CPU box (bench/data_plane.py, idle), with pooled segments, one rank is sent 1 / 4 / 16 /
  64 / 256 MB 1.1 / 1.8 / 1.5 / 1.8 / 2.6x faster than as frames, for 1.4-3x less CPU. Below a
  few MB the difference is microseconds, and a pooled slot holds its size of /dev/shm for the
  connection's life, so small calls stay frames.
- Pooled segments (`Pool`, one per connection): a fresh segment costs tmpfs a page allocation on
  every write and the receiver a mapping, an unmapping and the pages' release (73 MB: ~60 ms of
  a ~15 ms copy on the 2-core box). So a connection keeps up to `POOL_SLOTS` segments of its own
  and writes each call into a free one; the receiver keeps them mapped (`map_pooled`, at most
  `MAPPED_MAX`) and, for each call, views its arrays through one base ndarray whose
  `weakref.finalize` tells the sender (a `shm_free` frame: `ShmFree(name, use)`) once the last
  array of that call is gone; only then is the slot written again. `use` counts a slot's calls,
  so a late release never frees a newer one. A slot whose release never comes (a receiver that
  keeps the arrays, or timed out) stays busy, and calls beyond the free slots take fresh
  segments as before. A pooled name stays linked while its connection lives: the connection's
  close (or loss), the atexit hook, or a job's `sweep` unlinks it; the receiver drops a mapping
  whose name is gone when it maps the next one.
- Linux only (/dev/shm); elsewhere `available()` is False and everything travels as frames.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from urllib.parse import urlsplit

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"miles-shm-[A-Za-z0-9_.-]{1,200}")
ALIGN = 64  # each array starts on a cache line
DEFAULT_MIN_BYTES = 8 << 20  # a bare Runtime's; the same as cluster.shm_min_bytes' default
_LOCAL_NAMES = {"localhost", "ip6-localhost"}

_owned: set[str] = set()
POOL_SLOTS = 2  # pooled segments per connection: one being read, one being written
MAPPED_MAX = 8  # pooled segments a receiver keeps mapped
# This process's segments: what `Actor.metrics` reports (shm_sent, shm_received, ..._bytes;
# shm_pooled: calls written into a reused segment).
stats = {"shm_sent": 0, "shm_sent_bytes": 0, "shm_received": 0, "shm_received_bytes": 0,
         "shm_pooled": 0}
_counter = itertools.count()
_token = secrets.token_hex(3)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def job_prefix(env: os._Environ | dict = os.environ) -> str:
    """The name prefix of this job's segments: `miles-shm-<job>-`."""
    job = env.get("MILES_JOB_ID", "")
    if not job:
        port = urlsplit(env.get("MILES_REGISTRY", "")).port if env.get("MILES_REGISTRY") else None
        job = f"p{port}" if port else "solo"
    return f"miles-shm-{re.sub(r'[^A-Za-z0-9_.]', '_', job)[:64]}-"


def same_host(endpoint: str, env: os._Environ | dict = os.environ) -> bool:
    """Whether an actor at `endpoint` shares this host's /dev/shm (see the module docstring)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in _LOCAL_NAMES or (host and host == env.get("MILES_HOST", "")):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Writer:
    """One segment being filled: `put(buffer)` returns the offset it will have, `flush()` writes
    every buffer put (OSError: /dev/shm is full), `close()` closes the file."""

    def __init__(self, size: int, slot: "_Slot | None" = None, pool: "Pool | None" = None):
        self.size = size
        self.use = 0  # > 0: a pooled slot's use number (the receiver releases name and use)
        self._offset = 0
        self._iov: list = []
        self._slot, self._pool = slot, pool
        if slot is not None:
            self.name, self._fd, self.use = slot.name, slot.fd, slot.use
            return
        self.name = new_name()
        self._fd = _create(self.name, size)

    def put(self, buf: memoryview) -> int:
        offset, n = self._offset, len(buf)
        end = aligned(offset + n)
        if n:
            self._iov.append(buf)
        if end - offset - n:
            self._iov.append(_ZEROS[:end - offset - n])
        self._offset = end
        return offset

    def flush(self) -> None:
        written = 0
        for i in range(0, len(self._iov), _IOV_MAX):
            chunk = self._iov[i:i + _IOV_MAX]
            want = sum(len(b) for b in chunk)
            got = os.pwritev(self._fd, chunk, written)
            while got < want:  # a short write (signal, memory pressure): go on where it stopped
                rest = memoryview(b"".join(bytes(b) for b in chunk))[got:]
                n = os.pwrite(self._fd, rest, written + got)
                if n <= 0:
                    raise OSError(f"shared-memory segment {self.name!r}: write made no progress")
                got += n
            written += want
        self._iov = []
        stats["shm_sent"] += 1
        stats["shm_sent_bytes"] += self.size

    def close(self) -> None:
        if self._fd >= 0:
            if self._pool is not None:
                self._pool._written(self._slot)
            else:
                os.close(self._fd)
        self._fd = -1


def new_name() -> str:
    return f"{job_prefix()}{os.getpid()}-{next(_counter)}-{_token}"


def _create(name: str, size: int) -> int:
    """A new segment file of `size` bytes (sparse: pages come with the writes); its fd."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o600)
    _owned.add(name)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    return fd


def create(size: int) -> Writer:
    return Writer(size)


class _Slot:
    def __init__(self, name: str, fd: int, capacity: int):
        self.name, self.fd, self.capacity = name, fd, capacity
        self.use = 0
        self.busy = False     # written, and not yet released by the receiver
        self.writing = False  # its fd is in use by a Writer (closed after it, if the pool is)


class Pool:
    """A connection's reusable segments (see the module docstring). `acquire(size)` gives a
    Writer into a free slot (grown to `size` if needed; a new slot while fewer than `slots`),
    or None when every slot is busy; `release(name, use)` frees a slot once the receiver has
    dropped that call's arrays; `close()` unlinks every slot. Thread-safe: writers run in
    worker threads, releases on the event loop."""

    def __init__(self, slots: int = POOL_SLOTS):
        self.max_slots = slots
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, size: int) -> Writer | None:
        with self._lock:
            if self._closed:
                return None
            free = [s for s in self._slots.values() if not s.busy]
            slot = min((s for s in free if s.capacity >= size), key=lambda s: s.capacity, default=None)
            if slot is None and free:  # grow a free one rather than take more memory
                slot = max(free, key=lambda s: s.capacity)
            elif slot is None and len(self._slots) < self.max_slots:
                name = new_name()
                slot = self._slots[name] = _Slot(name, _create(name, size), size)
            if slot is None:
                return None
            if slot.capacity < size:  # grown in place; the receiver maps it again
                os.ftruncate(slot.fd, size)
                slot.capacity = size
            slot.busy = slot.writing = True
            slot.use += 1
            if slot.use > 1:
                stats["shm_pooled"] += 1
            return Writer(size, slot, self)

    def _written(self, slot: _Slot) -> None:
        with self._lock:
            slot.writing = False
            if self._closed:
                os.close(slot.fd)

    def release(self, name: str, use: int) -> bool:
        """Free slot `name` if `use` is its current call; False for a stale or unknown release."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.use != use or not slot.busy:
                return False
            slot.busy = False
            return True

    def busy(self) -> int:
        with self._lock:
            return sum(s.busy for s in self._slots.values())

    def names(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
            for slot in slots:
                if not slot.writing:  # else its Writer closes it: the fd must not be reused under it
                    os.close(slot.fd)
        for slot in slots:
            unlink(slot.name)


def _map(name: str, size: int, pooled: bool) -> mmap.mmap:
    """Map segment `name` read-only: exactly `size` bytes, or a pooled slot of at least `size`
    (mapped whole); ValueError/ShmMissing say what is wrong."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"shared-memory name {str(name)[:100]!r} is not a Miles segment name")
    if size <= 0:
        raise ValueError(f"shared-memory segment {name!r} has size {size}, expected > 0")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ShmMissing(f"shared-memory segment {name!r} does not exist: the sender is on "
                         "another host (or another /dev/shm), or it gave up on the call") from None
    except OSError as e:
        raise ValueError(f"shared-memory segment {name!r} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"shared-memory segment {name!r} is not a regular file")
        if st.st_size < size if pooled else st.st_size != size:
            raise ValueError(f"shared-memory segment {name!r} has {st.st_size} bytes, the "
                             f"reference says {size}")
        return mmap.mmap(fd, st.st_size if pooled else size, flags=mmap.MAP_SHARED | _POPULATE,
                         prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def open_readonly(name: str, size: int) -> mmap.mmap:
    """Map a one-call segment `name` read-only and unlink it."""
    mm = _map(name, size, pooled=False)
    try:
        os.unlink(os.path.join(SHM_DIR, name))  # the mapping outlives the name
    except OSError:
        pass  # another user's segment in the sticky /dev/shm: its sender unlinks it
    stats["shm_received"] += 1
    stats["shm_received_bytes"] += size
    return mm


_mapped: "OrderedDict[str, mmap.mmap]" = OrderedDict()
_mapped_lock = threading.Lock()


def map_pooled(name: str, size: int) -> mmap.mmap:
    """A pooled segment's mapping (kept for its next calls; mapped again when it grew). Arrays
    of earlier calls keep their own mapping alive, so dropping one from the cache is safe."""
    with _mapped_lock:
        mm = _mapped.get(name)
        if mm is None or len(mm) < size:
            mm = _mapped[name] = _map(name, size, pooled=True)
            for old in [n for n in _mapped if n != name and not os.path.exists(os.path.join(SHM_DIR, n))]:
                del _mapped[old]  # its sender closed it
            while len(_mapped) > MAPPED_MAX:
                _mapped.popitem(last=False)
        _mapped.move_to_end(name)
    stats["shm_received"] += 1
    stats["shm_received_bytes"] += size
    return mm


def mapped_names() -> list[str]:
    with _mapped_lock:
        return list(_mapped)


class ShmMissing(ValueError):
    """The referenced segment is not visible here: not the same host after all."""


def unlink(name: str) -> None:
    _owned.discard(name)
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass  # the receiver got there first: the normal case


def owned() -> frozenset[str]:
    """Names this process created and has not unlinked yet (for tests and the atexit hook)."""
    return frozenset(_owned)


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (a job's leftovers); returns them."""
    if not prefix.startswith("miles-shm-") or not available():
        return []
    gone = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            unlink(name)
            gone.append(name)
    return gone


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_ZEROS = memoryview(bytes(ALIGN))


@atexit.register
def _unlink_owned() -> None:
    for name in list(_owned):
        unlink(name)
