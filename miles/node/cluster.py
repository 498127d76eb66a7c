"""Where this node is in the job (Slurm, torchrun-style variables, or one node), the other
nodes' hosts, and what the job does when a node or the head is lost."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from miles.config import Recipe
from miles.node.logs import where_stopped
from miles.runtime import ActorError
from miles.wire.messages import Ping, Shutdown

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


class Cluster:
    """The daemon's part that finds the other nodes and watches them (the head) or the head (the
    others)."""

    recipe: Recipe
    node: NodeEnv
    registry_actor: object
    _lost: set[int]
    _shutting_down: bool
    _done: asyncio.Event

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

    async def _tell_head(self, reason: str, code: int) -> None:
        try:
            await self.runtime.ref("node/0").call(Shutdown(reason=reason, exit_code=code),
                                                  timeout_s=CALL_TIMEOUT_S)
        except Exception as e:
            self._log(f"could not reach the head (node/0) within {CALL_TIMEOUT_S}s to end the "
                      f"job: {e}")
