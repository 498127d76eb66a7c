"""Trainer: hosts one training backend rank (FSDP2 or Megatron, by `train.backend`).

Design decisions:
- One actor per trainer rank (`trainer/0 .. trainer/N-1`), launched by the node daemon like
  torchrun; every rank receives the same calls in the same order (the backend's methods are
  collectives), and the driver calls all ranks at once.
- Backend calls are blocking torch code: they run in a worker thread so the actor keeps
  answering heartbeats and metrics during a long step. A lock keeps them in order.
- Weight publication: every rank runs `backend.update_weights(transport, version)` (gathering
  shards is collective); rank 0 alone also owns the engine session around it (pause -> transfer
  -> version -> continue) through `WeightPublisher`.
- The SFT warm-start is the same `train` call with the loss switched to `loss_type = "sft"` and
  the learning rate to `sft.lr`.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from miles.actors.base import Actor
from miles.wire.messages import (CheckpointState, GetEngines, LoadCheckpoint, Ok, PublishWeights,
                                 SaveCheckpoint, TrainResult, TrainStep)

log = logging.getLogger(__name__)


class Trainer(Actor):
    def __init__(self, name: str = "trainer/0"):
        super().__init__(name)
        self.lock = asyncio.Lock()
        self.backend = None
        self.publisher = None

    async def on_start(self) -> None:
        from miles.backends.base import RankInfo, make_backend

        r = self.recipe
        self.rank = RankInfo.from_env()
        self.backend = make_backend(r.train.backend)
        await asyncio.to_thread(self.backend.init, r.train, self.rank, r.algo)
        self.rl_loss, self.rl_cfg = r.algo, r.train
        self.sft_loss = msgspec.structs.replace(r.algo, loss_type="sft")
        self.sft_cfg = msgspec.structs.replace(r.train, lr=r.sft.lr, min_lr=min(r.train.min_lr, r.sft.lr),
                                               old_logprobs="auto")

    async def _run(self, fn, *args):
        async with self.lock:
            return await asyncio.to_thread(fn, *args)

    async def on_train_step(self, msg: TrainStep) -> TrainResult:
        sft = msg.phase == "sft"
        # The backend reads its loss and schedule config at every step: the warm-start swaps in
        # the SFT loss and `sft.lr`, RL steps use `algo` and `train` as the recipe gives them.
        self.backend.loss_cfg = self.sft_loss if sft else self.rl_loss
        self.backend.cfg = self.sft_cfg if sft else self.rl_cfg
        metrics = await self._run(self.backend.train, msg.samples)
        return TrainResult(metrics={k: float(v) for k, v in metrics.items()})

    async def _ensure_publisher(self):
        if self.publisher is None:
            from miles.weights.publisher import WeightPublisher, make_transport

            engines = await self.runtime.ref("engines").call(GetEngines(), timeout_s=600)
            cfg = self.recipe.weights
            self.transport = make_transport(cfg, rank=self.rank, recipe=self.recipe)
            await asyncio.to_thread(self.transport.connect, engines.engine_urls)
            if self.rank.rank == 0:
                self.publisher = WeightPublisher(cfg, engines.engine_urls, self.transport)
        return self.publisher

    async def on_publish_weights(self, msg: PublishWeights) -> Ok:
        publisher = await self._ensure_publisher()
        version = msg.version

        def run_update() -> None:
            self.backend.update_weights(self.transport, version)

        async with self.lock:
            if publisher is not None:
                await publisher.publish(version, run_update)
            else:
                await asyncio.to_thread(run_update)
        return Ok(detail=f"version {version}")

    async def on_save_checkpoint(self, msg: SaveCheckpoint) -> Ok:
        await self._run(lambda: self.backend.save_model(msg.path, hf=msg.hf, extra_state=msg.extra_state))
        return Ok(detail=msg.path)

    async def on_load_checkpoint(self, msg: LoadCheckpoint) -> CheckpointState:
        extra = await self._run(self.backend.load_model, msg.path)
        return CheckpointState(extra_state=dict(extra or {}))

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if self.backend is not None:
            out["trainer/step"] = float(self.backend.step)
        return out

    async def on_stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if getattr(self, "transport", None) is not None:
            await asyncio.to_thread(self.transport.close)
        if self.backend is not None:
            self.backend.close()
