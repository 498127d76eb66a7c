"""The registry: actor name -> endpoint and incarnation, with liveness from heartbeats.

Runs in the head node's daemon. `Lookup(wait_s=...)` is the wait-for primitive; an actor whose
connection is gone is marked `disconnected` at once (lookups skip it), while `alive` stays the
heartbeat verdict the node daemon's liveness watcher acts on. See `miles/runtime/__init__.py` for the
actor runtime it is built on.
"""

from __future__ import annotations

import asyncio
import logging
import time

from miles.runtime.actor import Actor
from miles.runtime.refs import ActorError
from miles.wire.messages import (ActorInfo, ActorList, Header, Heartbeat, ListActors, Lookup,
                                 Message, Ok, Register, Unregister)

log = logging.getLogger(__name__)


class Registry(Actor):
    """Name -> endpoint, with liveness from heartbeats. Runs on the head node."""

    def __init__(self, name: str = "registry", liveness_timeout_s: float = 10.0):
        super().__init__(name)
        self.liveness_timeout_s = liveness_timeout_s
        self.entries: dict[str, ActorInfo] = {}
        self.last_seen: dict[str, float] = {}
        self._changed = asyncio.Condition()
        # The connection each actor registered and heart-beats on: ident -> {name: incarnation}.
        self._registrants: dict[bytes, dict[str, int]] = {}
        self._disconnected: dict[str, int] = {}  # name -> incarnation whose connection is gone
        self._silent: set[str] = set()           # names already warned about for no heartbeats

    def _info(self, name: str) -> ActorInfo:
        entry = self.entries.get(name)
        if entry is None:
            return ActorInfo(name=name)
        age = time.monotonic() - self.last_seen.get(name, 0.0)
        entry.alive = entry.endpoint != "" and age < self.liveness_timeout_s
        entry.disconnected = self._disconnected.get(name) == entry.incarnation
        entry.last_seen_s = age
        return entry

    async def on_start(self) -> None:
        self._spawn(self._watch_heartbeats())

    def _handle(self, ident: bytes, header: Header, msg: Message) -> None:
        if isinstance(msg, (Register, Heartbeat)):
            entry = self.entries.get(msg.name)
            if isinstance(msg, Register) or (entry is not None
                                             and entry.incarnation == msg.incarnation):
                self._registrants.setdefault(ident, {})[msg.name] = msg.incarnation
                if self._disconnected.get(msg.name) == msg.incarnation:
                    del self._disconnected[msg.name]  # a transient drop: it reconnected
        super()._handle(ident, header, msg)

    def _watched_peers(self) -> set[bytes]:
        return super()._watched_peers() | set(self._registrants)

    def _peer_gone(self, ident: bytes) -> None:
        super()._peer_gone(ident)
        for name, incarnation in self._registrants.pop(ident, {}).items():
            entry = self.entries.get(name)
            if entry is not None and entry.incarnation == incarnation and entry.endpoint:
                self._disconnected[name] = incarnation
                # info, not a warning: every actor disconnects when it exits normally
                log.info("registry: %s (incarnation %d) disconnected; lookups skip it",
                         name, incarnation)

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.liveness_timeout_s / 4)))
            now = time.monotonic()
            for name, entry in list(self.entries.items()):
                age = now - self.last_seen.get(name, now)
                if (entry.endpoint and age > self.liveness_timeout_s and name not in self._silent
                        and self._disconnected.get(name) != entry.incarnation):
                    self._silent.add(name)
                    log.warning("registry: %s (incarnation %d) sent no heartbeat for %.1fs "
                                "(liveness timeout %.1fs)", name, entry.incarnation, age,
                                self.liveness_timeout_s)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def on_register(self, msg: Register) -> Ok:
        prior = self.entries.get(msg.name)
        live = self._info(msg.name)
        if (prior is not None and prior.incarnation > msg.incarnation and live.alive
                and not live.disconnected):
            raise ActorError(f"register {msg.name!r}: incarnation {msg.incarnation} is older than "
                             f"the live one ({prior.incarnation})")
        self.entries[msg.name] = ActorInfo(name=msg.name, endpoint=msg.endpoint, alive=True,
                                           incarnation=msg.incarnation, pid=msg.pid,
                                           node_rank=msg.node_rank)
        self.last_seen[msg.name] = time.monotonic()
        self._silent.discard(msg.name)
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
            entry.loop_lag_ms = msg.loop_lag_ms
            if msg.name in self._silent:
                self._silent.discard(msg.name)
                log.warning("registry: %s (incarnation %d) heart-beats again", msg.name,
                            msg.incarnation)

    async def on_lookup(self, msg: Lookup) -> ActorInfo:
        deadline = time.monotonic() + msg.wait_s
        async with self._changed:
            while True:
                info = self._info(msg.name)
                left = deadline - time.monotonic()
                if (info.alive and not info.disconnected) or left <= 0:
                    return info
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return self._info(msg.name)

    async def on_list_actors(self, msg: ListActors) -> ActorList:
        return ActorList(actors=[self._info(n) for n in sorted(self.entries)])
