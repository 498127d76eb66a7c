"""Actors: typed async handlers behind a ZeroMQ inbox, refs to call them, streams, the registry.

Design decisions:
- A handler is any method whose single parameter is annotated with a `Message` subclass; the
  return annotation is the reply type. No decorators, no string dispatch: the type of the
  incoming message picks the handler, and a user's subclass adds handlers by writing methods.
  A plain `def` handler runs inline as the frame is read (cheapest: no task); an `async def` one
  gets a task of its own and may await.
- Handlers of one actor run concurrently on its event loop (an RL buffer's `get` must be able to
  wait while a `put` arrives). State is safe between awaits because the loop is single-threaded.
- `ActorRef.call(msg, timeout_s)` never hangs: it ends with the reply, a `RemoteError` (the
  handler raised), `ActorTimeout`, or `ActorDied` as soon as the connection drops. With
  `retries > 0` a call whose actor died is re-sent to the restarted incarnation (for idempotent
  messages only: the caller decides).
- Streams carry bulk data with credit-based flow control: the receiver grants `window` credits
  and returns one per item its handler has consumed; the sender waits when it has none. Memory on
  both sides is bounded and nothing is dropped.
- The registry is itself an actor (on the head node). Every actor registers its endpoint with an
  incarnation number and sends heartbeats; `Lookup(wait_s=...)` is the wait-for primitive.
- Event-loop lag is sampled continuously (how late a 50 ms timer fires) and exported in
  `Metrics` with call counts and refused-frame counts.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
import typing
from typing import Any, AsyncIterator, Callable

import zmq

from miles.wire.codec import Codec
from miles.wire.messages import (registered_messages, ActorInfo, ActorList, ErrorReply, GetMetrics, Header, Heartbeat,
                                 ListActors, Lookup, Message, Metrics, Ok, Ping, Pong, Register,
                                 Shutdown, StreamOpen, Unregister)
from miles.wire.transport import Connection, ConnectionLost, RemoteError, Server

log = logging.getLogger(__name__)

__all__ = ["Actor", "ActorRef", "Runtime", "Registry", "ActorError", "ActorTimeout", "ActorDied",
           "RemoteError", "run_event_loop"]


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


class Runtime:
    """Per-process state: the ZeroMQ context, the codec, connections, and the registry's address."""

    def __init__(self, registry: str | None = None, name: str = "", node_rank: int = 0):
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.registry_endpoint = registry
        self.name = name or f"client-{os.getpid()}"
        self.node_rank = node_rank
        self._conns: dict[str, Connection] = {}

    def connection(self, endpoint: str) -> Connection:
        conn = self._conns.get(endpoint)
        if conn is None or conn.lost:
            if conn is not None:
                conn.close()
            conn = self._conns[endpoint] = Connection(self.ctx, self.codec, endpoint, self.name)
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
            if info.alive and info.incarnation >= min_incarnation:
                return info
            if left <= 0:
                raise ActorError(f"actor {name!r} is not registered and alive (waited {wait_s:.1f}s)")
            await asyncio.sleep(min(0.05, left))

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self.ctx.destroy(linger=0)


class ActorRef:
    """A handle on a named actor (resolved through the registry) or a fixed endpoint."""

    def __init__(self, runtime: Runtime, name: str, endpoint: str | None = None):
        self.runtime, self.name = runtime, name
        self._fixed = endpoint
        self._endpoint = endpoint
        self._incarnation = 0

    async def _connection(self, timeout_s: float, min_incarnation: int = 0) -> Connection:
        if self._endpoint is None:
            info = await self.runtime.lookup(self.name, wait_s=timeout_s,
                                             min_incarnation=min_incarnation)
            self._endpoint, self._incarnation = info.endpoint, info.incarnation
        return self.runtime.connection(self._endpoint)

    def _forget(self) -> None:
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
            try:
                conn = await self._connection(left, min_inc)
                return await conn.request("call", msg, deadline - time.monotonic())
            except ConnectionLost as e:
                self._forget()
                if attempt >= retries or self._fixed is not None:
                    raise ActorDied(f"actor {self.name!r} died while handling "
                                    f"{type(msg).__name__}: {e}") from None
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
        return info.incarnation

    async def tell(self, msg: Message, timeout_s: float = 60.0) -> None:
        conn = await self._connection(timeout_s)
        try:
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
        self._conn = await self.ref._connection(self.timeout_s)
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


