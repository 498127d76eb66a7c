"""The per-node daemon: `python -m miles.node recipe.toml` (what `miles run` and `launch/miles.sh` start).

Design decisions:
- Where am I: node rank, node count and head host come from Slurm (`SLURM_NODEID`,
  `SLURM_NNODES`, first host of `SLURM_JOB_NODELIST`), else torchrun-style variables (`NODE_RANK`,
  `NNODES`, `MASTER_ADDR`), else it is a one-node run. `MILES_HEAD_HOST` / `MILES_HOST` override.
- The head node (rank 0) hosts the registry in the daemon's own event loop. Every actor runs in
  a child process of its node's daemon (`miles.actors.host`), so a crash, an OOM or a `kill -9`
  takes down one actor, never the daemon, and the actor can be restarted alone.
- Supervision: a child that exits non-zero (or by signal) is restarted with exponential backoff
  until `restart.max_restarts` is used up; each restart gets a new incarnation number so callers
  of the old one fail fast and `retries` reach the new one. A child that is alive but silent (no
  heartbeat for `cluster.liveness_timeout_s`) is killed and restarted the same way.
- Process groups launched like torchrun: ranks get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT (port = head_port + 10 + role index). A dead rank restarts the
  group's ranks on its node (a torch process group cannot take back one rank).
- No orphans: children get their own process group and PR_SET_PDEATHSIG(SIGKILL), so even a
  `kill -9` of the daemon takes them down; on SIGTERM/SIGINT the daemon sends SIGTERM to every
  child's group, waits `cluster.shutdown_grace_s`, then SIGKILLs what is left.
- Logs of every child are forwarded line by line with a `[role]` prefix.
- When the `main` actor exits, the job is over: the head tells the other daemons to shut down and
  exits with the main actor's code.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.actors.base import Actor, Registry, Runtime, run_event_loop
from miles.config import ActorSpec, Recipe, recipe_to_json
from miles.wire.messages import ListActors, Ok, Shutdown


@dataclass
class NodeEnv:
    node_rank: int = 0
    nnodes: int = 1
    head_host: str = "127.0.0.1"
    host: str = "127.0.0.1"
    source: str = "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host lists: `a,b`, `node[01-03,07]`, `gpu[1-2]-ib`."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
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


def _die_with_parent() -> None:
    """Runs in the child before exec: own process group; SIGKILL when the daemon dies."""
    os.setpgrp()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str                 # actor name, e.g. "trainer/1"
    role: str
    spec: ActorSpec
    env: dict[str, str]
    group: list["Child"] = field(default_factory=list)  # siblings restarted together
    proc: asyncio.subprocess.Process | None = None
    incarnation: int = 0
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    gave_up: bool = False


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

    # ----- placement -------------------------------------------------------------------------

    def plan(self) -> list[Child]:
        """The children this node runs, from the recipe's [actors] placement."""
        cl, children = self.recipe.cluster, []
        for index, (role, spec) in enumerate(sorted(self.recipe.actors.items())):
            nodes = spec.nodes if spec.nodes is not None else [spec.node]
            if self.node.node_rank not in nodes:
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
                self.shutdown(f"signal {signal.Signals(s).name}", 128 + s)))
        cl = self.recipe.cluster
        runtime = Runtime(registry=self.registry_endpoint, name=self.name,
                          node_rank=self.node.node_rank)
        if self.node.node_rank == 0:
            self.registry_actor = Registry(liveness_timeout_s=cl.liveness_timeout_s)
            await self.registry_actor.start(runtime, host=self.node.host, port=cl.head_port,
                                            register=False)
        self.heartbeat_interval_s = cl.heartbeat_interval_s
        await self.start(runtime, host=self.node.host)
        self._node_hosts = await self._discover_nodes()
        self.children = self.plan()
        for child in self.children:
            await self._spawn_child(child)
        watchers = [asyncio.create_task(self._watch_liveness())]
        await self._done.wait()
        for w in watchers:
            w.cancel()
        await self.close()
        if self.registry_actor is not None:
            await asyncio.sleep(0.2)  # let the other nodes' shutdown calls be answered
            await self.registry_actor.close()
        runtime.close()
        return self.exit_code or 0

    async def _discover_nodes(self) -> dict[int, str]:
        """Hosts of the other nodes (for MASTER_ADDR of groups that span nodes)."""
        hosts = {}
        if any(spec.nodes and len(spec.nodes) > 1 for spec in self.recipe.actors.values()):
            for rank in range(self.node.nnodes):
                info = await self.runtime.lookup(f"node/{rank}", wait_s=self.recipe.cluster.start_timeout_s)
                hosts[rank] = info.endpoint.split("//")[1].rsplit(":", 1)[0]
        return hosts

    async def _spawn_child(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "miles.actors.host", env=self._child_env(child),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, preexec_fn=_die_with_parent)
        child.started_at = time.monotonic()
        child.exit_code = None
        self._spawn(self._forward_logs(child, child.proc))
        self._spawn(self._supervise(child, child.proc))

    async def _forward_logs(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        prefix = f"[{child.name}] ".encode()
        out = sys.stdout.buffer
        while True:
            line = await proc.stdout.readline()
            if not line:
                return
            out.write(prefix + line)
            out.flush()

    async def _supervise(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if proc is not child.proc:
            return
        child.exit_code = code
        if self._shutting_down:
            return
        if child.spec.main:
            reason = f"main actor {child.name} exited with {code}"
            if self.node.node_rank != 0:  # the head ends the job for every node
                try:
                    await self.runtime.ref("node/0").call(Shutdown(reason=reason, exit_code=code),
                                                          timeout_s=5.0)
                except Exception as e:
                    self._log(f"could not reach the head to end the job: {e}")
            await self.shutdown(reason, code)
            return
        if code == 0:
            return
        policy = child.spec.restart
        if child.restarts >= policy.max_restarts:
            child.gave_up = True
            self._log(f"{child.name} exited with {code}; restart budget "
                      f"({policy.max_restarts}) used up, not restarting")
            return
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** child.restarts)
        self._log(f"{child.name} exited with {code}; restarting in {delay:.1f}s "
                  f"(restart {child.restarts + 1}/{policy.max_restarts})")
        await asyncio.sleep(delay)
        if self._shutting_down:
            return
        siblings = [c for c in child.group if c is not child and c.proc and c.proc.returncode is None
                    ] if len(child.group) > 1 else []
        for sib in siblings:  # a torch process group cannot take back one rank: restart them all
            await self._terminate(sib, self.recipe.cluster.shutdown_grace_s)
        for c in [child, *siblings]:
            c.restarts += 1 if c is child else 0
            c.incarnation += 1
            await self._spawn_child(c)

    async def _watch_liveness(self) -> None:
        """Kill (and so restart) children that are running but stopped heart-beating."""
        cl = self.recipe.cluster
        while True:
            await asyncio.sleep(max(0.5, cl.heartbeat_interval_s))
            try:
                listing = await self.runtime.registry.call(ListActors(), timeout_s=5.0)
            except Exception:
                continue
            infos = {a.name: a for a in listing.actors}
            now = time.monotonic()
            for child in self.children:
                info = infos.get(child.name)
                running = child.proc is not None and child.proc.returncode is None
                if (running and info is not None and info.incarnation == child.incarnation
                        and not info.alive and now - child.started_at > cl.liveness_timeout_s):
                    self._log(f"{child.name} missed heartbeats for {info.last_seen_s:.1f}s: killing it")
                    self._killpg(child.proc, signal.SIGKILL)

    def _log(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)

    @staticmethod
    def _killpg(proc: asyncio.subprocess.Process, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    async def _terminate(self, child: Child, grace_s: float) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        child.proc = None  # the supervisor must not restart it
        self._killpg(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            self._killpg(proc, signal.SIGKILL)
            await proc.wait()
        self._killpg(proc, signal.SIGKILL)  # anything the child left in its group

    async def shutdown(self, reason: str, code: int = 0) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self.exit_code = code
        self._log(f"shutting down: {reason}")
        if self.node.node_rank == 0 and self.node.nnodes > 1:
            for rank in range(1, self.node.nnodes):
                try:
                    await self.runtime.ref(f"node/{rank}").call(Shutdown(reason=reason), timeout_s=5.0)
                except Exception as e:
                    self._log(f"node/{rank} did not take the shutdown: {e}")
        grace = self.recipe.cluster.shutdown_grace_s
        await asyncio.gather(*(self._terminate(c, grace) for c in self.children))
        self._done.set()

    async def on_shutdown(self, msg: Shutdown) -> Ok:
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(self.shutdown(msg.reason or "asked by the head",
                                                        msg.exit_code)))
        return Ok(detail=f"{self.name} shutting down")


def run_node(recipe: Recipe, recipe_path_hint: str = "recipe") -> int:
    """Write the resolved recipe into the run directory and run this node's daemon."""
    from miles.rl.sources import prepare_recipe

    recipe = prepare_recipe(recipe)
    node = detect_node_env(default_host=recipe.cluster.host)
    out = recipe.output_dir
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / f"recipe.resolved.node{node.node_rank}.json"
    resolved.write_bytes(recipe_to_json(recipe))
    daemon = NodeDaemon(recipe, node, resolved)
    return run_event_loop(daemon.run_node())


def main(argv: list[str] | None = None) -> int:
    from miles.cli import main as cli_main
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
