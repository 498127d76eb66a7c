"""The engine fleet over several nodes: what the other nodes' fleets tell the head's, and how the
head's fleet holds an engine it did not launch.

`[actors.engines] nodes = [0, 1]` with `per_node = true` places one `EngineFleet` per node: the
first node's is `engines` (the gateway, the session server, `GetEngines` for everyone), each
other node's is `engines@<k>` (its own engines only).

Design decisions:
- The other nodes' fleets launch and supervise their engines exactly as a one-node fleet does
  (health checks, restarts on a fresh port, the crash-loop budget); they only report: the first
  set (`NodeEngines`), each death (`NodeEngineDown`) and each restart (`NodeEngineUp`).
- The head's fleet keeps one slot per engine of every node; a remote engine is a `RemoteEngine`,
  a handle with the same face as a local one (`url`, `process.alive`, `stop_async`), so the
  pending/serving rules (`GetEngines`, `EnginesUpdated`, the gateway's worker list) are one code
  path for every node. A restarted remote engine becomes pending exactly like a local one.
- Stopping a remote engine (it missed a publish) asks its node's fleet to stop it; that fleet's
  watcher then restarts it, and the restart is reported back as pending.
- The head waits for every node's first report before it starts the gateway (deadline
  `engine.start_timeout_s`), so the first `GetEngines` already lists every node's engines and
  the first publish reaches them all.
- A node fleet that starts again (its process was restarted) sends `NodeEngines` again: its old
  engines are dropped and the new ones join as pending. An engine that did not start is sent as
  "" (its slot waits for that node's `NodeEngineUp`).
- The head's fleet restarted (a new incarnation) does not get the other nodes' engines back:
  it waits for their `NodeEngines`, which they sent its predecessor. Not handled yet: that
  restart fails after `engine.start_timeout_s` (one-node fleets are the tested case).
"""


from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from miles.engines.fleet.slots import EngineSlot
from miles.wire.messages import Message, Ok

log = logging.getLogger("miles.engines.fleet")


class NodeEngines(Message):
    """engines@k -> engines: node k's fleet is up with these engines (its slot order)."""
    node: int
    urls: list[str]


class NodeEngineDown(Message):
    """engines@k -> engines: node k's engine `index` died (`gave_up`: it will not be restarted)."""
    node: int
    index: int
    url: str
    exit_code: int | None = None
    gave_up: bool = False


class NodeEngineUp(Message):
    """engines@k -> engines: node k's engine `index` was restarted at `url` (initial weights)."""
    node: int
    index: int
    url: str


class StopEngine(Message):
    """engines -> engines@k: stop engine `index` at `url` (it missed a publish); node k restarts it."""
    index: int
    url: str


class _RemoteProcess:
    """What the head knows of a remote engine's process: alive until its node reports it dead."""

    def __init__(self) -> None:
        self.alive = True
        self.returncode: int | None = None

    def log_tail(self, n_lines: int = 10) -> str:
        return "(on another node: see its fleet's log there)"


class RemoteEngine:
    """The head's handle on an engine that another node's fleet launched and supervises."""

    def __init__(self, fleet, node: int, index: int, url: str):
        self.fleet, self.node, self.index, self.url = fleet, node, index, url
        self.process = _RemoteProcess()

    async def stop_async(self, grace_s: float = 2.0) -> None:
        """Ask the owning fleet to stop it; that fleet restarts it and reports the new one."""
        if not self.process.alive:
            return
        await self.fleet.runtime.ref(node_fleet_name(self.fleet.role, self.node)).call(
            StopEngine(index=self.index, url=self.url), timeout_s=max(5.0, grace_s + 5.0))


def node_fleet_name(role: str, node: int) -> str:
    """The fleet of node k other than the first: `engines@<k>` (as the node daemon names it)."""
    return f"{role}@{node}"


class FleetError(RuntimeError):
    """The fleet cannot serve: no engine started after its tries, smg or the session server did
    not start, or no engine was up for `engine.no_engine_timeout_s`."""