class StreamReceiver:
    """What an actor's `on_stream` iterates; returns credits as items are consumed."""

    _END = object()

    def __init__(self, actor: "Actor", ident: bytes, id: int, topic: str, window: int):
        self.actor, self.ident, self.id, self.topic, self.window = actor, ident, id, topic, window
        self.queue: asyncio.Queue = asyncio.Queue()
        self._unacked = 0

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._items()

    async def _items(self) -> AsyncIterator[Message]:
        while True:
            item = await self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            self._unacked += 1
            if self._unacked >= max(1, self.window // 2):
                n, self._unacked = self._unacked, 0
                await self.actor.server.send(self.ident, "stream_credit",
                                             StreamOpen(topic=self.topic, credits=n), self.id)


def _handlers_of(cls: type) -> dict[type[Message], Callable]:
    table: dict[type[Message], Callable] = {}
    for klass in reversed(cls.__mro__):
        for attr, fn in vars(klass).items():
            if not inspect.isfunction(fn) or attr.startswith("_"):
                continue
            params = list(inspect.signature(fn).parameters.values())[1:]
            if len(params) != 1:
                continue
            hint = params[0].annotation
            if isinstance(hint, str):  # postponed annotations: resolve, else by message tag
                try:
                    hint = typing.get_type_hints(fn).get(params[0].name)
                except Exception:
                    hint = registered_messages().get(hint.rsplit(".", 1)[-1])
            if isinstance(hint, type) and issubclass(hint, Message):
                table[hint] = fn
    return table


class Actor:
    """Subclass and write `async def on_x(self, msg: X) -> Y` handlers."""

    stream_window = 16          # credits granted per stream
    heartbeat_interval_s = 1.0
    lag_interval_s = 0.05
    recipe = None               # the resolved Recipe, set by the host process
    spec = None                 # this role's ActorSpec (placement and `options`)

    def __init__(self, name: str = ""):
        self.name = name or type(self).__name__.lower()
        self.incarnation = int(os.environ.get("MILES_INCARNATION", "0"))
        self._handlers = _handlers_of(type(self))
        self._streams: dict[tuple[bytes, int], StreamReceiver] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopped: asyncio.Event | None = None
        self.counters = {"calls": 0, "tells": 0, "handler_errors": 0, "streams": 0}
        self.loop_lag_ms = 0.0
        self.loop_lag_max_ms = 0.0

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self, runtime: Runtime, host: str = "127.0.0.1", port: int = 0,
                    register: bool = True) -> str:
        self.runtime = runtime
        self._stopped = asyncio.Event()
        self.server = Server(runtime.ctx, runtime.codec, self._dispatch, host, port, self.name)
        self.server.start()
        self._spawn(self._measure_lag())
        await self.on_start()
        if register and runtime.registry_endpoint:
            await runtime.registry.call(Register(name=self.name, endpoint=self.server.endpoint,
                                                 pid=os.getpid(), node_rank=runtime.node_rank,
                                                 incarnation=self.incarnation), timeout_s=30.0)
            self._spawn(self._heartbeat())
        return self.server.endpoint

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def close(self) -> None:
        await self.on_stop()
        for t in list(self._tasks):
            t.cancel()
        self.server.close()

    async def on_start(self) -> None:
        """Override: runs after the inbox is bound, before registration."""

    async def run(self) -> int | None:
        """Override for an actor with a job of its own (a driver): the host process exits with
        its return value when it returns. Handlers keep being served while it runs."""
        await self.serve_forever()
        return 0

    @property
    def options(self) -> dict:
        return dict(self.spec.options) if self.spec is not None else {}

    async def on_stop(self) -> None:
        """Override: runs once at shutdown."""

    async def on_stream(self, topic: str, items: AsyncIterator[Message]) -> Message | None:
        raise ActorError(f"actor {self.name!r} does not accept streams (topic {topic!r})")

    def metrics(self) -> dict[str, float]:
        """Override to add figures; call super().metrics()."""
        return {**{k: float(v) for k, v in self.counters.items()},
                "bad_frames": float(self.server.bad_frames),
                "loop_lag_ms": self.loop_lag_ms, "loop_lag_max_ms": self.loop_lag_max_ms,
                "incarnation": float(self.incarnation)}

    # ----- built-in handlers -----------------------------------------------------------------

    def on_ping(self, msg: Ping) -> Pong:
        return Pong(payload=msg.payload, actor=self.name, incarnation=self.incarnation)

    def on_get_metrics(self, msg: GetMetrics) -> Metrics:
        return Metrics(actor=self.name, values=self.metrics())

    async def on_shutdown(self, msg: Shutdown) -> Ok:
        asyncio.get_running_loop().call_soon(self.stop)
        return Ok(detail=f"{self.name} stopping")

    # ----- dispatch --------------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _dispatch(self, ident: bytes, header: Header, msg: Message) -> None:
        kind = header.kind
        if kind == "call" or kind == "tell":
            self.counters["calls" if kind == "call" else "tells"] += 1
            self._handle(ident, header, msg)
        elif kind == "stream_open":
            self._open_stream(ident, header, msg)
        elif kind in ("stream_item", "stream_end", "stream_close"):
            rx = self._streams.get((ident, header.id))
            if rx is not None:
                rx.queue.put_nowait(msg if kind == "stream_item" else
                                    StreamReceiver._END if kind == "stream_end" else
                                    ActorError(f"sender aborted stream: {getattr(msg, 'detail', '')}"))

    def _handle(self, ident: bytes, header: Header, msg: Message) -> None:
        """Run a plain (`def`) handler inline; an `async def` one in a task of its own."""
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise ActorError(f"actor {self.name!r} has no handler for {type(msg).__name__}")
            result = handler(self, msg)
        except Exception as e:
            self._reply_error(ident, header, msg, e)
            return
        if inspect.iscoroutine(result):
            self._spawn(self._finish_async(ident, header, msg, result))
        else:
            self._reply(ident, header, result)

    async def _finish_async(self, ident: bytes, header: Header, msg: Message, coro) -> None:
        try:
            result = await coro
        except Exception as e:
            self._reply_error(ident, header, msg, e)
            return
        self._reply(ident, header, result)

    def _reply(self, ident: bytes, header: Header, result: Message | None) -> None:
        if header.kind == "call":
            self.server.send_now(ident, "reply", result if result is not None else Ok(), header.id)

    def _reply_error(self, ident: bytes, header: Header, msg: Message, e: Exception) -> None:
        self.counters["handler_errors"] += 1
        if header.kind == "call":
            self.server.send_now(ident, "error", ErrorReply(
                error_type=type(e).__name__, message=str(e), actor=self.name), header.id)
        else:
            log.error("%s: handler for %s failed: %r", self.name, type(msg).__name__, e)

    def _open_stream(self, ident: bytes, header: Header, msg: Message) -> None:
        topic = msg.topic if isinstance(msg, StreamOpen) else "?"
        rx = StreamReceiver(self, ident, header.id, topic, self.stream_window)
        self._streams[(ident, header.id)] = rx
        self.counters["streams"] += 1

        async def run() -> None:
            try:
                await self.server.send(ident, "stream_credit",
                                       StreamOpen(topic=topic, credits=self.stream_window), header.id)
                result = await self.on_stream(topic, rx)
                await self.server.send(ident, "reply", result if result is not None else Ok(),
                                       header.id)
            except Exception as e:
                self.counters["handler_errors"] += 1
                await self.server.send(ident, "error", ErrorReply(
                    error_type=type(e).__name__, message=str(e), actor=self.name), header.id)
            finally:
                self._streams.pop((ident, header.id), None)

        self._spawn(run())

    # ----- background ------------------------------------------------------------------------

    async def _measure_lag(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.lag_interval_s)
            lag_ms = max(0.0, (time.perf_counter() - t0 - self.lag_interval_s) * 1e3)
            self.loop_lag_ms = 0.9 * self.loop_lag_ms + 0.1 * lag_ms
            self.loop_lag_max_ms = max(self.loop_lag_max_ms, lag_ms)

    async def _heartbeat(self) -> None:
        registry = self.runtime.registry
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await registry.tell(Heartbeat(name=self.name, incarnation=self.incarnation,
                                              loop_lag_ms=self.loop_lag_ms))
            except ActorError as e:
                log.warning("%s: heartbeat failed: %s", self.name, e)


