"""EngineFleet: launches the rollout engines and the smg gateway in front of them, and keeps them up.

Design decisions:
- One actor owns the fleet of a node: N engines (embedded or real SGLang, `engine.kind`) and the
  gateway. Everyone else asks it `GetEngines` for the gateway URL (generation) and the engine
  URLs (control: pause, weight updates go to each engine directly).
- An engine that does not start is retried, at job start too: each engine gets 1 +
  `engine.max_restarts` tries (backoff between them, `miles.supervise.RestartBudget`). The fleet
  serves once one engine of its node is up; the others keep being tried in the background and
  join as pending. Only when no engine came up after its tries (a bad model path, a wrong flag)
  is the start the fleet's end: every `GetEngines` waiter gets that error at once (it names the
  process, its command and its log's last lines), the error is logged once to the console, and
  `run()` returns 1 so the host process exits non-zero and the node daemon ends the job. smg or
  the session server that does not start ends the fleet the same way.
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
- Engine restarts (a death before `/health` is one more failed start: a restart, never fatal)
  are rate-limited, never given up: at most `engine.max_restarts` within any
  `engine.restart_window_s`, the n-th of a window after `backoff_s * 2**n` (the fleet role's
  `[actors.engines] restart.backoff_s` / `backoff_max_s`); with the window full the next try
  waits until the oldest restart ages out. Meanwhile the fleet runs degraded and logs how many
  engines serve. When no engine is up (serving or pending) for `engine.no_engine_timeout_s`,
  the fleet ends the job with one line: the last cause and how many restarts were tried.
- The fleet actor itself is restarted by the node daemon (a new incarnation; callers' retries
  reach it). Its engine servers die with it (PDEATHSIG), so the new incarnation does not adopt
  them: it reads `<output_dir>/engines/<name>.json` (the gateway's and session server's ports,
  the generation and the version, written on every change), starts smg and the session server
  on the same ports (every client's URL stays valid; the session token file is kept) and new
  engines as pending under a generation past every earlier one, so the driver publishes the
  current weights to them. Only an incarnation > 0 reads that file (a new job starts afresh).
- The gateway is restarted on its own port (every client's gateway URL stays valid) in front of
  the serving engines, under the same crash-loop rule. If it cannot come back (the port cannot be
  re-bound, smg crash-loops) the fleet fails loudly.
- The engines' logs go to files in the run directory (they are chatty); failures quote their tail.
- The TITO session server (`[session]`, on when `session.enabled = "on"`, or "auto" with
  `rollout.agent` set) starts after the gateway, in front of it, on its own port, with a per-job
  token in `<output_dir>/session.token` (0600; only the path is on its command line). `GetEngines`
  carries its URL and the token file. It is probed every health interval (`/health`; failing
  every probe for `SESSION_WEDGED_S` counts as a death) and restarted on its own port under the
  same crash-loop rule as the gateway; if it cannot come back the fleet fails loudly. A restarted server has lost its
  open sessions (the rollout side sees 404 on collect and counts a failed episode).
- With the session server on, smg must pin a session's routing key (`X-SMG-Routing-Key`) to one
  engine so its KV prefix is reused: the `manual` policy (a new key goes to the least loaded
  engine) and `consistent_hashing` do; any other `engine.gateway_policy` is replaced by `manual`,
  with a warning. smg's `--routing-key-override` must stay off: it makes the body `rid` win over
  the header, and TITO's rids differ per turn.
- Fleet metrics (prefix-cache hit rate of the engines, open sessions, requests served per engine
  and per node) are polled once per health interval by a task of their own; `metrics()` returns
  the last values and never waits on HTTP.
- Several nodes (`[actors.engines] nodes = [..]`, `per_node = true`): one fleet per node; the first
  node's owns the gateway and the session server and lists every node's engines, the others only
  launch, supervise and report theirs (`miles/actors/engine_nodes.py` has the protocol).
  `engine.num_engines` is per node. A one-node fleet runs none of that code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from miles.runtime import Actor
from miles.actors.engine_nodes import FleetError, NodeEngineDown, NodeEngines, NodeEngineUp, NodeFleet
from miles.config import RestartPolicy
from miles.supervise import RestartBudget
from miles.wire.messages import EngineSet, EnginesUpdated, GetEngines, Ok

log = logging.getLogger(__name__)
ROUTING_KEY_POLICIES = ("manual", "consistent_hashing")  # smg policies that pin X-SMG-Routing-Key
# A session server that failed every /health probe for this long is wedged and restarted. Long on
# purpose: a restart loses every open session, and a huge render can hold its loop for seconds.
SESSION_WEDGED_S = 30.0


@dataclass
class _Slot:
    """One engine position: the running engine (None while down) and its restart budget."""
    index: int
    engine: object | None = None
    ready_at: float = 0.0
    budget: RestartBudget | None = None
    last_error: str = ""     # why it is down (its last death or failed start), first line
    gave_up: bool = False    # another node's engine that will not come back
    restarting: bool = False
    pending_since: int = -1  # generation at which it became pending (-1: serving or down)
    node: int = -1           # the node whose fleet launched it, on the head (-1: this fleet)
    remote_index: int = -1   # its index in that node's fleet


@dataclass
class _CrashLoop:
    """A server restarted on its own port (the gateway, the session server): its crash-loop count."""
    ready_at: float = 0.0
    quick_deaths: int = 0
    restarts: int = 0


class EngineFleet(NodeFleet, Actor):
    def __init__(self, name: str = "engines"):
        super().__init__(name)
        self.slots: list[_Slot] = []
        self.gateway = None
        self.session = None  # the TITO session server's handle (None: off)
        self.restarts = 0
        self.version = 0
        self.generation = 0
        self._gateway_loop = _CrashLoop()
        self._session_loop = _CrashLoop()
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

    # ---- start ---------------------------------------------------------------------------------

    async def _launch(self) -> None:
        from miles.engines.procs import free_port

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
        self.slots = [_Slot(i, budget=self._engine_budget()) for i in range(cfg.num_engines)]
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

    async def _first_start(self, slot: _Slot):
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

    def _relaunch_late(self, slots: list[_Slot]) -> None:
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

    # ---- the state a restarted fleet starts from ------------------------------------------------

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
        from miles.engines.gateway import GatewayConfig, launch_gateway

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
        from miles.engines.procs import free_port
        from miles.engines.session_server import (SessionServerConfig, launch_session_server,
                                                  write_token_file)

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
            from miles.engines.procs import free_port
            from miles.engines.sglang import launch_sglang, recipe_server_args
            args = recipe_server_args(self.recipe, index, free_port())
            if self.fleet_nodes:  # reached from other nodes: this node's address, not loopback
                args.host = self._engine_host
            return await launch_sglang(args, timeout_s=cfg.start_timeout_s, log_path=log_path)
        from miles.engines.embedded import launch_embedded_engine
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

    # ---- supervision ---------------------------------------------------------------------------

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

    async def _engine_died(self, slot: _Slot) -> None:
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

    async def _relaunch(self, slot: _Slot) -> None:
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
                    log.error("engine %d could not be restarted: %s", slot.index, e)
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

    async def _restart_on_port(self, what: str, old, crash: _CrashLoop, launch):
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

    def _serving_urls(self) -> list[str]:
        return [s.engine.url for s in self.slots
                if s.engine is not None and s.pending_since < 0 and s.engine.process.alive]

    # ---- handlers ------------------------------------------------------------------------------

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
        from miles.engines.client import EngineClient, parse_weight_version

        try:
            async with EngineClient(url, timeout_s=10.0, max_retries=0) as client:
                version = str((await client.model_info()).get("weight_version", ""))
            return parse_weight_version(version)
        except Exception as e:  # noqa: BLE001 - any doubt: it does not take traffic
            return f"unknown ({type(e).__name__}: {e})"

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

    async def on_stop(self) -> None:
        self.stop()  # the watcher must not restart what is being stopped now
        self.slots = [s for s in self.slots if s.node < 0]  # other nodes' fleets stop their own
        if self.session is not None:  # first: it sends to the gateway
            await self.session.stop_async(grace_s=2.0)
        if self.gateway is not None:
            await self.gateway.stop_async(grace_s=2.0)
        await asyncio.gather(*(e.stop_async(grace_s=3.0) for e in self.engines if e is not None),
                             return_exceptions=True)
