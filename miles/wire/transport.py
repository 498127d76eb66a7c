"""ZeroMQ plumbing for actors: one ROUTER server per actor, one DEALER connection per peer.

Design decisions:
- Request/reply is matched by a call id chosen by the caller, so one connection carries any number
  of concurrent calls (no REQ/REP lock-step) and replies may come back out of order.
- A connection watches its socket's monitor events: when the peer's TCP connection drops (the
  process died), every call waiting on it fails at once with `ConnectionLost` instead of waiting
  out its timeout. That is what lets a caller see a crash in milliseconds.
- Frames are sent with copy=False: pyzmq still copies small frames (below its copy threshold),
  while large array frames go to the kernel straight from the numpy buffer.
- A frame that fails to decode is counted and dropped; if its header was readable and it was a
  call, the sender gets an error reply naming the message type and field, so it does not hang.
- Stream credits: the receiver grants credits; a sender waits for one before each item, so a slow
  consumer slows the producer and nothing is dropped.
- Sockets are plain (not zmq.asyncio) sockets driven by `_Pump`: the loop watches the socket's
  file descriptor and drains every ready message synchronously, and sends go straight to ZeroMQ
  (its queues are unbounded here, so a send never blocks). This removes a future and a poller
  round per message, which is most of the per-call cost on a small machine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from miles.wire.codec import Codec, WireError
from miles.wire.messages import ErrorReply, Header, Message

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


def tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # flow control is ours (credits), never ZeroMQ's silent drop
    sock.setsockopt(zmq.RCVHWM, 0)


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
    """An actor's inbox: a ROUTER socket; `on_message` is called for every decoded frame."""

    def __init__(self, ctx: zmq.Context, codec: Codec, on_message: Handler,
                 host: str = "127.0.0.1", port: int = 0, name: str = ""):
        self.codec, self.on_message, self.name = codec, on_message, name
        self.sock = ctx.socket(zmq.ROUTER)
        tune(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.bad_frames = 0
        self.last_bad_frame = ""
        self._pump: _Pump | None = None

    def start(self) -> None:
        self._pump = _Pump(self.sock, self._on_frames)

    def _on_frames(self, frames: list) -> None:
        ident, frames = frames[0].bytes, frames[1:]
        try:
            header, msg = self.codec.decode(frames)
        except WireError as e:
            self.bad_frames += 1
            self.last_bad_frame = str(e)
            self._refuse(ident, frames, e)
            return
        try:
            self.on_message(ident, header, msg)
        except Exception:  # a dispatcher bug must not stop the inbox
            log.exception("%s: dispatch of %s failed", self.name, type(msg).__name__)

    def _refuse(self, ident: bytes, frames, error: WireError) -> None:
        try:
            header = self.codec.decode_header(frames)
        except WireError:
            return  # nothing to answer to
        if header.kind in ("call", "stream_open", "stream_item"):
            self.send_now(ident, "error", ErrorReply(error_type=type(error).__name__,
                                                     message=str(error), actor=self.name),
                          header.id)

    def send_now(self, ident: bytes, kind: str, msg: Message, id: int = 0) -> None:
        self._pump.send([ident, *self.codec.encode(kind, msg, id, self.name)])

    async def send(self, ident: bytes, kind: str, msg: Message, id: int = 0) -> None:
        self.send_now(ident, kind, msg, id)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
        else:
            self.sock.close(linger=0)


class Connection:
    """A DEALER connection to one endpoint, shared by every call and stream to it."""

    def __init__(self, ctx: zmq.Context, codec: Codec, endpoint: str, sender: str = ""):
        self.codec, self.endpoint, self.sender = codec, endpoint, sender
        self.sock = ctx.socket(zmq.DEALER)
        tune(self.sock)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
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
        timer = None
        try:
            self.send_now(kind, msg, id)
            if timeout_s is not None:
                timer = self.loop.call_later(max(0.0, timeout_s), _expire, fut)
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self.pending.pop(id, None)

    def _on_frames(self, frames: list) -> None:
        try:
            header, msg = self.codec.decode(frames)
        except WireError as e:
            self.bad_frames += 1
            log.warning("dropped a bad reply from %s: %s", self.endpoint, e)
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

    def _fail(self, error: ConnectionLost) -> None:
        self.lost = error
        for fut in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(error)
        for handler in list(self.credit_handlers.values()):
            handler(Header(0, "error", 0), ErrorReply(error_type="ConnectionLost", message=str(error)))

    def close(self) -> None:
        if self.lost is None:
            self._fail(ConnectionLost(f"connection to {self.endpoint} closed"))
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor_pump.close()
        self._pump.close()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())