class NodeFleet:
    """`EngineFleet`'s part for several nodes: the head's side (joins, deaths and restarts the
    other nodes report) and the other nodes' side (reporting them, stopping on request)."""

    async def _leave_gateway(self, url: str, was_serving: bool) -> None:
        if was_serving and self.gateway is not None and self.gateway.process.alive:
            try:
                await self.gateway.remove_worker(url, timeout_s=10.0)
            except Exception as e:  # noqa: BLE001 - the gateway's health check drops it anyway
                log.warning("could not remove %s from the gateway: %s", url, e)

    def _report(self, msg) -> None:
        """Another node's fleet: tell the head's fleet (in the background: the watcher goes on)."""
        if self.is_head:
            return

        async def send() -> None:
            try:
                await self.runtime.ref(self.role).call(msg, timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - the head is gone: its node daemon ends the job
                log.warning("%s: could not tell %s %s: %s", self.name, self.role, type(msg).__name__, e)
        self._spawn(send())

    async def _wait_for_nodes(self) -> None:
        """The head's fleet: every other node's first set of engines, before the gateway starts."""
        if not self._node_joined:
            return
        wait_s = self.recipe.engine.start_timeout_s
        _, missing = await asyncio.wait(self._node_joined.values(), timeout=wait_s)
        if missing:
            late = [f"{self.role}@{n}" for n, f in self._node_joined.items() if not f.done()]
            raise FleetError(f"the engine fleets {late} did not announce their engines within "
                             f"engine.start_timeout_s = {wait_s}s (their logs say why)")

    def _remote_slots(self, node: int) -> list:
        return [s for s in self.slots if s.node == node and not s.gave_up]

    async def on_node_engines(self, msg: NodeEngines) -> Ok:
        joined = self._node_joined.get(msg.node)
        if joined is None:
            raise FleetError(f"{self.name}: node {msg.node} is not one of this fleet's nodes "
                             f"{self.fleet_nodes}")
        again = joined.done()
        for slot in self._remote_slots(msg.node):  # a restarted node fleet: its old engines are gone
            await self._remote_gone(slot, exit_code=None, gave_up=True)
        if again:
            self._bump_generation()
        for index, url in enumerate(msg.urls):  # "" : that engine did not start; it is still tried
            self.slots.append(EngineSlot(len(self.slots),
                                    engine=RemoteEngine(self, msg.node, index, url) if url else None,
                                    node=msg.node, remote_index=index,
                                    ready_at=time.monotonic() if again else 0.0,
                                    pending_since=self.generation if again else -1))
        if not again:
            joined.set_result(None)
        log.info("%s: node %d joined with %d engine(s)%s", self.name, msg.node, len(msg.urls),
                 " (again: they wait for the current weights)" if again else "")
        return Ok()

    async def _remote_gone(self, slot, exit_code: int | None, gave_up: bool) -> None:
        engine, was_serving = slot.engine, slot.pending_since < 0
        if engine is not None:
            engine.process.alive, engine.process.returncode = False, exit_code
            await self._leave_gateway(engine.url, was_serving)
        slot.engine, slot.pending_since = None, -1
        slot.gave_up = slot.gave_up or gave_up

    async def on_node_engine_down(self, msg: NodeEngineDown) -> Ok:
        slot = next((s for s in self.slots if s.node == msg.node and s.remote_index == msg.index
                     and not s.gave_up), None)
        if slot is None:
            return Ok(detail="unknown engine")
        log.warning("engine %d (node %d, %s) died with code %s (its log is on that node)%s",
                    slot.index, msg.node, msg.url or "-", msg.exit_code,
                    "; it gave up" if msg.gave_up else "; that node restarts it")
        await self._remote_gone(slot, msg.exit_code, msg.gave_up)
        slot.last_error = f"{msg.url or '-'} (node {msg.node}) died with code {msg.exit_code}"
        return Ok()  # with none up, the watcher ends the fleet after engine.no_engine_timeout_s

    async def on_node_engine_up(self, msg: NodeEngineUp) -> Ok:
        slot = next((s for s in self.slots if s.node == msg.node and s.engine is None
                     and s.remote_index == msg.index and not s.gave_up), None)
        if slot is None:
            return Ok(detail="unknown engine")
        slot.engine, slot.ready_at = RemoteEngine(self, msg.node, msg.index, msg.url), time.monotonic()
        slot.pending_since = self._bump_generation()
        log.info("engine %d (node %d) restarted at %s; waiting for the current weights "
                 "(generation %d)", slot.index, msg.node, msg.url, self.generation)
        return Ok()

    async def on_stop_engine(self, msg: StopEngine) -> Ok:
        """Another node's fleet: the head's asks it to stop an engine that missed a publish."""
        slot = self.slots[msg.index] if 0 <= msg.index < len(self.slots) else None
        if slot is not None and slot.engine is not None and slot.engine.url == msg.url:
            await slot.engine.stop_async(grace_s=2.0)  # the watcher restarts it and reports that
        return Ok()

    async def _poll_served(self, http: aiohttp.ClientSession, polled: dict[str, float]) -> None:
        """Several nodes: requests each node's engines finished (their `/metrics` counter), summed
        over the engines that node's fleet has run, restarted ones included."""
        served = getattr(self, "_served", {})
        self._served = served
        live = [(s.node if s.node >= 0 else self.node_rank, s.engine.url) for s in self.slots
                if s.engine is not None and s.engine.process.alive]
        counts = await asyncio.gather(*(self._requests_total(http, url) for _, url in live))
        for (node, url), n in zip(live, counts):
            if n is not None:
                served[url] = (node, n)
        for node in self.fleet_nodes:
            polled[f"engines/node{node}/requests_total"] = float(
                sum(n for at, n in served.values() if at == node))

    @staticmethod
    async def _requests_total(http: aiohttp.ClientSession, url: str) -> float | None:
        try:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except Exception:  # noqa: BLE001 - an engine restarting
            return None
        for line in text.splitlines():
            if line.startswith("sglang:num_requests_total"):
                return float(line.rsplit(" ", 1)[1])
        return None

