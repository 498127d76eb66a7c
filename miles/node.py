"""The per-node daemon: `python -m miles.node recipe.toml` (what `miles run` and `launch/miles.sh` start).

Design decisions:
- Where am I: node rank, node count and head host come from Slurm (`SLURM_NODEID`,
  `SLURM_NNODES`, first host of `SLURM_JOB_NODELIST`), else torchrun-style variables (`NODE_RANK`,
  `NNODES`, `MASTER_ADDR`), else it is a one-node run. `MILES_HEAD_HOST` / `MILES_HOST` override.
  Slurm host lists are expanded by `scontrol show hostnames` where it is installed, else by
  `parse_nodelist` (every bracket group, zero padding kept).
- The head node (rank 0) hosts the registry in the daemon's own event loop. Every actor runs in
  a child process of its node's daemon (`miles.runtime.host`), so a crash, an OOM or a `kill -9`
  takes down one actor, never the daemon, and the actor can be restarted alone.
- Supervision: a child that exits non-zero (or by signal) is restarted with exponential backoff
  until `restart.max_restarts` restarts within `restart.window_s` are used up; each restart gets a new incarnation number so callers
  of the old one fail fast and `retries` reach the new one. A child that is alive but silent (no
  heartbeat for `cluster.liveness_timeout_s`) is killed and restarted the same way; the log line
  names it, its incarnation, the seconds since its last heartbeat and its log's last lines.
- No crash loops: an incarnation that dies early (before it registered, or by an error exit
  within `CRASH_LOOP_WINDOW_S` of its start) with the same exit code and last error line as the
  incarnation before it would fail the same way again, so it is not restarted. The first start
  gets one retry that way (a port taken a moment ago is not a code error); a bad import or an
  `on_start` that raises ends the run after two quick starts, within seconds.
- A non-main actor that is given up on (crash loop, or restart budget used up) ends the job:
  nothing else can finish without it, and waiting on it would hang every caller. Its node tells
  the head, which shuts every node down with exit code 1 and one message:
  "actor X failed: <cause>; last lines of its log (<path>): ...".
- Process groups launched like torchrun: ranks get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT (port = head_port + 10 + role index). A dead rank restarts the
  group's ranks on its node (a torch process group cannot take back one rank).
- Children are `miles.supervise.SupervisedProcess`es: their own process group and
  PR_SET_PDEATHSIG(SIGKILL), so even a `kill -9` of the daemon takes them down; on SIGTERM/SIGINT
  the daemon sends SIGTERM to every child's group, waits `cluster.shutdown_grace_s`, then
  SIGKILLs what is left, servers the actor started in sessions of their own included (those are
  left to the actor to stop in order during the grace period).
- Ctrl-C: children are in groups of their own, so a terminal's SIGINT reaches only the daemon;
  it stops the children (which exit quietly) and prints one line: where the run stopped (the
  newest complete checkpoint's `loop_state.json`) and that the same command resumes it.
- Logs: every child writes to `<output_dir>/logs/<actor name>.log` (`/` -> `_`), appended
  across incarnations, and the daemon follows those files onto its console with a `[name] `
  prefix. A child never writes into a pipe, so no line is too long and a slow console never
  blocks an actor; a line over 64 KiB reaches the console in 64 KiB pieces, the file whole.
- Every wait has a deadline that names what it waited for: other nodes at start
  (`cluster.start_timeout_s`), children at shutdown (`cluster.shutdown_grace_s`, then SIGKILL),
  calls to other daemons (5 s). A child that has not registered `cluster.start_timeout_s` after
  its start is reported once with its log's last lines (an actor may legitimately load a model
  for longer; its own waits carry their deadlines).
- When the `main` actor exits, the job is over: the head tells the other daemons to shut down and
  exits with the main actor's code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from miles.runtime import Actor, ActorError, Registry, Runtime, run_event_loop
from miles.config import ActorSpec, Recipe, recipe_to_json
from miles.supervise import LogFollower, RestartBudget, SupervisedProcess, read_log_tail
from miles.wire import auth
from miles.wire.messages import ListActors, Ok, Ping, Shutdown

CRASH_LOOP_WINDOW_S = 30.0  # a death this soon after start counts as a start failure
LOG_TAIL_LINES = 20         # of a failing child's log, in the daemon's messages
CALL_TIMEOUT_S = 5.0        # calls between daemons and to the registry


@dataclass
class NodeEnv:
    node_rank: int = 0
    nnodes: int = 1
    head_host: str = "127.0.0.1"
    host: str = "127.0.0.1"
    source: str = "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list as host names: `scontrol show hostnames` where Slurm is
    installed (it knows every form), else `parse_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=CALL_TIMEOUT_S, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """`a,b`, `node[01-03,07]`, `gpu[1-2]-ib`, `rack1-[01-02]-gpu[3-4]`: every bracket group
    expands (the cartesian product, leftmost slowest, as Slurm orders them); zero padding is kept."""
    hosts: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        pieces = re.split(r"\[([^\]]*)\]", part)  # text, ranges, text, ranges, ..., text
        choices: list[list[str]] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                choices.append([piece])
                continue
            values = []
            for r in piece.split(","):
                lo, _, hi = r.strip().partition("-")
                if not lo.isdigit() or not (hi or lo).isdigit():
                    raise ValueError(f"host list {nodelist!r}: bad range {r!r} in [{piece}]")
                values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
            choices.append(values)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def detect_node_env(env: dict | None = None, default_host: str = "127.0.0.1") -> NodeEnv:
    env = os.environ if env is None else env
    if "SLURM_NODEID" in env and "SLURM_JOB_NODELIST" in env:
        hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
        rank = int(env["SLURM_NODEID"])
        ne = NodeEnv(rank, int(env.get("SLURM_NNODES", len(hosts))), hosts[0],
                     hosts[rank] if rank < len(hosts) else default_host, "slurm")
    elif "NODE_RANK" in env or "NNODES" in env:
        ne = NodeEnv(int(env.get("NODE_RANK", 0)), int(env.get("NNODES", 1)),
                     env.get("MASTER_ADDR", default_host), default_host, "torchrun")
    else:
        ne = NodeEnv(host=default_host, head_host=default_host)
    ne.head_host = env.get("MILES_HEAD_HOST", ne.head_host)
    ne.host = env.get("MILES_HOST", ne.host)
    return ne


@dataclass
class Child:
    name: str                 # actor name, e.g. "trainer/1"
    role: str
    spec: ActorSpec
    env: dict[str, str]
    group: list["Child"] = field(default_factory=list)  # siblings restarted together
    proc: SupervisedProcess | None = None
    incarnation: int = 0
    restarts: int = 0
    budget: RestartBudget | None = None  # restart.max_restarts per restart.window_s
    started_at: float = 0.0
    exit_code: int | None = None
    gave_up: bool = False
    log_path: Path | None = None
    log_offset: int = 0                 # where this incarnation's output starts in log_path
    follower: LogFollower | None = None
    registered: bool = False            # this incarnation is in the registry
    early_failure: tuple | None = None  # (exit code, last error line) of an early death
    reported_slow_start: bool = False

    def log_tail(self, n_lines: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.log_path, n_lines, since=self.log_offset)


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; 32768-60999 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class NodeDaemon(Actor):
    """Hosts the registry (head), spawns and supervises this node's actor processes."""

    def __init__(self, recipe: Recipe, node: NodeEnv, recipe_path: Path, name: str = ""):
        super().__init__(name or f"node/{node.node_rank}")
        self.recipe, self.node = recipe, node
        self.recipe_path = recipe_path
        self.children: list[Child] = []
        self.exit_code: int | None = None
        self._done = asyncio.Event()
        self._shutting_down = False
        self.registry_actor: Registry | None = None
        self._lost: set[int] = set()  # node ranks the head found lost
        self.progress = self._progress()

    def _progress(self):
        """The head's console view of an RL run (miles.console); None on other nodes and for
        recipes without the loop driver."""
        driver = self.recipe.actors.get("driver")
        if self.node.node_rank != 0 or driver is None or not driver.cls.endswith(":LoopDriver"):
            return None
        from miles.console import RunProgress
        lg = self.recipe.logging
        return RunProgress(Path(self.recipe.output_dir) / "metrics.jsonl", self.recipe.loop.num_steps,
                           every=lg.console_every, bar=None if lg.progress else False)

    # ----- placement -------------------------------------------------------------------------

    def plan(self) -> list[Child]:
        """The children this node runs, from the recipe's [actors] placement."""
        cl, children = self.recipe.cluster, []
        for index, (role, spec) in enumerate(sorted(self.recipe.actors.items())):
            nodes = spec.nodes if spec.nodes is not None else [spec.node]
            if self.node.node_rank not in nodes:
                continue
            if spec.per_node and spec.nodes is not None:
                # One actor of its own per node (the engine fleet): no process group, and the
                # first node's keeps the role's plain name, so callers need not know the layout.
                at = self.node.node_rank
                child = Child(name=role if at == nodes[0] else f"{role}@{at}", role=role, spec=spec,
                              env={"MILES_ACTOR_ROLE": role, **spec.env})
                child.group.append(child)
                children.append(child)
                continue
            grouped = spec.distributed or spec.procs_per_node > 1 or len(nodes) > 1
            world = len(nodes) * spec.procs_per_node
            group: list[Child] = []
            for local in range(spec.procs_per_node):
                rank = nodes.index(self.node.node_rank) * spec.procs_per_node + local
                name = f"{role}/{rank}" if grouped else role
                env = {"MILES_ACTOR_ROLE": role, **spec.env}
                if grouped:
                    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                               LOCAL_WORLD_SIZE=str(spec.procs_per_node),
                               GROUP_RANK=str(nodes.index(self.node.node_rank)),
                               MASTER_PORT=str(cl.head_port + 10 + index),
                               MILES_MASTER_NODE=str(nodes[0]))
                child = Child(name=name, role=role, spec=spec, env=env, group=group)
                group.append(child)
                children.append(child)
        return children

    def _child_env(self, child: Child) -> dict[str, str]:
        env = dict(os.environ)
        env.update(child.env)
        env.update(MILES_ACTOR_NAME=child.name, MILES_ACTOR_CLASS=child.spec.cls,
                   MILES_REGISTRY=self.registry_endpoint, MILES_RECIPE=str(self.recipe_path),
                   MILES_NODE_RANK=str(self.node.node_rank), MILES_HOST=self.node.host,
                   MILES_INCARNATION=str(child.incarnation),
                   MILES_LOG_LEVEL=self.recipe.run.log_level.upper(), PYTHONUNBUFFERED="1")
        if "MASTER_PORT" in child.env:
            env["MASTER_ADDR"] = self._master_addr(int(child.env["MILES_MASTER_NODE"]))
        auth.set_child_env(env, self.runtime.curve)  # the job's CurveZMQ keys, never argv
        return env

    def _master_addr(self, node_rank: int) -> str:
        if node_rank == self.node.node_rank:
            return self.node.host
        return self._node_hosts.get(node_rank, self.node.head_host)

    # ----- lifecycle -------------------------------------------------------------------------

    @property
    def registry_endpoint(self) -> str:
        return f"tcp://{self.node.head_host}:{self.recipe.cluster.head_port}"

    async def run_node(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(
                self.shutdown(f"signal {signal.Signals(s).name}", 128 + s, by_signal=True)))
        cl = self.recipe.cluster
        # cluster.auth = "curve": the keypair exported by the launcher (one for all nodes), else
        # a fresh one for this job (miles.wire.auth).
        runtime = Runtime(registry=self.registry_endpoint, name=self.name,
                          node_rank=self.node.node_rank,
                          curve=auth.job_keys(getattr(cl, "auth", "none")))
        self.heartbeat_interval_s = cl.heartbeat_interval_s
        try:
            if self.node.node_rank == 0:
                self.registry_actor = Registry(liveness_timeout_s=cl.liveness_timeout_s)
                await self.registry_actor.start(runtime, host=self.node.host, port=cl.head_port,
                                                register=False)
            await self.start(runtime, host=self.node.host)
        except (ActorError, OSError, zmq.ZMQError) as e:
            self._log(f"cannot start the registry or register with it at {self.registry_endpoint}"
                      f" (cluster.head_port = {cl.head_port}): {e}")
            runtime.close()
            return 1
        watchers = [asyncio.create_task(self._watch_liveness()),
                    asyncio.create_task(self._follow_logs())]
        if self.node.nnodes > 1:
            watchers.append(asyncio.create_task(
                self._watch_nodes() if self.node.node_rank == 0 else self._watch_head()))
        observer = await self._serve_metrics()
        if await self._until_done(self._discover_nodes()):
            self.children = self.plan()
            self._warn_ephemeral_master_ports()
            for child in self.children:
                if not self._shutting_down:
                    self._spawn_child(child)
        await self._done.wait()
        for w in watchers:
            w.cancel()
        self._pump_logs(final=True)
        if observer is not None:
            await observer.cleanup()
            (Path(self.recipe.output_dir) / f"metrics_url.node{self.node.node_rank}").unlink(missing_ok=True)
        await self.close()
        if self.registry_actor is not None:
            await asyncio.sleep(0.2)  # let the other nodes' shutdown calls be answered
            await self.registry_actor.close()
        runtime.close()
        return self.exit_code or 0

    async def _serve_metrics(self):
        """Prometheus `/metrics` on every node, and the dashboard on the head (miles.observe)."""
        port = self.recipe.logging.metrics_port
        if port < 0:
            return None
        derived = port == 0
        port = port or self.recipe.cluster.head_port + 1 + self.node.node_rank
        from miles.observe import make_app, serve
        app = make_app(Path(self.recipe.output_dir), actors_fn=self.actor_table,
                       node_rank=self.node.node_rank, dashboard=self.node.node_rank == 0)
        try:
            runner, bound = await serve(app, self.node.host, port, any_port_if_taken=derived)
        except OSError as e:  # the run goes on without it: a scrape target is not worth a job
            self._log(f"metrics endpoint not served: port {port} (logging.metrics_port): {e}")
            return None
        if bound != port:
            self._log(f"metrics port {port} (cluster.head_port + 1 + node rank) is taken: serving on {bound}")
            port = bound
        (Path(self.recipe.output_dir) / f"metrics_url.node{self.node.node_rank}").write_text(
            f"http://{self.node.host}:{port}/\n")
        return runner

    def actor_table(self) -> list[dict]:
        """This node's actors (process state, incarnation, restarts) and, on the head, every
        actor's heartbeat age and event-loop lag from the registry."""
        beats = {}
        if self.registry_actor is not None:
            for name in list(self.registry_actor.entries):
                info = self.registry_actor._info(name)
                beats[name] = {"heartbeat_age_s": round(info.last_seen_s, 3),
                               "loop_lag_ms": info.loop_lag_ms, "node": info.node_rank}
        rows = []
        for c in self.children:
            alive = c.proc is not None and c.proc.alive
            rows.append({"name": c.name, "node": self.node.node_rank, "up": alive,
                         "state": "up" if alive else ("gave up" if c.gave_up else "down"),
                         "incarnation": c.incarnation, "restarts": c.restarts, **beats.pop(c.name, {})})
        for name, beat in sorted(beats.items()):   # actors of other nodes, as the head sees them
            if not name.startswith("node/"):
                rows.append({"name": name, "up": beat["heartbeat_age_s"] < self.recipe.cluster.liveness_timeout_s,
                             **beat})
        return rows

    async def _until_done(self, coro) -> bool:
        """Run `coro` unless the node is told to shut down first; False if it was."""
        task, done = asyncio.ensure_future(coro), asyncio.ensure_future(self._done.wait())
        await asyncio.wait({task, done}, return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        if not task.done():
            task.cancel()
            return False
        try:
            self._node_hosts = task.result()
        except ActorError as e:
            await self.shutdown(str(e), 1)
            return False
        return True

    async def _discover_nodes(self) -> dict[int, str]:
        """Hosts of the other nodes (for MASTER_ADDR of groups that span nodes)."""
        hosts: dict[int, str] = {}
        if any(spec.nodes and len(spec.nodes) > 1 for spec in self.recipe.actors.values()):
            wait_s = self.recipe.cluster.start_timeout_s
            for rank in range(self.node.nnodes):
                try:
                    info = await self.runtime.lookup(f"node/{rank}", wait_s=wait_s)
                except ActorError as e:
                    raise ActorError(f"node/{rank} did not register within cluster.start_timeout_s"
                                     f" = {wait_s}s (its host is needed as MASTER_ADDR of groups "
                                     f"that span nodes): {e}") from None
                hosts[rank] = info.endpoint.split("//")[1].rsplit(":", 1)[0]
        return hosts

    # ----- losing a node ----------------------------------------------------------------------

    def _lost_node(self) -> str | None:
        """On the head: why the job must stop for a node daemon that is gone, or None. A daemon
        is lost when it sent no heartbeat for `cluster.node_timeout_s`, or sooner when its
        connection closed (a kill, a crashed host) and it missed two heartbeats since."""
        cl, reg = self.recipe.cluster, self.registry_actor
        if reg is None:
            return None
        for rank in range(1, self.node.nnodes):
            name = f"node/{rank}"
            if name not in reg.entries or rank in self._lost:
                continue
            info = reg._info(name)
            age = info.last_seen_s
            gone = info.disconnected and age > 2 * cl.heartbeat_interval_s
            if age <= cl.node_timeout_s and not gone:
                continue
            self._lost.add(rank)
            actors = sorted(a for a in reg.entries if a != name and reg.entries[a].node_rank == rank)
            how = (f"its connection closed and no answer for {age:.1f} s" if gone and
                   age <= cl.node_timeout_s else f"no answer for {age:.1f} s")
            return (f"node {rank} lost: {how} (cluster.node_timeout_s = {cl.node_timeout_s}); its "
                    f"actors: {', '.join(actors) or 'none'}; {where_stopped(self.recipe.output_dir)}")
        return None

    async def _watch_nodes(self) -> None:
        """The head ends the job when a node daemon is lost: its actors are gone with it (their
        PDEATHSIG), and a torch group or a fleet cannot go on without them."""
        while not self._shutting_down:
            await asyncio.sleep(min(1.0, self.recipe.cluster.heartbeat_interval_s))
            reason = self._lost_node()
            if reason is not None:
                await self.shutdown(reason, 1)
                return

    async def _watch_head(self) -> None:
        """A node other than the head ends its part of the job when the registry (the head's
        daemon) has not answered for `cluster.node_timeout_s`: nothing can go on without it."""
        cl = self.recipe.cluster
        answered = time.monotonic()
        while not self._shutting_down:
            try:
                # A short timeout: the verdict comes at most a fifth of the deadline late.
                await self.runtime.registry.call(Ping(), timeout_s=min(CALL_TIMEOUT_S, cl.node_timeout_s / 5))
                answered = time.monotonic()
            except Exception:  # noqa: BLE001 - any failure to answer counts as silence
                pass
            silent = time.monotonic() - answered
            if silent > cl.node_timeout_s:
                await self.shutdown(f"the head (node 0) lost: its registry at "
                                    f"{self.registry_endpoint} did not answer for {silent:.1f} s "
                                    f"(cluster.node_timeout_s = {cl.node_timeout_s}); stopping "
                                    f"this node's actors", 1)
                return
            await asyncio.sleep(min(1.0, cl.heartbeat_interval_s))

    # ----- children --------------------------------------------------------------------------

    def _spawn_child(self, child: Child) -> None:
        if child.log_path is None:
            child.log_path = self.recipe.output_dir / "logs" / f"{child.name.replace('/', '_')}.log"
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            from miles.console import forwarder
            child.follower = LogFollower(child.log_path, f"[{child.name}] ".encode(),
                                         forwarder(self.progress, self._write_console))
        proc = SupervisedProcess(child.name, [sys.executable, "-m", "miles.runtime.host"],
                                 env=self._child_env(child), log_path=child.log_path).start()
        child.proc, child.log_offset = proc, proc.log_offset
        child.started_at = proc.started_at
        child.exit_code = None
        child.registered = child.reported_slow_start = False
        self._spawn(self._supervise(child, proc))

    @staticmethod
    def _write_console(data: bytes) -> None:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except (OSError, ValueError):  # the console is gone; the log files still have it all
            pass

    def _pump_logs(self, final: bool = False) -> None:
        for child in self.children:
            if child.follower is not None:
                child.follower.pump(flush_partial=final)
        if self.progress is not None:
            self.progress.close() if final else self.progress.pump()

    async def _follow_logs(self, interval_s: float = 0.1) -> None:
        while True:
            self._pump_logs()
            await asyncio.sleep(interval_s)

    async def _supervise(self, child: Child, proc: SupervisedProcess) -> None:
        code = await proc.wait()
        if proc is not child.proc:
            return
        child.follower.pump(flush_partial=True)  # its last words before ours
        child.exit_code = code
        if self._shutting_down:
            return
        if child.spec.main:
            reason = f"main actor {child.name} exited with {code}"
            if code != 0:
                reason = self._failure(child, await self._death_cause(child, code))
                if self.node.node_rank == 0 and self.node.nnodes > 1:
                    # It may have failed because a node is gone: say that, the cause, instead.
                    # Not RESUME_EXIT_CODE then: `miles run` on this node alone must not restart
                    # a job whose other node is gone.
                    await asyncio.sleep(2 * self.recipe.cluster.heartbeat_interval_s + 0.5)
                    lost = self._lost_node()
                    reason, code = (lost, 1) if lost else (reason, code)
            if self.node.node_rank != 0:  # the head ends the job for every node
                await self._tell_head(reason, code)
            await self.shutdown(reason, code)
            return
        if code == 0:
            return
        cause = await self._death_cause(child, code)
        # A signal after registration came from outside (an OOM killer, a chaos test, an
        # operator): not the actor failing the same way on every start. So is a SIGKILL before
        # it (no code of ours sends one): a kill during a restart is not a crash loop.
        early = code != -signal.SIGKILL and (not child.registered or (
            code > 0 and time.monotonic() - child.started_at < CRASH_LOOP_WINDOW_S))
        signature = (code, _normalized(_last_error_line(child.log_tail())))
        policy = child.spec.restart
        if early and child.early_failure == signature:
            await self._give_up(child, f"{cause}, as incarnation {child.incarnation - 1} did "
                                       f"(a crash loop: not restarted)")
            return
        child.early_failure = signature if early else None
        if child.budget is None:
            child.budget = RestartBudget(policy.max_restarts, policy.window_s, policy.backoff_s,
                                         policy.backoff_max_s)
        if child.budget.exhausted():
            await self._give_up(child, f"{cause}; restart budget (restart.max_restarts = "
                                       f"{policy.max_restarts}) used up within restart.window_s "
                                       f"= {policy.window_s} s")
            return
        delay = child.budget.delay_s()
        child.budget.record()
        self._log(f"{child.name} exited with {code}; restarting in {delay:.1f}s "
                  f"(restart {child.budget.recent()}/{policy.max_restarts} in "
                  f"restart.window_s = {policy.window_s} s)")
        await asyncio.sleep(delay)
        if self._shutting_down:
            return
        siblings = [c for c in child.group if c is not child and c.proc and c.proc.alive
                    ] if len(child.group) > 1 else []
        for sib in siblings:  # a torch process group cannot take back one rank: restart them all
            await self._terminate(sib, self.recipe.cluster.shutdown_grace_s)
        for c in [child, *siblings]:
            c.restarts += 1 if c is child else 0
            c.incarnation += 1
            self._spawn_child(c)

    async def _death_cause(self, child: Child, code: int) -> str:
        if not child.registered:  # the watcher may not have looked since it registered
            child.registered = await self._is_registered(child)
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in
               signal.valid_signals() else f"exited with code {code}")
        when = ("before it registered" if not child.registered else
                f"{time.monotonic() - child.started_at:.0f}s after its start")
        error = _last_error_line(child.log_tail())
        return f"incarnation {child.incarnation} {how} {when}" + (f" ({error})" if error else "")

    async def _is_registered(self, child: Child) -> bool:
        try:
            listing = await self.runtime.registry.call(ListActors(), timeout_s=CALL_TIMEOUT_S)
        except Exception:
            return False
        return any(a.name == child.name and a.incarnation == child.incarnation and a.endpoint
                   for a in listing.actors)

    def _failure(self, child: Child, cause: str) -> str:
        return (f"actor {child.name} failed: {cause}; last lines of its log ({child.log_path}):\n"
                f"{_indent(child.log_tail())}")

    async def _give_up(self, child: Child, cause: str) -> None:
        """Nothing else can finish without this actor: end the job rather than hang its callers."""
        child.gave_up = True
        reason = self._failure(child, cause)
        if self.node.node_rank != 0:
            await self._tell_head(reason, 1)
        await self.shutdown(reason, 1)

    async def _tell_head(self, reason: str, code: int) -> None:
        try:
            await self.runtime.ref("node/0").call(Shutdown(reason=reason, exit_code=code),
                                                  timeout_s=CALL_TIMEOUT_S)
        except Exception as e:
            self._log(f"could not reach the head (node/0) within {CALL_TIMEOUT_S}s to end the "
                      f"job: {e}")

    async def _watch_liveness(self) -> None:
        """Kill (and so restart) children that are running but stopped heart-beating; note which
        incarnations have registered (a death before that is a start failure)."""
        cl = self.recipe.cluster
        while True:
            await asyncio.sleep(max(0.5, cl.heartbeat_interval_s))
            try:
                listing = await self.runtime.registry.call(ListActors(), timeout_s=CALL_TIMEOUT_S)
            except Exception:
                continue
            infos = {a.name: a for a in listing.actors}
            now = time.monotonic()
            for child in self.children:
                info = infos.get(child.name)
                if child.proc is None or not child.proc.alive or self._shutting_down:
                    continue
                current = info is not None and info.incarnation == child.incarnation and info.endpoint
                child.registered = child.registered or bool(current)
                if (not child.registered and not child.reported_slow_start
                        and now - child.started_at > cl.start_timeout_s):
                    child.reported_slow_start = True
                    self._log(f"{child.name} (incarnation {child.incarnation}) has not registered "
                              f"{now - child.started_at:.0f}s after its start (cluster."
                              f"start_timeout_s = {cl.start_timeout_s}); last lines of its log "
                              f"({child.log_path}):\n{_indent(child.log_tail())}")
                if current and not info.alive and now - child.started_at > cl.liveness_timeout_s:
                    self._log(f"{child.name} (incarnation {child.incarnation}, pid {child.proc.pid}) "
                              f"sent no heartbeat for {info.last_seen_s:.1f}s (cluster."
                              f"liveness_timeout_s = {cl.liveness_timeout_s}): killing it; last "
                              f"lines of its log ({child.log_path}):\n{_indent(child.log_tail())}")
                    child.proc.signal_all(signal.SIGKILL)

    def _warn_ephemeral_master_ports(self) -> None:
        """A process group's MASTER_PORT in the kernel's ephemeral range can be held by any
        outgoing connection when rank 0's TCP store binds it (EADDRINUSE): say so once."""
        ports = sorted({int(c.env["MASTER_PORT"]) for c in self.children if "MASTER_PORT" in c.env})
        low, high = ephemeral_port_range()
        risky = [p for p in ports if low <= p <= high]
        if risky:
            self._log(f"process-group port(s) {risky} (cluster.head_port + 10 + role index) lie in the "
                      f"kernel's ephemeral range {low}-{high}, where any outgoing connection may hold them; "
                      f"a cluster.head_port below {low - 64} avoids that")

    def _log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(f"[{self.name}] {text}")
        else:
            print(f"[{self.name}] {text}", flush=True)

    async def _terminate(self, child: Child, grace_s: float) -> None:
        proc = child.proc
        if proc is None or not proc.alive:
            return
        child.proc = None  # the supervisor must not restart it
        if await proc.stop_async(grace_s, term_descendants=False) is None:
            self._log(f"{child.name} (pid {proc.pid}) did not exit {grace_s}s after SIGTERM "
                      f"(cluster.shutdown_grace_s) nor after SIGKILL: leaving it")

    async def shutdown(self, reason: str, code: int = 0, by_signal: bool = False) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self.exit_code = code
        # The registry lives in this process: actors going away now are the shutdown, not news.
        logging.getLogger("miles.runtime").setLevel(logging.ERROR)
        if not by_signal:  # a signal gets one line, once the children are down
            self._log(f"shutting down: {reason}")
        if self.node.node_rank == 0 and self.node.nnodes > 1:
            for rank in range(1, self.node.nnodes):
                if rank in self._lost:
                    continue
                try:
                    await self.runtime.ref(f"node/{rank}").call(Shutdown(reason=reason, exit_code=code),
                                                                timeout_s=CALL_TIMEOUT_S)
                except Exception as e:
                    self._log(f"node/{rank} did not take the shutdown within {CALL_TIMEOUT_S}s: {e}")
        grace = self.recipe.cluster.shutdown_grace_s
        await asyncio.gather(*(self._terminate(c, grace) for c in self.children))
        if by_signal:
            self._pump_logs(final=True)
            self._log(f"shutting down: {reason}; {where_stopped(self.recipe.output_dir)}")
        self._done.set()

    async def on_shutdown(self, msg: Shutdown) -> Ok:
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(self.shutdown(msg.reason or "asked by the head",
                                                        msg.exit_code)))
        return Ok(detail=f"{self.name} shutting down")


