"""ZeroMQ plumbing for actors: one ROUTER server per actor, one DEALER connection per peer.

Design decisions:
- Request/reply is matched by a call id chosen by the caller, so one connection carries any number
  of concurrent calls (no REQ/REP lock-step) and replies may come back out of order.
- A connection watches its socket's monitor events: when the peer's TCP connection drops (the
  process died), every call waiting on it fails at once with `ConnectionLost` instead of waiting
  out its timeout. That is what lets a caller see a crash in milliseconds. A connection made for a
  named actor also fails at once when its very first connect is refused (nothing listens at the
  endpoint the registry gave: that incarnation is gone).
- ZeroMQ heartbeats (ZMTP PING every `HEARTBEAT_IVL_MS`, dropped after `HEARTBEAT_TIMEOUT_MS`
  without traffic) run on both ends in ZeroMQ's I/O thread, so a peer whose host vanished
  (no FIN, no RST) is noticed too, and a busy Python loop never causes a false drop. Any traffic
  counts, so a long transfer cannot time a connection out.
- A caller that gives up on a call (timeout, or its task was cancelled) sends a `cancel` frame
  with the call id, so the actor can cancel the handler instead of finishing work nobody awaits.
- The inbox learns that a caller is gone with `ROUTER_MANDATORY`: a send to a routing id whose
  connection has closed fails with EHOSTUNREACH. `Server.peer_alive` sends a tiny `probe` frame
  for that (libzmq 4.3's ROUTER_NOTIFY is a draft API, missing from the wheels), and the server's
  own monitor reports each disconnect, so the actor probes right away instead of polling often.
- A received frame larger than `MAX_FRAME_BYTES` (1 GiB; ZeroMQ's MAXMSGSIZE, which bounds each
  frame of a message) makes ZeroMQ drop the sending connection before Python sees a byte, so a
  hostile frame cannot exhaust memory. Real traffic stays far below it: a 64 MB rollout batch
  travels as one small frame per array.
- Frames are sent with copy=False: pyzmq still copies small frames (below its copy threshold),
  while large array frames go to the kernel straight from the numpy buffer.
- A frame that fails to decode is counted and dropped; whenever its header's kind and a call id
  can be read (any protocol version, any frame count, any kind), the sender gets an error reply
  naming the message type and field, so it does not hang. Tells carry id 0 and get none.
- Stream credits: the receiver grants credits; a sender waits for one before each item, so a slow
  consumer slows the producer and nothing is dropped.
- Sockets are plain (not zmq.asyncio) sockets driven by `_Pump`: the loop watches the socket's
  file descriptor and drains every ready message synchronously, and sends go straight to ZeroMQ
  (its queues are unbounded here, so a send never blocks). This removes a future and a poller
  round per message, which is most of the per-call cost on a small machine.
- A call to an actor on this host whose arrays reach `Connection.shm_min_bytes` sends them
  through one shared-memory segment (`miles.wire.shm`), unlinked when the call ends in any way.
  If the actor cannot see the segment (`ShmUnavailable`: not one /dev/shm after all), the call
  is re-sent as frames at once and the connection stops using shared memory. The segment is
  written in a worker thread (`pwritev` releases the GIL): the event loop keeps serving, and
  calls to several ranks write their segments at once, as ZeroMQ's I/O thread copies frames
  for several sockets at once. Such a call leaves after the write, so a smaller message sent
  meanwhile on the same connection may overtake it (calls never had an order among themselves).
  Each connection writes into its own pooled segments (`shm.Pool`) while one is free: the
  receiver's inbox sends a `shm_free` frame when a call's arrays are gone, and the slot is
  written again only then; the pool is unlinked when the connection closes or is lost.
- With CurveZMQ keys (`miles.wire.auth`), the inbox is a CURVE server and every connection a CURVE
  client; without them the sockets are plain. A connection whose handshake fails (keys on one end
  only, or the wrong keys) fails its calls at once with a message saying so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from typing import Awaitable, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from miles.wire import auth, shm
from miles.wire.codec import Codec, ShmUnavailable, WireError, shm_size
from miles.wire.messages import ErrorReply, Header, Message, Ok, ShmFree

log = logging.getLogger(__name__)

Handler = Callable[[bytes, Header, Message], Awaitable[None] | None]


class ConnectionLost(ConnectionError):
    """The peer's connection dropped while a call or stream was waiting on it."""


