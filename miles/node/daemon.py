"""`NodeDaemon`: one per node, an actor that hosts the registry (on the head) and spawns and
supervises this node's actor processes; its parts live beside it (placement, supervisor,
cluster, metrics, logs). The design decisions are in `miles/node/__init__.py`."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
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
from miles.wire.messages import Drain, Ok, Shutdown


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
        self._draining = False
        self.registry_actor: Registry | None = None
        self._lost: set[int] = set()  # node ranks the head found lost
        self.snapshot_dir: Path | None = None  # trainer ranks' in-memory snapshots (the keeper's)
        self.progress = self._progress()

    @property
    def registry_endpoint(self) -> str:
        return f"tcp://{self.node.head_host}:{self.recipe.cluster.head_port}"

    async def run_node(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(self.on_signal(s)))
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
        self.snapshot_dir = keep_snapshots(self.registry_endpoint, self.node.node_rank)
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
        if self.snapshot_dir is not None:  # the keeper's memory goes with the job
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)
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

    async def on_signal(self, sig: int) -> None:
        """SIGINT stops at once; SIGTERM / SIGUSR1 (Slurm's preemption signals) drain an RL job
        first: the driver finishes or abandons its step, checkpoints and exits 0, which ends the
        job on every node; a second signal, or the deadline, stops it at once."""
        name = signal.Signals(sig).name
        stop = lambda why="": self.shutdown(f"signal {name}{why}", 128 + sig, by_signal=True)  # noqa: E731
        driver = self.recipe.actors.get("driver")
        rl_job = bool(self.recipe.model.path or self.recipe.model.tiny)  # its driver is the loop's
        if sig == signal.SIGINT or self._draining or not rl_job or driver is None or not driver.main:
            await stop()
            return
        self._draining = True
        deadline_s = self.recipe.cluster.drain_timeout_s
        if self.node.node_rank == 0:
            self._log(f"{name}: draining the job (the step in progress finishes or is abandoned, "
                      f"then a checkpoint; cluster.drain_timeout_s = {deadline_s})")
            try:
                await self.runtime.ref("driver").call(Drain(reason=name), timeout_s=CALL_TIMEOUT_S)
            except Exception as e:  # no driver to drain (not started, or gone): stop now
                self._log(f"the driver did not take the drain ({type(e).__name__}: {e})")
                await stop()
                return
        else:  # the head drains the job and then stops this node (on_shutdown)
            self._log(f"{name}: waiting up to {deadline_s} s for the head to drain the job")
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), deadline_s)
        except asyncio.TimeoutError:
            await stop(f": the drain did not finish within cluster.drain_timeout_s = {deadline_s}")

    async def on_shutdown(self, msg: Shutdown) -> Ok:
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(self.shutdown(msg.reason or "asked by the head",
                                                        msg.exit_code)))
        return Ok(detail=f"{self.name} shutting down")


def keep_snapshots(registry_endpoint: str, node_rank: int) -> Path | None:
    """The directory in /dev/shm where this node's trainer ranks keep their in-memory snapshots
    (miles/wire/snapshot.py): made by the daemon, which outlives them, and removed at the
    job's end; those of earlier jobs whose daemon is gone are removed first. None without /dev/shm."""
    if not shm.available():
        return None
    prefix = "miles-snap-" + shm.job_prefix({**os.environ, "MILES_REGISTRY": registry_endpoint}
                                            ).removeprefix("miles-shm-")
    for old in Path(shm.SHM_DIR).glob(prefix + "*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(shm.SHM_DIR) / f"{prefix}node{node_rank}-{os.getpid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


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
