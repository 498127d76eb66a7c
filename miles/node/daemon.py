"""`NodeDaemon`: one per node, an actor that hosts the registry (on the head) and spawns and
supervises this node's actor processes; its parts live beside it (placement, supervisor,
cluster, metrics, logs). The design decisions are in `miles/node/__init__.py`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Callable

import zmq

from miles.config import Recipe, recipe_to_json
from miles.node.cluster import CALL_TIMEOUT_S, Cluster, NodeEnv, detect_node_env
from miles.node.logs import Logs, where_stopped
from miles.node.metrics import Metrics
from miles.node.placement import Child, Placement
from miles.node.supervisor import Supervisor
from miles.runtime import Actor, ActorError, Registry, Runtime, run_event_loop
from miles.wire import auth, shm
from miles.wire.messages import Ok, Shutdown


class NodeDaemon(Placement, Supervisor, Cluster, Metrics, Logs, Actor):
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


def run_node(recipe: Recipe, prepare: Callable[[Recipe], Recipe] = lambda recipe: recipe) -> int:
    """Write the resolved recipe into the run directory and run this node's daemon. `prepare`
    resolves what the recipe leaves to the run (the CLI passes `miles.rl.sources.prepare_recipe`:
    the daemon knows nothing of RL); a Ctrl-C during it is a stop before the run started."""
    try:
        recipe = prepare(recipe)
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
            shm.sweep(shm.job_prefix({**os.environ, "MILES_REGISTRY": daemon.registry_endpoint}))
    except KeyboardInterrupt:  # Ctrl-C before the daemon's own handler is installed
        print("stopped before the run started; run the same command again to start it", flush=True)
        return 128 + signal.SIGINT