def where_stopped(output_dir: Path) -> str:
    """Where a stopped run can go on from: its newest complete checkpoint (loop_state.json is
    written last, so a directory without it is not one)."""
    root = Path(output_dir) / "checkpoints"
    done = []
    for path in root.glob("step_*"):
        try:
            done.append((int(json.loads((path / "loop_state.json").read_text())["step"]), path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not done:
        return f"stopped before the first checkpoint (none in {root}); run the same command again to start over"
    step, path = max(done)
    return f"stopped at step {step} (checkpoint {path}); run the same command again to resume"


def _last_error_line(tail: str) -> str:
    """The line that says what went wrong: the host's `error:` line, else the last one."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: "):]
    return lines[-1][:500] if lines else ""


def _normalized(line: str) -> str:
    """The same failure twice: timestamps, pids, ports and addresses differ, the words do not."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", line)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def run_node(recipe: Recipe, recipe_path_hint: str = "recipe") -> int:
    """Write the resolved recipe into the run directory and run this node's daemon."""
    from miles.rl.sources import prepare_recipe

    try:
        recipe = prepare_recipe(recipe)
        node = detect_node_env(default_host=recipe.cluster.host)
        out = recipe.output_dir
        out.mkdir(parents=True, exist_ok=True)
        resolved = out / f"recipe.resolved.node{node.node_rank}.json"
        resolved.write_bytes(recipe_to_json(recipe))
        daemon = NodeDaemon(recipe, node, resolved)
        try:
            return run_event_loop(daemon.run_node())
        finally:
            # Segments of a same-node call whose sender was SIGKILLed mid-call (miles/wire/shm.py):
            # every child of this node is gone now, so any of this job's left here is a leftover.
            from miles.wire import shm
            shm.sweep(shm.job_prefix({**os.environ, "MILES_REGISTRY": daemon.registry_endpoint}))
    except KeyboardInterrupt:  # Ctrl-C before the daemon's own handler is installed
        print("stopped before the run started; run the same command again to start it", flush=True)
        return 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    from miles.cli import main as cli_main
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