class Registry(Actor):
    """Name -> endpoint, with liveness from heartbeats. Runs on the head node."""

    def __init__(self, name: str = "registry", liveness_timeout_s: float = 10.0):
        super().__init__(name)
        self.liveness_timeout_s = liveness_timeout_s
        self.entries: dict[str, ActorInfo] = {}
        self.last_seen: dict[str, float] = {}
        self._changed = asyncio.Condition()

    def _info(self, name: str) -> ActorInfo:
        entry = self.entries.get(name)
        if entry is None:
            return ActorInfo(name=name)
        age = time.monotonic() - self.last_seen.get(name, 0.0)
        entry.alive = entry.endpoint != "" and age < self.liveness_timeout_s
        entry.last_seen_s = age
        return entry

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def on_register(self, msg: Register) -> Ok:
        prior = self.entries.get(msg.name)
        if prior is not None and prior.incarnation > msg.incarnation and self._info(msg.name).alive:
            raise ActorError(f"register {msg.name!r}: incarnation {msg.incarnation} is older than "
                             f"the live one ({prior.incarnation})")
        self.entries[msg.name] = ActorInfo(name=msg.name, endpoint=msg.endpoint, alive=True,
                                           incarnation=msg.incarnation, pid=msg.pid,
                                           node_rank=msg.node_rank)
        self.last_seen[msg.name] = time.monotonic()
        await self._notify()
        return Ok()

    async def on_unregister(self, msg: Unregister) -> Ok:
        entry = self.entries.get(msg.name)
        if entry is not None and entry.incarnation <= msg.incarnation:
            entry.endpoint = ""
            await self._notify()
        return Ok()

    def on_heartbeat(self, msg: Heartbeat) -> None:
        entry = self.entries.get(msg.name)
        if entry is not None and entry.incarnation == msg.incarnation:
            self.last_seen[msg.name] = time.monotonic()

    async def on_lookup(self, msg: Lookup) -> ActorInfo:
        deadline = time.monotonic() + msg.wait_s
        async with self._changed:
            while True:
                info = self._info(msg.name)
                left = deadline - time.monotonic()
                if info.alive or left <= 0:
                    return info
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return self._info(msg.name)

    async def on_list_actors(self, msg: ListActors) -> ActorList:
        return ActorList(actors=[self._info(n) for n in sorted(self.entries)])
