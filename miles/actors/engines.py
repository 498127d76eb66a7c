"""EngineFleet: launches the rollout engines and the smg gateway in front of them, and keeps them up.

Design decisions:
- One actor owns the fleet of a node: N engines (embedded or real SGLang, `engine.kind`) and the
  gateway. Everyone else asks it `GetEngines` for the gateway URL (generation) and the engine
  URLs (control: pause, weight updates go to each engine directly).
- Start failures are the fleet's end: the launch task is kept, and when an engine or smg does not
  come up every `GetEngines` waiter gets that error at once (it names the process, its command
  and its log's last lines), the error is logged once to the console, and `run()` returns 1 so
  the host process exits non-zero and the node daemon ends the job. Nobody waits out a timeout.
- Engines and the gateway are health-checked every `engine.health_interval_s`. A dead engine is
  removed from the gateway at once (its requests fail fast, new ones go to the others) and
  relaunched on a fresh port. The restarted engine is listed in `EngineSet.pending_urls`: it has
  the model's initial weights, so it takes no traffic until the driver has published the current
  version to it and says `EnginesUpdated`; only then, and only if it reports that version (else
  it is restarted), is it added to the gateway.
- `generation` is bumped when an engine joins (becomes pending), because that is what needs a
  publish. A death does not bump it: the trainer drops an engine that does not answer, the next
  `GetEngines` leaves it out, and an empty set must not read as "publish now". Moving an engine
  from pending to serving does not bump it either (nothing to publish).
- `engine.max_restarts` bounds crash loops, not a long run's total: a death within
  `engine.restart_window_s` of the engine becoming ready (or a failed relaunch) counts, a death
  after a longer life starts the count again. An engine over the budget stays out and the fleet
  runs smaller; when no engine is left the fleet fails like a start failure.
- The gateway is restarted on its own port (every client's gateway URL stays valid) in front of
  the serving engines, under the same crash-loop rule. If it cannot come back (the port cannot be
  re-bound, smg crash-loops) the fleet fails loudly.
- The engines' logs go to files in the run directory (they are chatty); failures quote their tail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from miles.actors.base import Actor
from miles.wire.messages import EngineSet, EnginesUpdated, GetEngines, Ok

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """The fleet cannot serve: an engine or the gateway did not start, or every engine gave up."""


@dataclass
class _Slot:
    """One engine position: the running engine (None while down) and its crash-loop count."""
    index: int
    engine: object | None = None
    ready_at: float = 0.0
    quick_deaths: int = 0
    gave_up: bool = False
    restarting: bool = False
    pending_since: int = -1  # generation at which it became pending (-1: serving or down)


class EngineFleet(Actor):
    def __init__(self, name: str = "engines"):
        super().__init__(name)
        self.slots: list[_Slot] = []
        self.gateway = None
        self.restarts = 0
        self.gateway_restarts = 0
        self.version = 0
        self.generation = 0
        self._gateway_quick_deaths = 0
        self._gateway_ready_at = 0.0

    @property
    def engines(self) -> list:
        return [s.engine for s in self.slots]

    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future = loop.create_future()
        self._fatal: asyncio.Future = loop.create_future()
        self._launch_task = self._spawn(self._launch())

    async def run(self) -> int:
        stopped = asyncio.ensure_future(self.serve_forever())
        done, _ = await asyncio.wait({stopped, self._fatal}, return_when=asyncio.FIRST_COMPLETED)
        if self._fatal not in done:
            return 0
        stopped.cancel()
        error = self._fatal.result()
        log.error("%s: %s", self.name, error)
        # The host's one-line form, which the node daemon quotes as the cause when it gives up.
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
        await asyncio.sleep(0.5)  # the error replies to GetEngines waiters go out first
        return 1

    def _fail(self, error: Exception) -> None:
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved: waiters that come later still get it
        if not self._fatal.done():
            self._fatal.set_result(error)

    # ---- start ---------------------------------------------------------------------------------

    async def _launch(self) -> None:
        from miles.engines.procs import free_port

        cfg = self.recipe.engine
        self.logdir = Path(self.recipe.output_dir) / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.slots = [_Slot(i) for i in range(cfg.num_engines)]
        results = await asyncio.gather(*(self._launch_engine(i) for i in range(cfg.num_engines)),
                                       return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in results
                                   if not isinstance(r, BaseException)), return_exceptions=True)
            self._fail(FleetError("; ".join(f"engine {i} did not start: {e}" for i, e in failed)))
            return
        now = time.monotonic()
        for slot, engine in zip(self.slots, results):
            slot.engine, slot.ready_at = engine, now
        self._gateway_ports = (free_port(), free_port())
        try:
            self.gateway = await self._launch_gateway([e.url for e in results])
        except Exception as e:  # noqa: BLE001 - every start failure ends the fleet, named
            await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in results), return_exceptions=True)
            self._fail(FleetError(f"the gateway (smg) did not start: {e}"))
            return
        self._gateway_ready_at = time.monotonic()
        self._ready.set_result(None)
        self._spawn(self._watch())

    async def _launch_gateway(self, urls: list[str]):
        from miles.engines.gateway import GatewayConfig, launch_gateway

        port, prometheus_port = self._gateway_ports
        return await launch_gateway(
            GatewayConfig(port=port, prometheus_port=prometheus_port,
                          policy=self.recipe.engine.gateway_policy),
            urls, timeout_s=self.recipe.engine.start_timeout_s,
            log_path=self.logdir / "gateway.log")

    async def _launch_engine(self, index: int):
        cfg, model_path = self.recipe.engine, self.recipe.model.path
        log_path = self.logdir / f"engine{index}.log"
        if cfg.kind == "sglang":
            from miles.engines.procs import free_port
            from miles.engines.sglang import SGLangServerArgs, launch_sglang
            args = SGLangServerArgs(model_path=model_path, port=free_port(), extra_args=dict(cfg.sglang),
                                    enable_routed_experts=self.recipe.rollout.return_routed_experts)
            return await launch_sglang(args, timeout_s=cfg.start_timeout_s, log_path=log_path)
        from miles.engines.embedded import launch_embedded_engine
        extra = ["--device", cfg.device, "--dtype", cfg.dtype,
                 "--max-running-requests", str(cfg.max_running_requests),
                 "--context-length", str(cfg.context_length),
                 "--torch-threads", str(cfg.torch_threads),
                 "--random-seed", str(self.recipe.run.seed + index), *cfg.extra_args]
        return await launch_embedded_engine(model_path, extra_args=extra, log_path=log_path,
                                            ready_timeout_s=cfg.start_timeout_s)

    # ---- supervision ---------------------------------------------------------------------------

    def _quick(self, ready_at: float) -> bool:
        return time.monotonic() - ready_at < self.recipe.engine.restart_window_s

    async def _watch(self) -> None:
        cfg = self.recipe.engine
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            if self._stopped.is_set():  # shutting down: what dies now is not to be restarted
                return
            if not self.gateway.process.alive:
                await self._restart_gateway()
            for slot in self.slots:
                if slot.engine is not None and not slot.engine.process.alive and not slot.restarting:
                    await self._engine_died(slot)
            if all(s.gave_up for s in self.slots):
                self._fail(FleetError(f"every engine gave up after engine.max_restarts = "
                                      f"{cfg.max_restarts} quick restarts (see {self.logdir})"))
                return

    async def _engine_died(self, slot: _Slot) -> None:
        engine, was_serving = slot.engine, slot.pending_since < 0
        log.warning("engine %d (%s) died with code %s; last lines of its log:\n%s", slot.index,
                    engine.url, engine.process.returncode, engine.process.log_tail(10))
        slot.engine, slot.pending_since = None, -1
        slot.quick_deaths = slot.quick_deaths + 1 if self._quick(slot.ready_at) else 1
        slot.restarting = True
        if was_serving and self.gateway.process.alive:
            try:
                await self.gateway.remove_worker(engine.url, timeout_s=10.0)
            except Exception as e:  # noqa: BLE001 - the gateway's health check drops it anyway
                log.warning("could not remove %s from the gateway: %s", engine.url, e)
        self._spawn(self._relaunch(slot))

    async def _relaunch(self, slot: _Slot) -> None:
        cfg = self.recipe.engine
        try:
            while slot.quick_deaths <= cfg.max_restarts and not self._stopped.is_set():
                self.restarts += 1
                try:
                    fresh = await self._launch_engine(slot.index)
                except Exception as e:  # noqa: BLE001 - counted as a death at start
                    slot.quick_deaths += 1
                    log.error("engine %d could not be restarted: %s", slot.index, e)
                    await asyncio.sleep(cfg.health_interval_s)
                    continue
                slot.engine, slot.ready_at = fresh, time.monotonic()
                self.generation += 1
                slot.pending_since = self.generation
                log.info("engine %d restarted at %s; waiting for the current weights (generation %d)",
                         slot.index, fresh.url, self.generation)
                return
            if self._stopped.is_set():
                return
            slot.gave_up = True
            log.error("engine %d gave up: it died %d times, each within engine.restart_window_s = "
                      "%s of starting (engine.max_restarts = %d); the fleet runs without it",
                      slot.index, slot.quick_deaths, cfg.restart_window_s, cfg.max_restarts)
        finally:
            slot.restarting = False

    async def _restart_gateway(self) -> None:
        cfg = self.recipe.engine
        old = self.gateway
        log.warning("the gateway (%s) died with code %s; last lines of its log:\n%s", old.url,
                    old.process.returncode, old.process.log_tail(10))
        await old.stop_async(grace_s=1.0)  # whatever it left in its process group
        self._gateway_quick_deaths = (self._gateway_quick_deaths + 1
                                      if self._quick(self._gateway_ready_at) else 1)
        last: Exception | None = None
        while self._gateway_quick_deaths <= cfg.max_restarts:
            self.gateway_restarts += 1
            try:
                self.gateway = await self._launch_gateway(self._serving_urls())
                self._gateway_ready_at = time.monotonic()
                log.info("gateway restarted on %s with %d engine(s)", self.gateway.url,
                         len(self._serving_urls()))
                return
            except Exception as e:  # noqa: BLE001
                last = e
                self._gateway_quick_deaths += 1
                log.error("the gateway could not be restarted on %s: %s", old.url, e)
                await asyncio.sleep(cfg.health_interval_s)  # a port in TIME_WAIT frees itself
        self._fail(FleetError(f"the gateway could not be restarted on its port {old.url} "
                              f"(engine.max_restarts = {cfg.max_restarts}): {last}"))

    def _serving_urls(self) -> list[str]:
        return [s.engine.url for s in self.slots
                if s.engine is not None and s.pending_since < 0 and s.engine.process.alive]

    # ---- handlers ------------------------------------------------------------------------------

    async def on_get_engines(self, msg: GetEngines) -> EngineSet:
        await asyncio.shield(self._ready)
        return EngineSet(gateway_url=self.gateway.url, model_path=self.recipe.model.path,
                         engine_urls=self._serving_urls(),
                         pending_urls=[s.engine.url for s in self.slots
                                       if s.engine is not None and s.pending_since >= 0],
                         version=self.version, generation=self.generation)

    async def on_engines_updated(self, msg: EnginesUpdated) -> Ok:
        """The driver published `msg.version` to the set of `msg.generation`: pending engines of
        that set (or older) hold the weights now and may take traffic."""
        self.version = max(self.version, msg.version)
        added = []
        for slot in self.slots:
            if slot.engine is None or not (0 <= slot.pending_since <= msg.generation):
                continue
            served = await self._served_version(slot.engine.url)
            if served != msg.version:
                # It missed the publish (the trainer dropped it as unreachable, or it refused):
                # restart it, so the crash-loop rule bounds an engine that never takes weights.
                log.warning("engine %d (%s) serves version %s, not %d, after the publish: "
                            "restarting it", slot.index, slot.engine.url, served, msg.version)
                await slot.engine.stop_async(grace_s=2.0)
                continue
            slot.pending_since = -1
            if self.gateway.process.alive:  # else the gateway's restart takes the serving set
                try:
                    await self.gateway.add_worker(slot.engine.url, timeout_s=30.0)
                except Exception as e:  # noqa: BLE001 - it may have died meanwhile: the watcher
                    log.warning("could not add %s to the gateway: %s", slot.engine.url, e)
            added.append(slot.engine.url)
        return Ok(detail=f"version {self.version}; serving now: {added}")

    async def _served_version(self, url: str) -> int | str:
        from miles.engines.client import EngineClient, parse_weight_version

        try:
            async with EngineClient(url, timeout_s=10.0, max_retries=0) as client:
                version = str((await client.model_info()).get("weight_version", ""))
            return parse_weight_version(version)
        except Exception as e:  # noqa: BLE001 - any doubt: it does not take traffic
            return f"unknown ({type(e).__name__}: {e})"

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["engines/alive"] = float(sum(1 for e in self.engines if e is not None and e.process.alive))
        out["engines/pending"] = float(sum(1 for s in self.slots if s.engine is not None
                                           and s.pending_since >= 0))
        out["engines/restarts"] = float(self.restarts)
        out["engines/gateway_restarts"] = float(self.gateway_restarts)
        out["engines/generation"] = float(self.generation)
        return out

    async def on_stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop_async(grace_s=2.0)
        await asyncio.gather(*(e.stop_async(grace_s=3.0) for e in self.engines if e is not None),
                             return_exceptions=True)
