"""Refs to actors: the per-process `Runtime` (ZeroMQ context, codec, connections, registry
address), `ActorRef` (call / tell / stream to a named actor or an endpoint) and the errors a
call ends with. The design decisions are in `miles/runtime/__init__.py`."""

from __future__ import annotations

import asyncio
import os
import time
import typing
from typing import Any

import zmq

from miles.wire import auth, shm
from miles.wire.codec import Codec
from miles.wire.messages import ActorInfo, ErrorReply, Header, Lookup, Message, Ok, StreamOpen
from miles.wire.transport import Connection, ConnectionLost, RemoteError

__all__ = ["ActorRef", "Runtime", "ActorError", "ActorTimeout", "ActorDied", "RemoteError",
           "StreamSender", "run_event_loop"]


class ActorError(RuntimeError):
    pass


class ActorTimeout(ActorError, TimeoutError):
    pass


class ActorDied(ActorError):
    pass


def run_event_loop(main: typing.Coroutine) -> Any:
    """asyncio.run with uvloop when it is installed."""
    try:
        import uvloop
        return uvloop.run(main)
    except ImportError:
        return asyncio.run(main)


_FROM_ENV: Any = object()


class Runtime:
    """Per-process state: the ZeroMQ context, the codec, connections, and the registry's address.

    `curve`: the job's CurveZMQ keys, None for plain sockets; by default they come from the
    environment (`MILES_CURVE_PUBLIC` / `MILES_CURVE_SECRET`), which is how the node daemon hands
    them to its children. `shm_min_bytes`: calls to actors on this host with at least this many
    array bytes go through shared memory (`miles.wire.shm`; 0 = never); an actor's start sets it
    from its recipe's `cluster.shm_min_bytes`."""

    def __init__(self, registry: str | None = None, name: str = "", node_rank: int = 0,
                 curve: auth.CurveKeys | None = _FROM_ENV,
                 shm_min_bytes: int = shm.DEFAULT_MIN_BYTES):
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.registry_endpoint = registry
        self.name = name or f"client-{os.getpid()}"
        self.node_rank = node_rank
        self.shm_min_bytes = shm_min_bytes
        self.curve = auth.keys_from_env() if curve is _FROM_ENV else curve
        self.recorder = None  # a miles.wire.recorder.WireRecorder records this process's calls
        self._authenticator = (auth.start_authenticator(self.ctx, self.curve)
                               if self.curve is not None else None)
        self._conns: dict[str, Connection] = {}

    def connection(self, endpoint: str, named: bool = False) -> Connection:
        conn = self._conns.get(endpoint)
        if conn is None or conn.lost:
            if conn is not None:
                conn.close()
            conn = self._conns[endpoint] = Connection(self.ctx, self.codec, endpoint, self.name,
                                                      self.curve)
            if shm.same_host(endpoint) and shm.available():
                conn.shm_min_bytes = self.shm_min_bytes
        if named:
            conn.fail_if_refused = True
        return conn

    def ref(self, name: str) -> "ActorRef":
        return ActorRef(self, name=name)

    def ref_at(self, endpoint: str, name: str = "") -> "ActorRef":
        return ActorRef(self, name=name or endpoint, endpoint=endpoint)

    @property
    def registry(self) -> "ActorRef":
        if not self.registry_endpoint:
            raise ActorError("no registry endpoint configured (MILES_REGISTRY is not set)")
        return self.ref_at(self.registry_endpoint, "registry")

    async def lookup(self, name: str, wait_s: float = 0.0, min_incarnation: int = 0) -> ActorInfo:
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            info = await self.registry.call(Lookup(name=name, wait_s=left), timeout_s=left + 10.0)
            assert isinstance(info, ActorInfo)
            if info.alive and not info.disconnected and info.incarnation >= min_incarnation:
                return info
            if left <= 0:
                raise ActorError(f"actor {name!r} is not registered and alive (waited {wait_s:.1f}s)")
            await asyncio.sleep(min(0.05, left))

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        if self._authenticator is not None:
            self._authenticator.stop()
        self.ctx.destroy(linger=0)