class RemoteError(RuntimeError):
    """The remote handler failed; carries the remote error's type and message."""

    def __init__(self, reply: ErrorReply):
        self.reply = reply
        where = f" in actor {reply.actor}" if reply.actor else ""
        super().__init__(f"{reply.error_type}{where}: {reply.message}")


MAX_FRAME_BYTES = 1 << 30
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 20_000
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_INBOX_KINDS = frozenset(("call", "tell", "stream_open", "stream_item", "stream_end",
                          "stream_close", "cancel"))


def tune(sock: zmq.Socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # flow control is ours (credits), never ZeroMQ's silent drop
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


_ZERO_COPY_BYTES = 64 * 1024
# Plain ints: pyzmq's constants are enums, and enum arithmetic on the hot path is measurable.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class _Pump:
    """Runs a plain ZeroMQ socket on the event loop: `on_frames` gets every message, in order.

    ZeroMQ's descriptor is edge-triggered and any socket operation may consume the edge, so after
    every send we look at ZMQ_EVENTS and schedule a drain ourselves if a message is waiting.
    """

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None]):
        self.sock, self.on_frames = sock, on_frames
        self.loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._drain)
        self._scheduled = False
        self._closed = False
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        sock = self.sock
        for _ in range(256):  # yield to the loop now and then under a flood
            # Ask ZMQ_EVENTS instead of catching zmq.Again: building that exception costs more
            # than a whole small message.
            if self._closed or not sock.get(_EVENTS) & _POLLIN:
                return
            self.on_frames(sock.recv_multipart(copy=False))
        self._schedule()

    def send(self, frames: list) -> None:
        if self._closed:
            raise ConnectionLost("socket is closed")
        # Zero-copy only pays for big frames; for small ones pyzmq's Frame objects cost more.
        copy = all(len(f) < _ZERO_COPY_BYTES for f in frames)
        while True:
            try:
                self.sock.send_multipart(frames, _NOBLOCK, copy=copy)
                break
            except zmq.Again:  # cannot happen with unbounded queues; be safe anyway
                zmq.select([], [self.sock], [], 0.01)
        if self.sock.get(_EVENTS) & _POLLIN:
            self._schedule()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.remove_reader(self._fd)
            self.sock.close(linger=0)


class Server:
    """An actor's inbox: a ROUTER socket; `on_message` is called for every decoded frame.

    `on_disconnect()` is called when any peer's connection closes; `on_peer_gone(ident)` when a
    send finds that a caller's connection is gone."""

    max_frame_bytes = MAX_FRAME_BYTES

    def __init__(self, ctx: zmq.Context, codec: Codec, on_message: Handler,
                 host: str = "127.0.0.1", port: int = 0, name: str = "",
                 curve: auth.CurveKeys | None = None):
        self.codec, self.on_message, self.name = codec, on_message, name
        self.on_disconnect: Callable[[], None] | None = None
        self.on_peer_gone: Callable[[bytes], None] | None = None
        self.sock = ctx.socket(zmq.ROUTER)
        tune(self.sock, self.max_frame_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone caller raises: see peer_alive
        if curve is not None:
            auth.make_server(self.sock, curve)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.bad_frames = 0
        self.last_bad_frame = ""
        self.refused_handshakes = 0  # peers without the job's CurveZMQ key, or with another
        self._pump: _Pump | None = None
        self._monitor_pump: _Pump | None = None
        self._probe = codec.encode("probe", Ok(), 0, name)

    def start(self) -> None:
        self._pump = _Pump(self.sock, self._on_frames)
        self._monitor_pump = _Pump(self._monitor, self._on_monitor)

    def _on_frames(self, frames: list) -> None:
        ident, frames = frames[0].bytes, frames[1:]
        try:
            header, msg = self.codec.decode(frames, lambda name, use: self._released(ident, name, use))
            if header.kind not in _INBOX_KINDS:
                raise WireError(f"kind {header.kind!r} is not sent to an actor's inbox", "Header",
                                "kind")
        except WireError as e:
            self.bad_frames += 1
            self.last_bad_frame = str(e)
            self._refuse(ident, frames, e)
            return
        try:
            self.on_message(ident, header, msg)
        except Exception:  # a dispatcher bug must not stop the inbox
            log.exception("%s: dispatch of %s failed", self.name, type(msg).__name__)

    def _released(self, ident: bytes, name: str, use: int) -> None:
        """A pooled segment's arrays are all gone (any thread): tell its writer, from the loop."""
        loop = self._pump.loop if self._pump is not None else None
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._send_free, ident, name, use)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _send_free(self, ident: bytes, name: str, use: int) -> None:
        if self._pump is None or self._pump._closed:
            return
        try:
            self._pump.send([ident, *self.codec.encode("shm_free", ShmFree(name=name, use=use), 0,
                                                       self.name)])
        except (zmq.ZMQError, ConnectionLost):
            pass  # the writer is gone: its pool went with it

    def _refuse(self, ident: bytes, frames, error: WireError) -> None:
        header = self.codec.peek_header(frames)  # None unless it names a call id (> 0)
        if header is not None:
            self.send_now(ident, "error", ErrorReply(error_type=type(error).__name__,
                                                     message=str(error), actor=self.name),
                          header.id)

    def _on_monitor(self, frames: list) -> None:
        if parse_monitor_message([f.bytes for f in frames])["event"] & _HANDSHAKE_FAILED:
            self.refused_handshakes += 1
        elif self.on_disconnect is not None:
            self.on_disconnect()

    def send_now(self, ident: bytes, kind: str, msg: Message, id: int = 0) -> bool:
        """Send to a caller; False (and `on_peer_gone`) when its connection is gone."""
        return self._send(ident, self.codec.encode(kind, msg, id, self.name))

    def _send(self, ident: bytes, frames: list) -> bool:
        try:
            self._pump.send([ident, *frames])
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        if self.on_peer_gone is not None:
            self.on_peer_gone(ident)
        return False

    def peer_alive(self, ident: bytes) -> bool:
        """Whether the caller `ident` is still connected (a `probe` frame, which callers ignore)."""
        return self._send(ident, self._probe)

    async def send(self, ident: bytes, kind: str, msg: Message, id: int = 0) -> None:
        self.send_now(ident, kind, msg, id)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        if self._monitor_pump is not None:
            self._monitor_pump.close()
        else:
            self._monitor.close(linger=0)
        if self._pump is not None:
            self._pump.close()
        else:
            self.sock.close(linger=0)


