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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable

import zmq
import zmq.asyncio
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


class Server:
    """An actor's inbox: a ROUTER socket; `on_message` is called for every decoded frame."""

    def __init__(self, ctx: zmq.asyncio.Context, codec: Codec, on_message: Handler,
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
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name=f"serve:{self.name}")

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident, frames = frames[0].bytes, frames[1:]
            try:
                header, msg = self.codec.decode(frames)
            except WireError as e:
                self.bad_frames += 1
                self.last_bad_frame = str(e)
                await self._refuse(ident, frames, e)
                continue
            try:
                result = self.on_message(ident, header, msg)
                if result is not None:
                    await result
            except Exception:  # a dispatcher bug must not stop the inbox
                log.exception("%s: dispatch of %s failed", self.name, type(msg).__name__)

    async def _refuse(self, ident: bytes, frames, error: WireError) -> None:
        try:
            header = self.codec.decode_header(frames)
        except WireError:
            return  # nothing to answer to
        if header.kind in ("call", "stream_open", "stream_item"):
            await self.send(ident, "error", ErrorReply(error_type=type(error).__name__,
                                                       message=str(error), actor=self.name),
                            header.id)

    async def send(self, ident: bytes, kind: str, msg: Message, id: int = 0) -> None:
        frames = self.codec.encode(kind, msg, id, self.name)
        await self.sock.send_multipart([ident, *frames], copy=False)

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.sock.close(linger=0)


class Connection:
    """A DEALER connection to one endpoint, shared by every call and stream to it."""

    def __init__(self, ctx: zmq.asyncio.Context, codec: Codec, endpoint: str, sender: str = ""):
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
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(), name=f"read:{endpoint}"),
                       loop.create_task(self._watch(), name=f"watch:{endpoint}")]

    def next_id(self) -> int:
        return next(self._ids)

    async def send(self, kind: str, msg: Message, id: int) -> None:
        if self.lost:
            raise self.lost
        await self.sock.send_multipart(self.codec.encode(kind, msg, id, self.sender), copy=False)

    async def request(self, kind: str, msg: Message, timeout_s: float | None) -> Message:
        """Send and wait for the reply with the same id; raises RemoteError, ConnectionLost,
        or asyncio.TimeoutError."""
        id = self.next_id()
        fut = asyncio.get_running_loop().create_future()
        self.pending[id] = fut
        try:
            await self.send(kind, msg, id)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.pop(id, None)

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                header, msg = self.codec.decode(frames)
            except WireError as e:
                self.bad_frames += 1
                log.warning("dropped a bad reply from %s: %s", self.endpoint, e)
                continue
            if header.kind in ("reply", "error"):
                fut = self.pending.get(header.id)
                if fut is None or fut.done():
                    continue  # the caller gave up (timeout); late replies are dropped on purpose
                if header.kind == "error" and isinstance(msg, ErrorReply):
                    fut.set_exception(RemoteError(msg))
                else:
                    fut.set_result(msg)
            handler = self.credit_handlers.get(header.id)
            if handler is not None:
                handler(header, msg)

    async def _watch(self) -> None:
        connected = False
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                self._fail(ConnectionLost(f"connection to {self.endpoint} lost"))
                return

    def _fail(self, error: ConnectionLost) -> None:
        self.lost = error
        for fut in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(error)
        for handler in list(self.credit_handlers.values()):
            handler(Header(0, "error", 0), ErrorReply(error_type="ConnectionLost", message=str(error)))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._fail(ConnectionLost(f"connection to {self.endpoint} closed"))
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
