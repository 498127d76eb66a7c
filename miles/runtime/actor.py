"""The actor: typed handlers behind a ZeroMQ inbox, streams in, heartbeats, metrics and the
event-loop watchdog. The design decisions are in `miles/runtime/__init__.py`."""

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

from miles.runtime.refs import ActorError, Runtime
from miles.wire import shm
from miles.wire.messages import (registered_messages, ErrorReply, GetMetrics, Header, Heartbeat,
                                 Message, Metrics, Ok, Ping, Pong, Register, Shutdown, StreamOpen)
from miles.wire.transport import Server

log = logging.getLogger(__name__)


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

    # modules a warm spare process imports before it is needed (`restart.spare`)
    preload: tuple[str, ...] = ()

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
