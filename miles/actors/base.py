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
- A ref caches its actor's connection, so a call costs no registry round trip. When that
  connection has dropped, the next call asks the registry once: the same incarnation still alive
  means a transient drop (reconnect); anything else means the incarnation is gone, and the call
  fails at once with `ActorDied` (or, with `retries > 0`, waits for the next incarnation) instead
  of waiting out its timeout on a dead endpoint. A fresh connection whose first connect is
  refused fails the same way.
- Cancellation crosses the wire: a caller that times out or is cancelled sends a `cancel` frame,
  and the actor cancels that call's handler task; when a caller's connection is gone (probed with
  `Server.peer_alive` on every disconnect and every `peer_check_interval_s`), its calls and streams
  are cancelled too. Handlers see `asyncio.CancelledError`, so `finally` blocks clean up (an
  abandoned `Reserve` gives its slot back). Tells are not cancelled: nobody waits on them, and a
  sender may well exit right after one. Plain `def` handlers run to the end.
- Streams are bounded: at most `max_streams_per_caller` open per caller; the next `stream_open`
  gets an error reply naming the limit.
- Streams carry bulk data with credit-based flow control: the receiver grants `window` credits
  and returns one per item its handler has consumed; the sender waits when it has none. Memory on
  both sides is bounded and nothing is dropped.
- The registry is itself an actor (on the head node). Every actor registers its endpoint with an
  incarnation number and sends heartbeats; `Lookup(wait_s=...)` is the wait-for primitive.
- Event-loop lag is sampled continuously (how late a 50 ms timer fires) and exported in
  `Metrics` with call counts and refused-frame counts. Once the actor has started (set-up in
  `on_start` may block), a watchdog thread logs a warning when the loop has not ticked for
  `lag_warn_s`, while it is still stuck: the actor's name, the handlers in flight (message type,
  seconds running) and where the loop thread is. The registry warns when an actor's heartbeats
  stop (name, incarnation, seconds since the last one), and reports an actor `disconnected` (so
  lookups skip it) as soon as the connection it registered and heart-beats on is gone; `alive`
  stays the heartbeat verdict, which is what the node daemon's liveness watcher acts on.
- With CurveZMQ keys in the environment (`miles.wire.auth`) the runtime runs a ZAP handler and
  every inbox and connection is authenticated and encrypted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import time
import traceback
import typing
from typing import Any, AsyncIterator, Callable

import zmq

from miles.wire import auth, shm
from miles.wire.codec import Codec
from miles.wire.messages import (registered_messages, ActorInfo, ErrorReply, GetMetrics, Header,
                                 Heartbeat, Lookup, Message, Metrics, Ok, Ping, Pong, Register,
                                 Shutdown, StreamOpen)
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


