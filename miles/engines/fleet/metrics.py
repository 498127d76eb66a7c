"""The fleet's metrics: the engines' prefix-cache hit rate and load, the session server's open
sessions (polled once per health interval by a task of their own), and the fleet's counters."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger("miles.engines.fleet")


class FleetMetrics:
    """The `EngineFleet`'s part that polls and reports its metrics; `metrics()` never waits on HTTP."""

    async def _poll_metrics(self) -> None:
        """Every health interval: the engines' prefix-cache hit rate (`/server_info`
        `internal_states[0].cache_hit_rate`, where an engine reports it) and the session server's
        open sessions (`/stats`). Values that could not be read this round are left out."""
        interval = self.recipe.engine.health_interval_s
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, interval)))
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not self._stopped.is_set():
                polled: dict[str, float] = {}
                rates = [r for r in await asyncio.gather(*(
                    self._cache_hit_rate(http, s.engine.url) for s in self.slots
                    if s.engine is not None and s.engine.process.alive)) if r is not None]
                if rates:
                    polled["engine/prefix_cache_hit_rate"] = sum(rates) / len(rates)
                live = [(i, s.engine.url) for i, s in enumerate(self.slots)
                        if s.engine is not None and s.engine.process.alive]
                loads = await asyncio.gather(*(self._load(http, url) for _, url in live))
                polled.update({f"engine/{i}/requests": n for (i, _), n in zip(live, loads) if n is not None})
                if self.fleet_nodes:
                    await self._poll_served(http, polled)
                if self.gateway is not None:   # smg's own Prometheus endpoint, linked from ours
                    polled["engines/gateway_metrics_port"] = float(self._gateway_ports[1])
                if self.session is not None and self.session.process.alive:
                    try:
                        stats = await self.session.stats(timeout_s=timeout.total)
                        open_sessions = stats.get("open_sessions", stats.get("sessions"))
                        if isinstance(open_sessions, (int, float)):
                            polled["session/open_sessions"] = float(open_sessions)
                    except Exception as e:  # noqa: BLE001 - a metric, not a health check
                        log.debug("session server stats unavailable: %s", e)
                self._polled = polled
                await asyncio.sleep(interval)

    @staticmethod
    async def _load(http: aiohttp.ClientSession, url: str) -> float | None:
        """Requests running + waiting on one engine (`/get_load`, SGLang's and ours: per DP rank)."""
        try:
            async with http.get(url + "/get_load") as resp:
                body = await resp.json() if resp.status == 200 else None
            ranks = body if isinstance(body, list) else [body or {}]
            return float(sum(r.get("num_reqs", 0) for r in ranks if isinstance(r, dict)))
        except Exception:  # noqa: BLE001 - an engine restarting
            return None

    @staticmethod
    async def _cache_hit_rate(http: aiohttp.ClientSession, url: str) -> float | None:
        try:
            async with http.get(url + "/server_info") as resp:
                info = await resp.json() if resp.status == 200 else {}
            rate = (info.get("internal_states") or [{}])[0].get("cache_hit_rate")
        except Exception:  # noqa: BLE001 - an engine restarting, or one without the field
            return None
        return float(rate) if isinstance(rate, (int, float)) else None

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["engines/alive"] = float(sum(1 for e in self.engines if e is not None and e.process.alive))
        out["engines/pending"] = float(sum(1 for s in self.slots if s.engine is not None
                                           and s.pending_since >= 0))
        out["engines/restarts"] = float(self.restarts)
        out["engines/gateway_restarts"] = float(self.gateway_restarts)
        out["engines/generation"] = float(self.generation)
        out["engine/restarts"] = float(self.restarts)
        if self.session is not None:
            out["session/restarts"] = float(self.session_restarts)
        out.update(self._polled)
        return out
