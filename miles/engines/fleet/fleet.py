"""`EngineFleet`: the actor that launches a node's rollout engines, the smg gateway and the session
server, and keeps them up; its watch and metrics parts live beside it. The design decisions are in
`miles/engines/fleet/__init__.py`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from miles.config import RestartPolicy
from miles.engines.client import EngineClient, parse_weight_version
from miles.engines.embedded import launch_embedded_engine
from miles.engines.fleet.metrics import FleetMetrics
from miles.engines.fleet.nodes import FleetError, NodeEngines, NodeFleet
from miles.engines.fleet.slots import SESSION_WEDGED_S, CrashLoop, EngineSlot
from miles.engines.fleet.watch import FleetWatch
from miles.engines.gateway import GatewayConfig, launch_gateway
from miles.engines.procs import free_port
from miles.engines.session_server import (SessionServerConfig, launch_session_server,
                                          write_token_file)
from miles.engines.sglang import launch_sglang, recipe_server_args
from miles.runtime import Actor
from miles.supervise import RestartBudget
from miles.wire.messages import EngineSet, EnginesUpdated, GetEngines, Ok

log = logging.getLogger("miles.engines.fleet")
ROUTING_KEY_POLICIES = ("manual", "consistent_hashing")  # smg policies that pin X-SMG-Routing-Key


class EngineFleet(FleetWatch, FleetMetrics, NodeFleet, Actor):
    def __init__(self, name: str = "engines"):
        super().__init__(name)
        self.slots: list[EngineSlot] = []
        self.gateway = None
        self.session = None  # the TITO session server's handle (None: off)
        self.restarts = 0
        self.version = 0
        self.generation = 0
        self._gateway_loop = CrashLoop()
        self._session_loop = CrashLoop()
        self.session_wedged_s = SESSION_WEDGED_S
        self._session_failing_since: float | None = None  # first failed probe of the current run
        self._polled: dict[str, float] = {}
        self._previous: dict | None = None  # the state the incarnation before this one saved
        self._none_since: float | None = None  # since when no engine is up

    @property
    def gateway_restarts(self) -> int:
        return self._gateway_loop.restarts

    @property
    def session_restarts(self) -> int:
        return self._session_loop.restarts

    @property
    def session_enabled(self) -> bool:
        mode = self.recipe.session.enabled
        return mode == "on" or (mode == "auto" and bool(self.recipe.rollout.agent))

    @property
    def engines(self) -> list:
        return [s.engine for s in self.slots]

    @property
    def role(self) -> str:
        return self.name.split("@")[0]

    @property
    def fleet_nodes(self) -> list[int]:
        """The nodes this fleet spans; [] for a one-node fleet."""
        spec = self.spec
        return list(spec.nodes) if spec is not None and spec.per_node and spec.nodes else []

    @property
    def is_head(self) -> bool:
        """This fleet owns the gateway (a one-node fleet, or the first node's of several)."""
        return "@" not in self.name

    async def on_start(self) -> None:
        if "/" in self.name:
            raise FleetError(f"{self.name}: an engine fleet on several nodes needs "
                             f"[actors.{self.role.split('/')[0]}] per_node = true (one fleet per "
                             f"node), not one process group")
        loop = asyncio.get_running_loop()
        self.node_rank = int(os.environ.get("MILES_NODE_RANK", "0"))
        self._node_joined = {n: loop.create_future() for n in self.fleet_nodes[1:]}
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

    async def _launch(self) -> None:
        cfg = self.recipe.engine
        self.logdir = Path(self.recipe.output_dir) / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._previous = self._load_state() if self.incarnation > 0 else None
        if self._previous is not None:
            self.version = int(self._previous.get("version", 0))
            self.generation = int(self._previous.get("generation", 0)) + 1
            log.warning("%s: incarnation %d restarts the fleet its predecessor ran (version %d): "
                        "new engines wait for the current weights (generation %d)", self.name,
                        self.incarnation, self.version, self.generation)
        self.slots = [EngineSlot(i, budget=self._engine_budget()) for i in range(cfg.num_engines)]
        results = await asyncio.gather(*(self._first_start(s) for s in self.slots),
                                       return_exceptions=True)
        started = [r for r in results if not isinstance(r, BaseException)]
        if not started:
            self._fail(FleetError("; ".join(
                f"engine {i} did not start after {s.budget.total + 1} tries (engine.max_restarts "
                f"= {cfg.max_restarts}): {r}" for i, (s, r) in enumerate(zip(self.slots, results)))))
            return
        now = time.monotonic()
        late = []
        for slot, engine in zip(self.slots, results):
            if isinstance(engine, BaseException):
                late.append(slot)
                slot.last_error = str(engine).splitlines()[0]
                log.error("engine %d did not start after %d tries; the fleet starts with %d of "
                          "%d engines and keeps trying it: %s", slot.index, slot.budget.total + 1,
                          len(started), len(self.slots), slot.last_error)
                continue
            slot.engine, slot.ready_at = engine, now
            if self._previous is not None:  # initial weights: they wait for the current version
                slot.pending_since = self.generation
        if not self.is_head:  # another node's fleet: its engines join the head's gateway
            try:
                await self.runtime.ref(self.role).call(
                    NodeEngines(node=self.node_rank,
                                urls=[s.engine.url if s.engine is not None else "" for s in self.slots]),
                    timeout_s=cfg.start_timeout_s)
            except Exception as e:  # noqa: BLE001 - unannounced engines would serve nobody
                await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in started), return_exceptions=True)
                self._fail(FleetError(f"{self.name} could not announce its engines to {self.role} "
                                      f"within engine.start_timeout_s = {cfg.start_timeout_s}: {e}"))
                return
            self._ready.set_result(None)
            self._relaunch_late(late)
            self._spawn(self._watch())
            return
        try:
            await self._wait_for_nodes()
        except FleetError as e:
            await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in started), return_exceptions=True)
            self._fail(e)
            return
        previous = self._previous or {}
        self._gateway_ports = tuple(previous.get("gateway_ports") or (free_port(), free_port()))
        try:
            self.gateway = await self._start_on_port("the gateway (smg)", lambda: self._launch_gateway(
                self._serving_urls()))
        except Exception as e:  # noqa: BLE001 - every start failure ends the fleet, named
            await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in started), return_exceptions=True)
            self._fail(FleetError(f"the gateway (smg) did not start: {e}"))
            return
        now = time.monotonic()
        for slot in self.slots:  # the other nodes' engines have served since they joined
            slot.ready_at = slot.ready_at or now
        self._gateway_loop.ready_at = time.monotonic()
        if self.session_enabled:
            try:
                self.session = await self._start_on_port("the session server",
                                                         self._launch_session_server)
            except Exception as e:  # noqa: BLE001 - a start failure ends the fleet, named
                await self.gateway.stop_async(grace_s=2.0)
                await asyncio.gather(*(r.stop_async(grace_s=3.0) for r in started),
                                     return_exceptions=True)
                self._fail(FleetError(f"the session server did not start: {e}"))
                return
            self._session_loop.ready_at = time.monotonic()
        self._save_state()
        self._ready.set_result(None)
        self._relaunch_late(late)
        self._spawn(self._watch())
        self._spawn(self._poll_metrics())

    def _engine_budget(self) -> RestartBudget:
        cfg = self.recipe.engine
        policy = self.spec.restart if self.spec is not None else RestartPolicy()
        return RestartBudget(cfg.max_restarts, cfg.restart_window_s, policy.backoff_s,
                             policy.backoff_max_s)

    async def _first_start(self, slot: EngineSlot):
        """An engine's first start, tried 1 + `engine.max_restarts` times with backoff; raises
        the last failure."""
        while True:
            try:
                return await self._launch_engine(slot.index)
            except Exception as e:  # noqa: BLE001 - a failed start is retried under the budget
                if slot.budget.exhausted() or self._stopped.is_set():
                    raise
                delay = slot.budget.delay_s()
                log.warning("engine %d did not start (%s); try %d of %d in %.1f s", slot.index,
                            str(e).splitlines()[0], slot.budget.total + 2,
                            self.recipe.engine.max_restarts + 1, delay)
                await asyncio.sleep(delay)
                slot.budget.record()
                self.restarts += 1

    def _relaunch_late(self, slots: list[EngineSlot]) -> None:
        for slot in slots:  # engines that did not start: tried again under the window's budget
            slot.restarting = True
            self._spawn(self._relaunch(slot))

    async def _start_on_port(self, what: str, launch):
        """smg or the session server at the fleet's start; a restarted fleet binds its
        predecessor's port, which may need a moment to free (1 + engine.max_restarts tries)."""
        cfg = self.recipe.engine
        tries = cfg.max_restarts + 1 if self._previous is not None else 1
        for attempt in range(tries):
            try:
                return await launch()
            except Exception as e:  # noqa: BLE001 - retried, then raised
                if attempt == tries - 1:
                    raise
                log.warning("%s did not start on its port (%s); trying again", what,
                            str(e).splitlines()[0])
                await asyncio.sleep(cfg.health_interval_s)

    @property
    def state_path(self) -> Path:
        return Path(self.recipe.output_dir) / "engines" / f"{self.name.replace('/', '_')}.json"

    def _load_state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError) as e:
            log.warning("%s: no state of the incarnation before (%s): starting afresh", self.name, e)
            return None

    def _save_state(self) -> None:
        """Ports, generation and version, for the next incarnation (written whole, then renamed)."""
        state = {"gateway_ports": list(getattr(self, "_gateway_ports", ()) or ()),
                 "session_port": self._session_config.port if self.session is not None else 0,
                 "generation": self.generation, "version": self.version}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def _bump_generation(self) -> int:
        """A set that needs a publish; saved at once, so a restarted fleet's generation is past it."""
        self.generation += 1
        self._save_state()
        return self.generation

    async def _launch_gateway(self, urls: list[str]):
        port, prometheus_port = self._gateway_ports
        return await launch_gateway(
            GatewayConfig(port=port, prometheus_port=prometheus_port, policy=self._gateway_policy()),
            urls, timeout_s=self.recipe.engine.start_timeout_s,
            log_path=self.logdir / "gateway.log")

    def _gateway_policy(self) -> str:
        policy = self.recipe.engine.gateway_policy
        if self.session_enabled and policy not in ROUTING_KEY_POLICIES:
            log.warning("engine.gateway_policy = %r ignores the session routing key; the session "
                        "server is on, so the gateway uses 'manual' (one engine per session, "
                        "its KV prefix reused)", policy)
            return "manual"
        return policy

    @property
    def session_token_file(self) -> Path:
        return Path(self.recipe.output_dir) / "session.token"

    async def _launch_session_server(self):
        if self.session is None:  # the first start; a restart keeps the port and the token
            s, previous = self.recipe.session, self._previous or {}
            # a restarted fleet: its predecessor's port and token (every client holds them)
            keep = bool(previous.get("session_port")) and self.session_token_file.exists()
            token = self.session_token_file if keep else write_token_file(self.session_token_file)
            self._session_config = SessionServerConfig(
                engine_url=self.gateway.url, model_path=str(self.recipe.model.path),
                port=previous["session_port"] if keep else free_port(), token_file=str(token),
                family=s.family, max_context_tokens=s.max_context_tokens,
                session_ttl_s=s.session_ttl_s, message_matcher=s.message_matcher,
                max_body_bytes=s.max_body_bytes)
        return await launch_session_server(self._session_config,
                                           self.logdir / "session_server.log",
                                           timeout_s=self.recipe.engine.start_timeout_s)

    async def _launch_engine(self, index: int):
        cfg, model_path = self.recipe.engine, self.recipe.model.path
        log_path = self.logdir / (f"engine{index}.log" if not self.fleet_nodes
                                  else f"engine{index}.node{self.node_rank}.log")
        if cfg.kind == "sglang":
            args = recipe_server_args(self.recipe, index, free_port())
            if self.fleet_nodes:  # reached from other nodes: this node's address, not loopback
                args.host = self._engine_host
            return await launch_sglang(args, timeout_s=cfg.start_timeout_s, log_path=log_path)
        extra = ["--device", cfg.device, "--dtype", cfg.dtype,
                 "--max-running-requests", str(cfg.max_running_requests),
                 "--context-length", str(cfg.context_length),
                 "--torch-threads", str(cfg.torch_threads),
                 "--random-seed", str(self.recipe.run.seed + index), *cfg.extra_args]
        if self.recipe.quant.format and "--quantization" not in extra:  # miles/quant: quantized updates
            extra += ["--quantization", self.recipe.quant.format]
        if cfg.tp_size > 1 and "--tp-size" not in extra:  # TP ranks of its own (p2p weights)
            extra += ["--tp-size", str(cfg.tp_size)]
        if self.recipe.rollout.return_routed_experts and "--enable-return-routed-experts" not in extra:
            extra.append("--enable-return-routed-experts")
        host = {"host": self._engine_host} if self.fleet_nodes else {}
        return await launch_embedded_engine(model_path, extra_args=extra, log_path=log_path,
                                            ready_timeout_s=cfg.start_timeout_s, **host)

    @property
    def _engine_host(self) -> str:
        return os.environ.get("MILES_HOST", "127.0.0.1")

    def _serving_urls(self) -> list[str]:
        return [s.engine.url for s in self.slots
                if s.engine is not None and s.pending_since < 0 and s.engine.process.alive]

    async def on_get_engines(self, msg: GetEngines) -> EngineSet:
        if not self.is_head:  # the head's fleet answers for every node
            return await self.runtime.ref(self.role).call(msg, timeout_s=self.recipe.engine.start_timeout_s)
        await asyncio.shield(self._ready)
        return EngineSet(gateway_url=self.gateway.url, model_path=self.recipe.model.path,
                         session_url=self.session.url if self.session is not None else "",
                         session_token_file=(str(self.session_token_file)
                                             if self.session is not None else ""),
                         engine_urls=self._serving_urls(),
                         pending_urls=[s.engine.url for s in self.slots
                                       if s.engine is not None and s.pending_since >= 0],
                         version=self.version, generation=self.generation)

    async def on_engines_updated(self, msg: EnginesUpdated) -> Ok:
        """The driver published `msg.version` to the set of `msg.generation`: pending engines of
        that set (or older) hold the weights now and may take traffic."""
        if msg.version > self.version:
            self.version = msg.version
            self._save_state()
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
        try:
            async with EngineClient(url, timeout_s=10.0, max_retries=0) as client:
                version = str((await client.model_info()).get("weight_version", ""))
            return parse_weight_version(version)
        except Exception as e:  # noqa: BLE001 - any doubt: it does not take traffic
            return f"unknown ({type(e).__name__}: {e})"

    async def on_stop(self) -> None:
        self.stop()  # the watcher must not restart what is being stopped now
        self.slots = [s for s in self.slots if s.node < 0]  # other nodes' fleets stop their own
        if self.session is not None:  # first: it sends to the gateway
            await self.session.stop_async(grace_s=2.0)
        if self.gateway is not None:
            await self.gateway.stop_async(grace_s=2.0)
        await asyncio.gather(*(e.stop_async(grace_s=3.0) for e in self.engines if e is not None),
                             return_exceptions=True)
