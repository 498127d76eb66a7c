"""Which actor processes this node runs, from the recipe's `[actors]` placement, and the
environment each is started with (torchrun-style variables for process groups)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from miles.config import ActorSpec, Recipe
from miles.node.cluster import NodeEnv
from miles.node.logs import LOG_TAIL_LINES
from miles.supervise import LogFollower, RestartBudget, SupervisedProcess, read_log_tail
from miles.wire import auth


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
    spare: SupervisedProcess | None = None  # restart.spare: the next incarnation, imported, waiting

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


class Placement:
    """The daemon's part that plans its children and their environment."""

    recipe: Recipe
    node: NodeEnv
    recipe_path: Path
    children: list[Child]
    _node_hosts: dict[int, str]

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
        if getattr(self, "snapshot_dir", None) is not None:
            env["MILES_SNAPSHOT_DIR"] = str(self.snapshot_dir)
        if "MASTER_PORT" in child.env:
            env["MASTER_ADDR"] = self._master_addr(int(child.env["MILES_MASTER_NODE"]))
        auth.set_child_env(env, self.runtime.curve)  # the job's CurveZMQ keys, never argv
        return env

    def _master_addr(self, node_rank: int) -> str:
        if node_rank == self.node.node_rank:
            return self.node.host
        return self._node_hosts.get(node_rank, self.node.head_host)

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
