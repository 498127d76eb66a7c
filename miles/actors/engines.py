"""EngineFleet: launches the rollout engines and the smg gateway in front of them, and keeps them up.

Design decisions:
- One actor owns the fleet of a node: N engines (embedded or real SGLang, `engine.kind`) and the
  gateway. Everyone else asks it `GetEngines` for the gateway URL (generation) and the engine
  URLs (control: pause, weight updates go to each engine directly).
- Engines are health-checked every `engine.health_interval_s`. A dead engine is removed from the
  gateway at once (its requests fail fast, new ones go to the others), relaunched on a fresh
  port, brought to the current weights by the caller's next publish, and added back; after
  `engine.max_restarts` it stays out and the fleet runs smaller.
- The engines' logs go to files in the run directory (they are chatty); failures quote their tail.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from miles.actors.base import Actor
from miles.wire.messages import EngineSet, GetEngines

log = logging.getLogger(__name__)


class EngineFleet(Actor):
    def __init__(self, name: str = "engines"):
        super().__init__(name)
        self.engines: list = []
        self.gateway = None
        self.restarts = 0
        self.version = 0
        self._ready = asyncio.Event()

    async def on_start(self) -> None:
        asyncio.get_running_loop().create_task(self._launch())

    async def _launch(self) -> None:
        from miles.engines.gateway import GatewayConfig, launch_gateway
        from miles.engines.procs import free_port

        cfg = self.recipe.engine
        self.logdir = Path(self.recipe.output_dir) / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.engines = list(await asyncio.gather(*(self._launch_engine(i) for i in range(cfg.num_engines))))
        self.gateway = await launch_gateway(
            GatewayConfig(port=free_port(), prometheus_port=free_port(), policy=cfg.gateway_policy),
            [e.url for e in self.engines], timeout_s=cfg.start_timeout_s,
            log_path=self.logdir / "gateway.log")
        self._ready.set()
        asyncio.get_running_loop().create_task(self._watch())

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

    async def _watch(self) -> None:
        cfg = self.recipe.engine
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            for i, engine in enumerate(list(self.engines)):
                if engine is None or engine.process.alive:
                    continue
                log.warning("engine %d (%s) died: %s", i, engine.url, engine.process.log_tail(5))
                try:
                    await self.gateway.remove_worker(engine.url)
                except Exception as e:  # the gateway's health check drops it anyway
                    log.warning("could not remove %s from the gateway: %s", engine.url, e)
                if self.restarts >= cfg.max_restarts:
                    self.engines[i] = None
                    continue
                self.restarts += 1
                try:
                    fresh = await self._launch_engine(i)
                    await self.gateway.add_worker(fresh.url)
                    self.engines[i] = fresh
                except Exception as e:
                    log.error("engine %d could not be restarted: %s", i, e)
                    self.engines[i] = None

    async def on_get_engines(self, msg: GetEngines) -> EngineSet:
        await self._ready.wait()
        return EngineSet(gateway_url=self.gateway.url, model_path=self.recipe.model.path,
                         engine_urls=[e.url for e in self.engines if e is not None],
                         version=self.version)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["engines/alive"] = float(sum(1 for e in self.engines if e is not None and e.process.alive))
        out["engines/restarts"] = float(self.restarts)
        return out

    async def on_stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop_async(grace_s=2.0)
        await asyncio.gather(*(e.stop_async(grace_s=3.0) for e in self.engines if e is not None),
                             return_exceptions=True)