class StreamReceiver:
    """What an actor's `on_stream` iterates; returns credits as items are consumed."""

    _END = object()

    def __init__(self, actor: "Actor", ident: bytes, id: int, topic: str, window: int):
        self.actor, self.ident, self.id, self.topic, self.window = actor, ident, id, topic, window
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
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
    max_streams_per_caller = 64
    heartbeat_interval_s = 1.0
    lag_interval_s = 0.05
    lag_warn_s = 1.0            # the watchdog warns when the loop is stuck this long
    peer_check_interval_s = 2.0  # backstop for the per-disconnect probe of callers
    recipe = None               # the resolved Recipe, set by the host process
    spec = None                 # this role's ActorSpec (placement and `options`)

    def __init__(self, name: str = ""):
        self.name = name or type(self).__name__.lower()
        self.incarnation = int(os.environ.get("MILES_INCARNATION", "0"))
        self._handlers = _handlers_of(type(self))
        self._streams: dict[tuple[bytes, int], StreamReceiver] = {}
        self._tasks: set[asyncio.Task] = set()
        # async handlers in flight: (ident, call id) for calls, the coroutine for tells ->
        # (task, caller ident or None for a tell, message type name, monotonic start)
        self._inflight: dict[Any, tuple[asyncio.Task, bytes | None, str, float]] = {}
        self._inline_msg: Message | None = None  # the plain handler running now, for the watchdog
        self._loop_tick = time.monotonic()
        self._watchdog_stop = threading.Event()
        self._stopped: asyncio.Event | None = None
        self.counters = {"calls": 0, "tells": 0, "handler_errors": 0, "streams": 0,
                         "cancelled": 0, "streams_refused": 0}
        self.loop_lag_ms = 0.0
        self.loop_lag_max_ms = 0.0

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self, runtime: Runtime, host: str = "127.0.0.1", port: int = 0,
                    register: bool = True) -> str:
        self.runtime = runtime
        if self.recipe is not None:
            runtime.shm_min_bytes = self.recipe.cluster.shm_min_bytes
        self._stopped = asyncio.Event()
        self.server = Server(runtime.ctx, runtime.codec, self._dispatch, host, port, self.name,
                             curve=runtime.curve)
        self.server.on_disconnect = self._on_disconnect
        self.server.on_peer_gone = self._peer_gone
        self.server.start()
        self._loop_tick = time.monotonic()
        self._spawn(self._measure_lag())
        self._spawn(self._watch_peers())
        await self.on_start()
        if register and runtime.registry_endpoint:
            await runtime.registry.call(Register(name=self.name, endpoint=self.server.endpoint,
                                                 pid=os.getpid(), node_rank=runtime.node_rank,
                                                 incarnation=self.incarnation), timeout_s=30.0)
            self._spawn(self._heartbeat())
        # Armed only now: imports and set-up in on_start block the loop by design.
        self._loop_tick = time.monotonic()
        threading.Thread(target=self._watchdog, args=(threading.get_ident(),), daemon=True,
                         name=f"watchdog:{self.name}").start()
        return self.server.endpoint

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def close(self) -> None:
        self._watchdog_stop.set()
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
                "refused_handshakes": float(self.server.refused_handshakes),
                "loop_lag_ms": self.loop_lag_ms, "loop_lag_max_ms": self.loop_lag_max_ms,
                "incarnation": float(self.incarnation),
                **{k: float(v) for k, v in shm.stats.items()}}

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
        elif kind == "cancel":
            self._cancel(ident, header.id)

    def _handle(self, ident: bytes, header: Header, msg: Message) -> None:
        """Run a plain (`def`) handler inline; an `async def` one in a task of its own."""
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise ActorError(f"actor {self.name!r} has no handler for {type(msg).__name__}")
            self._inline_msg = msg
            result = handler(self, msg)
        except Exception as e:
            self._inline_msg = None
            self._reply_error(ident, header, msg, e)
            return
        self._inline_msg = None
        if inspect.iscoroutine(result):
            call = header.kind == "call"
            key = (ident, header.id) if call else result
            task = self._spawn(self._finish_async(key, ident, header, msg, result))
            # cancelled before it ran (a cancel frame, shutdown): close the handler's coroutine,
            # which was never awaited (closing a finished one does nothing)
            task.add_done_callback(lambda t, coro=result: coro.close() if t.cancelled() else None)
            self._inflight[key] = (task, ident if call else None, type(msg).__name__,
                                   time.monotonic())
        else:
            self._reply(ident, header, result)

    async def _finish_async(self, key: Any, ident: bytes, header: Header, msg: Message,
                            coro) -> None:
        try:
            result = await coro
        except Exception as e:
            self._reply_error(ident, header, msg, e)
            return
        finally:
            self._inflight.pop(key, None)
        self._reply(ident, header, result)

    def _cancel(self, ident: bytes, id: int) -> None:
        """The caller gave up on call or stream `id`: cancel its handler."""
        entry = self._inflight.get((ident, id))
        task = entry[0] if entry is not None else getattr(self._streams.get((ident, id)), "task", None)
        if task is not None and not task.done():
            task.cancel()
            self.counters["cancelled"] += 1

    def _peer_gone(self, ident: bytes) -> None:
        """A caller's connection is gone: cancel its calls and drop its streams."""
        tasks = [t for t, who, _, _ in list(self._inflight.values()) if who == ident]
        tasks += [rx.task for key, rx in list(self._streams.items()) if key[0] == ident and rx.task]
        tasks = [t for t in tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.counters["cancelled"] += len(tasks)
            log.info("%s: a caller disconnected; cancelled %d of its handlers and streams",
                     self.name, len(tasks))

    def _watched_peers(self) -> set[bytes]:
        """Callers whose disconnect matters: those with calls or streams in flight."""
        peers = {who for _, who, _, _ in self._inflight.values() if who is not None}
        return peers | {key[0] for key in self._streams}

    def _probe_peers(self) -> None:
        for ident in self._watched_peers():
            self.server.peer_alive(ident)

    def _on_disconnect(self) -> None:
        # The ROUTER may take a moment to drop the closed connection's routing id: probe again.
        loop = asyncio.get_running_loop()
        for delay in (0.0, 0.05, 0.5):
            loop.call_later(delay, self._probe_peers)

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
        open_now = sum(1 for who, _ in self._streams if who == ident)
        if open_now >= self.max_streams_per_caller:
            self.counters["streams_refused"] += 1
            self.server.send_now(ident, "error", ErrorReply(
                error_type="ActorError", actor=self.name,
                message=f"stream {topic[:100]!r} refused: this caller already has {open_now} open "
                        f"streams (the limit, max_streams_per_caller = "
                        f"{self.max_streams_per_caller}); close one first"), header.id)
            return
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

        rx.task = self._spawn(run())

    # ----- background ------------------------------------------------------------------------

    async def _measure_lag(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.lag_interval_s)
            self._loop_tick = time.monotonic()
            lag_ms = max(0.0, (time.perf_counter() - t0 - self.lag_interval_s) * 1e3)
            self.loop_lag_ms = 0.9 * self.loop_lag_ms + 0.1 * lag_ms
            self.loop_lag_max_ms = max(self.loop_lag_max_ms, lag_ms)

    async def _watch_peers(self) -> None:
        while True:  # the backstop: a disconnect event normally triggers the probe at once
            await asyncio.sleep(self.peer_check_interval_s)
            self._probe_peers()

    def _watchdog(self, loop_thread: int) -> None:
        """A thread: warn (once per stall) while the event loop is stuck, saying what it runs."""
        warned = False
        while not self._watchdog_stop.wait(min(0.25, self.lag_warn_s / 4)):
            stalled = time.monotonic() - self._loop_tick
            if stalled <= self.lag_warn_s:
                warned = False
            elif not warned:
                warned = True
                log.warning("%s: event loop stuck for %.1fs (warning at %.1fs); %s", self.name,
                            stalled, self.lag_warn_s, self._doing(loop_thread))

    def _doing(self, loop_thread: int) -> str:
        now = time.monotonic()
        for _ in range(3):  # the loop thread may still change the table under us
            try:
                running = sorted(self._inflight.values(), key=lambda e: e[3])
                break
            except RuntimeError:
                running = []
        parts = [f"{name} ({now - t0:.1f}s)" for _, _, name, t0 in running[:10]]
        if len(running) > 10:
            parts.append(f"{len(running) - 10} more")
        inline = self._inline_msg
        if inline is not None:
            parts.insert(0, f"{type(inline).__name__} (plain handler, running now)")
        frame = sys._current_frames().get(loop_thread)
        where = ""
        if frame is not None:
            last = traceback.extract_stack(frame)[-1]
            where = f"; the loop thread is at {last.filename}:{last.lineno} in {last.name}"
        return f"handlers in flight: {', '.join(parts) or 'none'}{where}"

    async def _heartbeat(self) -> None:
        registry = self.runtime.registry
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await registry.tell(Heartbeat(name=self.name, incarnation=self.incarnation,
                                              loop_lag_ms=self.loop_lag_ms))
            except ActorError as e:
                log.warning("%s: heartbeat failed: %s", self.name, e)



# The registry is an actor too; it lives in its own module and is importable from here as before.
from miles.actors.registry import Registry  # noqa: E402
