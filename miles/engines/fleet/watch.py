"""The fleet's supervision: every `engine.health_interval_s` it probes the engines, smg and the
session server, and restarts what died (the design decisions are in `miles/engines/fleet/__init__.py`)."""

from __future__ import annotations

import asyncio
import logging
import time

from miles.engines.fleet.nodes import FleetError, NodeEngineDown, NodeEngineUp
from miles.engines.fleet.slots import CrashLoop, EngineSlot

log = logging.getLogger("miles.engines.fleet")


class FleetWatch:
    """The `EngineFleet`'s part that watches its processes and restarts them."""

    def _quick(self, ready_at: float) -> bool:  # smg and the session server's crash-loop rule
        return time.monotonic() - ready_at < self.recipe.engine.restart_window_s

    async def _watch(self) -> None:
        cfg = self.recipe.engine
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            if self._stopped.is_set():  # shutting down: what dies now is not to be restarted
                return
            if self.gateway is not None and not self.gateway.process.alive:
                await self._restart_gateway()
            if self.session is not None and not await self._session_healthy():
                await self._restart_session()
            if self._fatal.done():
                return
            for slot in self.slots:
                if (slot.engine is not None and not slot.engine.process.alive
                        and not slot.restarting and slot.node < 0):
                    await self._engine_died(slot)
            if self.is_head:
                self._check_any_engine_up()

    def _check_any_engine_up(self) -> None:
        """With no engine up (serving or pending) for `engine.no_engine_timeout_s`, end the fleet
        with one line: the last cause and how many restarts were tried."""
        cfg, now = self.recipe.engine, time.monotonic()
        if any(s.engine is not None for s in self.slots):
            self._none_since = None
            return
        self._none_since = self._none_since or now
        if now - self._none_since < cfg.no_engine_timeout_s:
            return
        causes = "; ".join(f"engine {s.index}: {s.last_error or 'gone'}" for s in self.slots)
        self._fail(FleetError(
            f"no engine up for {now - self._none_since:.0f} s (engine.no_engine_timeout_s = "
            f"{cfg.no_engine_timeout_s}) after {self.restarts} restarts (engine.max_restarts = "
            f"{cfg.max_restarts} per engine.restart_window_s = {cfg.restart_window_s} s); last "
            f"causes: {causes} (logs in {self.logdir})"))

    async def _engine_died(self, slot: EngineSlot) -> None:
        engine, was_serving = slot.engine, slot.pending_since < 0
        slot.engine, slot.pending_since = None, -1
        slot.last_error = f"{engine.url} died with code {engine.process.returncode}"
        log.warning("engine %d (%s) died with code %s; %d of %d engines serve meanwhile; last "
                    "lines of its log:\n%s", slot.index, engine.url, engine.process.returncode,
                    len(self._serving_urls()), len(self.slots), engine.process.log_tail(10))
        slot.restarting = True
        await self._leave_gateway(engine.url, was_serving)
        self._report(NodeEngineDown(node=self.node_rank, index=slot.index, url=engine.url,
                                    exit_code=engine.process.returncode))
        self._spawn(self._relaunch(slot))

    async def _relaunch(self, slot: EngineSlot) -> None:
        """Start the slot's engine again until one is up: every try (a failed start, a death
        before /health, included) is a restart of the budget, never fatal; a full window waits."""
        cfg = self.recipe.engine
        try:
            while not self._stopped.is_set():
                delay = slot.budget.delay_s()
                if slot.budget.exhausted():
                    log.error("engine %d: %d restarts within engine.restart_window_s = %s s "
                              "(engine.max_restarts = %d); next try in %.1f s, %d of %d engines "
                              "serve meanwhile", slot.index, slot.budget.recent(),
                              cfg.restart_window_s, cfg.max_restarts, delay,
                              len(self._serving_urls()), len(self.slots))
                await asyncio.sleep(delay)
                slot.budget.record()
                self.restarts += 1
                try:
                    fresh = await self._launch_engine(slot.index)
                except Exception as e:  # noqa: BLE001 - a failed start: one more restart
                    slot.last_error = str(e).splitlines()[0]
                    # a restart, not the end: said as such, with the fleet's state (the error
                    # names the command and its log's last lines)
                    log.warning("engine %d failed its restart %d; trying again; %d of %d engines "
                                "serve meanwhile: %s", slot.index, self.restarts,
                                len(self._serving_urls()), len(self.slots), e)
                    continue
                slot.engine, slot.ready_at = fresh, time.monotonic()
                if not self.is_head:  # the head's fleet makes it pending and publishes to it
                    self._report(NodeEngineUp(node=self.node_rank, index=slot.index, url=fresh.url))
                    return
                slot.pending_since = self._bump_generation()
                log.info("engine %d restarted at %s; waiting for the current weights (generation %d)",
                         slot.index, fresh.url, self.generation)
                return
        finally:
            slot.restarting = False

    async def _restart_gateway(self) -> None:
        fresh = await self._restart_on_port("the gateway", self.gateway, self._gateway_loop,
                                            lambda: self._launch_gateway(self._serving_urls()))
        if fresh is not None:
            self.gateway = fresh
            log.info("gateway restarted on %s with %d engine(s)", fresh.url,
                     len(self._serving_urls()))

    async def _session_healthy(self) -> bool:
        """Alive and answering `/health`; failed probes for `session_wedged_s` in a row (a wedged
        server) read as dead, and the process is stopped so the restart finds it gone."""
        if not self.session.process.alive:
            return False
        try:
            await self.session.health(timeout_s=max(1.0, min(5.0, self.recipe.engine.health_interval_s)))
            self._session_failing_since = None
            return True
        except Exception as e:  # noqa: BLE001 - any failure to answer is a failed probe
            now = time.monotonic()
            self._session_failing_since = self._session_failing_since or now
            if now - self._session_failing_since < self.session_wedged_s:
                return True
            log.warning("the session server (%s) failed every health probe for %.1f s (last: %s: "
                        "%s); stopping it for a restart", self.session.url,
                        now - self._session_failing_since, type(e).__name__, e)
            await self.session.stop_async(grace_s=2.0)
            return False

    async def _restart_session(self) -> None:
        self._session_failing_since = None
        fresh = await self._restart_on_port("the session server", self.session, self._session_loop,
                                            self._launch_session_server)
        if fresh is not None:
            self.session = fresh
            log.info("session server restarted on %s (its open sessions are lost)", fresh.url)

    async def _restart_on_port(self, what: str, old, crash: CrashLoop, launch):
        """Relaunch a dead server on its own port (every client's URL stays valid), under the
        crash-loop rule; returns the new handle, or None after failing the fleet."""
        cfg = self.recipe.engine
        log.warning("%s (%s) died with code %s; last lines of its log:\n%s", what, old.url,
                    old.process.returncode, old.process.log_tail(10))
        await old.stop_async(grace_s=1.0)  # whatever it left in its process group
        crash.quick_deaths = crash.quick_deaths + 1 if self._quick(crash.ready_at) else 1
        last = (f"it died {crash.quick_deaths} times, each within engine.restart_window_s = "
                f"{cfg.restart_window_s} of starting")
        while crash.quick_deaths <= cfg.max_restarts and not self._stopped.is_set():
            crash.restarts += 1
            try:
                fresh = await launch()
                crash.ready_at = time.monotonic()
                return fresh
            except Exception as e:  # noqa: BLE001 - counted as a death at start
                last = e
                crash.quick_deaths += 1
                log.error("%s could not be restarted on %s: %s", what, old.url, e)
                await asyncio.sleep(cfg.health_interval_s)  # a port in TIME_WAIT frees itself
        if not self._stopped.is_set():
            self._fail(FleetError(f"{what} could not be restarted on its port {old.url} "
                                  f"(engine.max_restarts = {cfg.max_restarts}): {last}"))
        return None