class Connection:
    """A DEALER connection to one endpoint, shared by every call and stream to it.

    `fail_if_refused`: fail every call at once if the first connect is refused (set for
    connections to named actors, whose endpoint came from the registry). `shm_min_bytes` > 0:
    calls with at least that many array bytes go through shared memory (same host only: the
    runtime sets it from `shm.same_host`)."""

    def __init__(self, ctx: zmq.Context, codec: Codec, endpoint: str, sender: str = "",
                 curve: auth.CurveKeys | None = None):
        self.codec, self.endpoint, self.sender = codec, endpoint, sender
        self.fail_if_refused = False
        self.shm_min_bytes = 0
        self.shm_pool = shm.Pool()  # slots are created on first use
        self.sock = ctx.socket(zmq.DEALER)
        tune(self.sock)
        if curve is not None:
            auth.make_client(self.sock, curve)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            | _HANDSHAKE_FAILED)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.credit_handlers: dict[int, Callable[[Header, Message], None]] = {}
        self.bad_frames = 0
        self.lost: ConnectionLost | None = None
        self._connected = False
        self.loop = asyncio.get_running_loop()
        self._pump = _Pump(self.sock, self._on_frames)
        self._monitor_pump = _Pump(self._monitor, self._on_monitor)

    def next_id(self) -> int:
        return next(self._ids)

    def send_now(self, kind: str, msg: Message, id: int) -> None:
        if self.lost:
            raise self.lost
        self._pump.send(self.codec.encode(kind, msg, id, self.sender))

    async def send(self, kind: str, msg: Message, id: int) -> None:
        self.send_now(kind, msg, id)

    async def request(self, kind: str, msg: Message, timeout_s: float | None) -> Message:
        """Send and wait for the reply with the same id; raises RemoteError, ConnectionLost,
        or asyncio.TimeoutError."""
        id = next(self._ids)
        fut = self.loop.create_future()
        self.pending[id] = fut
        timer = segment = None
        pooled = sent = False
        started = self.loop.time()
        try:
            if self.lost:
                raise self.lost
            frames = self.codec.encode(kind, msg, id, self.sender)
            size = shm_size(frames, self.shm_min_bytes)
            if size:
                shared = await _write_segment(self.codec, kind, msg, id, self.sender, size,
                                              self.shm_pool)
                if shared is not None:
                    frames, segment, use = shared
                    pooled = use > 0
                if self.lost:  # it dropped while the segment was written
                    raise self.lost
            self._pump.send(frames)
            sent = True
            if timeout_s is not None:
                timer = self.loop.call_later(max(0.0, timeout_s), _expire, fut)
            return await fut
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._cancel(id)
            raise
        except RemoteError as e:
            if segment is None or e.reply.error_type != ShmUnavailable.__name__:
                raise
            log.warning("%s cannot see this host's shared memory (%s); sending as frames from "
                        "now on", self.endpoint, e.reply.message)
            self.shm_min_bytes = 0
            self.shm_pool.close()
        finally:
            if timer is not None:
                timer.cancel()
            self.pending.pop(id, None)
            if segment is not None and not pooled:
                shm.unlink(segment)
            elif pooled and not sent:  # never left: the receiver cannot hold its arrays
                self.shm_pool.release(segment, use)
        left = None if timeout_s is None else timeout_s - (self.loop.time() - started)
        return await self.request(kind, msg, left)

    def _cancel(self, id: int) -> None:
        """Tell the actor that nobody waits for call `id` any more."""
        if self.lost is None:
            try:
                self._pump.send(self.codec.encode("cancel", Ok(), id, self.sender))
            except (ConnectionLost, zmq.ZMQError):
                pass

    def _on_frames(self, frames: list) -> None:
        try:
            header, msg = self.codec.decode(frames)
        except WireError as e:
            self.bad_frames += 1
            log.warning("dropped a bad reply from %s: %s", self.endpoint, e)
            return
        if header.kind == "shm_free":
            if isinstance(msg, ShmFree):
                self.shm_pool.release(msg.name, msg.use)
            return
        if header.kind in ("reply", "error"):
            fut = self.pending.get(header.id)
            if fut is not None and not fut.done():
                if header.kind == "error" and isinstance(msg, ErrorReply):
                    fut.set_exception(RemoteError(msg))
                else:
                    fut.set_result(msg)
            # else: the caller gave up (timeout); late replies are dropped on purpose
        handler = self.credit_handlers.get(header.id)
        if handler is not None:
            handler(header, msg)

    def _on_monitor(self, frames: list) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] == zmq.EVENT_CONNECTED:
            self._connected = True
        elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected and self.lost is None:
            self._fail(ConnectionLost(f"connection to {self.endpoint} lost"))
        elif event["event"] & _HANDSHAKE_FAILED and self.lost is None:
            self._fail(ConnectionLost(
                f"the handshake with {self.endpoint} failed: something that is not this job's actor "
                f"answered there, or, with cluster.auth = 'curve', the two ends do not hold the same "
                f"CurveZMQ keys ({auth.CURVE_PUBLIC_ENV} / {auth.CURVE_SECRET_ENV}; without curve, "
                f"neither end may hold them)"))
        elif (event["event"] == zmq.EVENT_CONNECT_RETRIED and not self._connected
              and self.fail_if_refused and self.lost is None):
            self._fail(ConnectionLost(f"connection to {self.endpoint} refused: nothing listens "
                                      "there any more"))

    def _fail(self, error: ConnectionLost, closing: bool = False) -> None:
        self.lost = error
        self.shm_pool.close()  # the receiver's mappings outlive the names
        if not closing:  # ZeroMQ would keep reconnecting to the dead endpoint while the socket lives
            self.loop.call_soon(self.close)
        for fut in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(error)
        for handler in list(self.credit_handlers.values()):
            handler(Header(0, "error", 0), ErrorReply(error_type="ConnectionLost", message=str(error)))

    def close(self) -> None:
        if self.lost is None:
            self._fail(ConnectionLost(f"connection to {self.endpoint} closed"), closing=True)
        if self._pump._closed:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor_pump.close()
        self._pump.close()


_writers: concurrent.futures.ThreadPoolExecutor | None = None


async def _write_segment(codec: Codec, kind: str, msg: Message, id: int, sender: str,
                         size: int, pool: shm.Pool) -> tuple[list, str, int] | None:
    """`codec.encode_shared` in a worker thread; a caller cancelled meanwhile still gets the
    segment unlinked (or its pooled slot freed) once the thread has written it."""
    global _writers
    if _writers is None:
        _writers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="miles-shm")
    job = _writers.submit(codec.encode_shared, kind, msg, id, sender, size, pool)
    try:
        return await asyncio.shield(asyncio.wrap_future(job))
    except asyncio.CancelledError:
        job.add_done_callback(lambda j: _drop_result(j, pool))
        raise


def _drop_result(job: concurrent.futures.Future, pool: shm.Pool) -> None:
    if not job.cancelled() and job.exception() is None and job.result() is not None:
        _, name, use = job.result()
        if use:
            pool.release(name, use)
        else:
            shm.unlink(name)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())