class ActorRef:
    """A handle on a named actor (resolved through the registry) or a fixed endpoint."""

    def __init__(self, runtime: Runtime, name: str, endpoint: str | None = None):
        self.runtime, self.name = runtime, name
        self._fixed = endpoint
        self._endpoint = endpoint
        self._incarnation = 0
        self._conn: Connection | None = None

    async def _connection(self, timeout_s: float, min_incarnation: int = 0) -> Connection:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        if self._fixed is None:
            if conn is not None:
                await self._gone_or_transient(conn, timeout_s)
            if self._endpoint is None:
                info = await self.runtime.lookup(self.name, wait_s=timeout_s,
                                                 min_incarnation=min_incarnation)
                self._endpoint, self._incarnation = info.endpoint, info.incarnation
        self._conn = self.runtime.connection(self._endpoint, named=self._fixed is None)
        return self._conn

    async def _gone_or_transient(self, conn: Connection, timeout_s: float) -> None:
        """The connection to our incarnation dropped: raise its ConnectionLost unless the registry
        still has that very incarnation alive at that endpoint (then the caller reconnects)."""
        self._conn = None
        info = await self.runtime.registry.call(Lookup(name=self.name),
                                                timeout_s=max(0.1, min(timeout_s, 10.0)))
        if not (isinstance(info, ActorInfo) and info.alive and not info.disconnected
                and info.endpoint == self._endpoint
                and info.incarnation == self._incarnation):
            self._endpoint = None
            raise conn.lost

    def _forget(self) -> None:
        self._conn = None
        if self._fixed is None:
            self._endpoint = None

    async def call(self, msg: Message, timeout_s: float = 60.0, retries: int = 0) -> Message:
        deadline = time.monotonic() + timeout_s
        attempt, min_inc = 0, 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ActorTimeout(f"actor {self.name!r} did not answer {type(msg).__name__} "
                                   f"within {timeout_s:.1f}s")
            sent = False
            try:
                conn = await self._connection(left, min_inc)
                sent = True
                recorder = self.runtime.recorder  # the flight recorder (logging.record_wire)
                if recorder is not None:
                    recorder.record("call", self.name, msg)
                reply = await conn.request("call", msg, deadline - time.monotonic())
                if recorder is not None:
                    recorder.record("reply", self.name, reply)
                return reply
            except ConnectionLost as e:
                self._forget()
                if attempt >= retries or self._fixed is not None:
                    what = "while handling" if sent else "before it was sent"
                    raise ActorDied(f"actor {self.name!r} (incarnation {self._incarnation}) died "
                                    f"{what} {type(msg).__name__}: {e}") from None
                attempt += 1
                min_inc = self._incarnation + 1  # wait for the restarted incarnation
            except asyncio.TimeoutError:
                raise ActorTimeout(f"actor {self.name!r} did not answer {type(msg).__name__} "
                                   f"within {timeout_s:.1f}s") from None
            except ActorError as e:
                if "not registered" in str(e):
                    raise ActorTimeout(f"actor {self.name!r} is not available: {e}") from None
                raise

    async def wait_restarted(self, timeout_s: float = 60.0) -> int:
        """After `ActorDied`: wait until the next incarnation has registered; returns it."""
        info = await self.runtime.lookup(self.name, wait_s=timeout_s,
                                         min_incarnation=self._incarnation + 1)
        self._endpoint, self._incarnation = info.endpoint, info.incarnation
        self._conn = None
        return info.incarnation

    async def tell(self, msg: Message, timeout_s: float = 60.0) -> None:
        try:
            conn = await self._connection(timeout_s)
            await conn.send("tell", msg, 0)
        except ConnectionLost as e:
            self._forget()
            raise ActorDied(f"actor {self.name!r} is gone: {e}") from None

    def stream(self, topic: str, timeout_s: float = 60.0) -> "StreamSender":
        return StreamSender(self, topic, timeout_s)


class StreamSender:
    """`async with ref.stream("topic") as s: await s.send(msg)`; `s.result` is the reply."""

    def __init__(self, ref: ActorRef, topic: str, timeout_s: float):
        self.ref, self.topic, self.timeout_s = ref, topic, timeout_s
        self.result: Message | None = None
        self.sent = 0
        self._credits = 0
        self._credit_event = asyncio.Event()
        self._error: BaseException | None = None

    def _on_frame(self, header: Header, msg: Message) -> None:
        if header.kind == "stream_credit" and isinstance(msg, StreamOpen):
            self._credits += msg.credits
        elif header.kind == "error" and isinstance(msg, ErrorReply):
            self._error = (ActorDied(f"actor {self.ref.name!r} died during stream {self.topic!r}: "
                                     f"{msg.message}") if msg.error_type == "ConnectionLost"
                           else RemoteError(msg))
        self._credit_event.set()

    async def __aenter__(self) -> "StreamSender":
        try:
            self._conn = await self.ref._connection(self.timeout_s)
        except ConnectionLost as e:
            self.ref._forget()
            raise ActorDied(f"actor {self.ref.name!r} is gone: {e}") from None
        self._id = self._conn.next_id()
        self._final = asyncio.get_running_loop().create_future()
        self._final.add_done_callback(lambda f: f.exception())  # consumed by close()
        self._conn.pending[self._id] = self._final
        self._conn.credit_handlers[self._id] = self._on_frame
        await self._conn.send("stream_open", StreamOpen(topic=self.topic), self._id)
        return self

    async def send(self, msg: Message) -> None:
        while self._credits <= 0:
            self._raise_if_failed()
            self._credit_event.clear()
            try:
                await asyncio.wait_for(self._credit_event.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ActorTimeout(f"stream {self.topic!r} to {self.ref.name!r}: no credit from "
                                   f"the receiver for {self.timeout_s:.1f}s") from None
        self._raise_if_failed()
        self._credits -= 1
        await self._conn.send("stream_item", msg, self._id)
        self.sent += 1

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._final.done() and self._final.exception() is not None:
            exc = self._final.exception()
            raise (ActorDied(f"actor {self.ref.name!r} died during stream {self.topic!r}: {exc}")
                   if isinstance(exc, ConnectionLost) else exc)

    async def close(self) -> Message:
        await self._conn.send("stream_end", Ok(), self._id)
        try:
            self.result = await asyncio.wait_for(asyncio.shield(self._final), self.timeout_s)
        except ConnectionLost as e:
            raise ActorDied(f"actor {self.ref.name!r} died during stream {self.topic!r}: {e}") from None
        except asyncio.TimeoutError:
            raise ActorTimeout(f"stream {self.topic!r}: no summary within {self.timeout_s:.1f}s") from None
        return self.result

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is None:
                await self.close()
            else:
                try:
                    await self._conn.send("stream_close", Ok(detail=str(exc)[:200]), self._id)
                except ConnectionLost:
                    pass
        finally:
            self._conn.pending.pop(self._id, None)
            self._conn.credit_handlers.pop(self._id, None)
