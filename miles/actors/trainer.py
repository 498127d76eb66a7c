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
- The engine set follows `PublishWeights.engine_urls`: a new set (a restarted engine) closes and
  reconnects the transport on every rank. An engine that dies during a publish is dropped: the
  ranks agree on the survivors over a gloo group of their own and publish again; with none left
  the publish fails (the driver then waits for the fleet to restart one).
- Two training phases (`phases_for`): "rl" (`algo`, `train`) and the SFT warm-start ("sft": the
  same objective with `loss_type = "sft"`, a constant `sft.lr`). Each call hands its phase to
  `backend.train`, so nothing is switched on the backend between calls, and the backend keeps one
  optimizer and schedule per phase: RL starts at step 0 of its schedule with fresh Adam moments.
- In-memory snapshots (`loop.snapshot`, miles/backends/snapshot.py): after each train call the
  rank's state (`backend.memory_state`) is copied into its file in the node daemon's /dev/shm
  directory (miles/wire/snapshot.py) in a worker
  thread, while the driver confirms the batch and publishes (publishing only reads the weights);
  the next call that changes the state waits for the copy. A restarted rank restores from it
  when the driver asks (`RestoreSnapshot`), and answers a train call it already made (the
  snapshot was taken after it) with that call's metrics instead of training it twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec

from miles.runtime import Actor
from miles.wire.snapshot import ENV_DIR, SnapshotFile, snapshot_bytes
from miles.wire.messages import (CheckpointState, GetEngines, LoadCheckpoint, Ok, Published,
                                 PublishWeights, RestoreSnapshot, SaveCheckpoint, SnapshotState,
                                 TrainResult, TrainStep)

log = logging.getLogger(__name__)


class Trainer(Actor):
    preload = ("torch", "transformers", "miles.backends.fsdp", "miles.weights.publisher")  # what a warm spare imports ahead (restart.spare)

    def __init__(self, name: str = "trainer/0"):
        super().__init__(name)
        self.lock = asyncio.Lock()
        self.backend = None
        self.publisher = None
        self.snapshots = None          # SnapshotFile, with loop.snapshot and a keeper directory
        self.snapshot_note = ""        # why there are none
        self._snapshotting: asyncio.Future | None = None
        self.train_call, self.train_metrics = 0, {}   # the driver's last train call made here
        self.asleep = False            # train.sleep_between_steps: lent out since the last publish

    async def on_start(self) -> None:
        from miles.backends.base import RankInfo

        self.rank = RankInfo.from_env()
        self.phases = phases_for(self.recipe)
        self.backend = await asyncio.to_thread(build_backend, self.recipe, self.rank)
        self.snapshots, self.snapshot_note = open_snapshots(self.recipe, self.rank.rank)

    async def _run(self, fn, *args):
        async with self.lock:
            await self._snapshot_done()
            await self._wake()
            return await asyncio.to_thread(fn, *args)

    async def _wake(self) -> None:
        """Before any backend call (under the lock): take back what `_sleep` lent out."""
        if self.asleep:
            await asyncio.to_thread(self.backend.wake_up)
            self.asleep = False

    async def _sleep(self) -> None:
        """After a publish (under the lock), with `train.sleep_between_steps`: the rank's device
        memory goes to the host until its next call (Offloadable), for colocated engines."""
        if self.recipe is not None and self.recipe.train.sleep_between_steps and not self.asleep:
            await self._snapshot_done()   # the snapshot copy reads the device state
            await asyncio.to_thread(self.backend.sleep)
            self.asleep = True

    async def _snapshot_done(self) -> None:
        if self._snapshotting is not None:
            await asyncio.shield(self._snapshotting)

    def _snapshot(self, train_call: int, metrics: dict[str, float]) -> None:
        """Copy the state after `train_call` into the keeper's memory (a worker thread)."""
        try:
            meta, arrays = self.backend.memory_state(train_call, metrics)
            self.snapshots.write(meta, arrays)
            self.snapshot_bytes = snapshot_bytes(arrays)
        except Exception as e:  # noqa: BLE001 - a snapshot must never fail training: disk heals it
            self.snapshots, self.snapshot_note = None, f"{type(e).__name__}: {e}"
            log.warning("in-memory snapshots off for this rank: %s", self.snapshot_note)

    async def on_train_step(self, msg: TrainStep) -> TrainResult:
        # The phase is an argument of the call, never state set on the backend: a call waiting
        # for the lock cannot change the config of the one running.
        # index: this rank's DP shard of the batch (miles.loop.shard_batch); None: the whole batch
        if msg.train_call and msg.train_call == self.train_call:
            # healed from a snapshot taken after this call: its result, not a second update
            return TrainResult(metrics=dict(self.train_metrics))
        raw = await self._run(self.backend.train, msg.samples, self.phases[msg.phase], msg.index)
        metrics = {k: float(v) for k, v in raw.items()}
        self.train_call, self.train_metrics = msg.train_call, metrics
        if self.snapshots is not None and msg.train_call:
            # after the reply is on its way: the copy overlaps the driver's confirm and publish
            self._snapshotting = asyncio.ensure_future(asyncio.to_thread(
                self._snapshot, msg.train_call, metrics))
        return TrainResult(metrics=metrics)

    async def on_restore_snapshot(self, msg: RestoreSnapshot) -> SnapshotState:
        """List the train calls whose snapshot this rank holds (-1), or restore one."""
        images = self.snapshots.images() if self.snapshots is not None else []
        calls = [int(i.meta["train_call"]) for i in images]
        if msg.train_call < 0:
            return SnapshotState(train_calls=calls, detail=self.snapshot_note if self.snapshots is None
                                 else "" if calls else f"no complete snapshot in {self.snapshots.path}")
        image = next((i for i in images if i.meta["train_call"] == msg.train_call), None)
        if image is None:
            raise LookupError(f"rank {self.rank.rank} holds no snapshot of train call "
                              f"{msg.train_call} (it holds {calls})")
        t0 = time.perf_counter()
        async with self.lock:
            await self._wake()
            await asyncio.to_thread(self.backend.load_memory_state, image)
        self.train_call, self.train_metrics = msg.train_call, dict(image.meta["metrics"])
        return SnapshotState(train_calls=calls, restored=msg.train_call,
                             restore_s=time.perf_counter() - t0)

    async def _ensure_publisher(self, engine_urls: list[str] | None = None):
        """Connect the transport (and on rank 0 the publisher) to `engine_urls`, by default the
        fleet's serving engines; a set other than the connected one closes and reconnects (every
        rank gets the same set from the driver, so every rank does the same)."""
        connected = getattr(self, "engine_urls", None)
        if engine_urls is None:
            if connected is not None:
                return self.publisher
            engines = await self.runtime.ref("engines").call(GetEngines(), timeout_s=600)
            engine_urls = engines.engine_urls
        if connected is not None and set(engine_urls) == set(connected):
            return self.publisher
        from miles.weights.publisher import WeightPublisher, make_transport

        cfg = self.recipe.weights
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None
        self.engine_urls = None
        if getattr(self, "transport", None) is None:
            self.transport = make_transport(cfg, rank=self.rank, recipe=self.recipe)
        else:  # the same object, so an nccl group rebuilt for the new set gets a fresh name
            await asyncio.to_thread(self.transport.close)
        await asyncio.to_thread(self.transport.connect, list(engine_urls))
        self.engine_urls = list(engine_urls)
        if self.rank.rank == 0:
            self.publisher = WeightPublisher(cfg, list(engine_urls), self.transport)
        return self.publisher

    async def on_publish_weights(self, msg: PublishWeights) -> Published:
        """Publish `msg.version` to `msg.engine_urls` (or the connected set). An engine that dies
        before or during it is dropped: the ranks agree on the survivors, reconnect and publish
        again (the gather is collective, so every rank repeats it); only with no engine left, or a
        failure that no death explains, does the publish fail."""
        version = msg.version
        targets = list(msg.engine_urls) or None

        def run_update() -> None:
            self.backend.update_weights(self.transport, version)

        async with self.lock:
            await self._wake()
            asked = list(targets or getattr(self, "engine_urls", None) or [])
            while True:
                try:
                    await self._ensure_publisher(targets)
                    error = None
                except Exception as e:  # noqa: BLE001 - settled by every rank below
                    error = e
                verdict = await self._settle(error, targets)
                if verdict[0] == "ok":
                    try:
                        if self.publisher is not None:
                            await self.publisher.publish(version, run_update)
                        else:
                            await asyncio.to_thread(run_update)
                        error = None
                    except Exception as e:  # noqa: BLE001
                        error = e
                    verdict = await self._settle(error, targets)
                    if verdict[0] == "ok":
                        await self._sleep()
                        dropped = sorted(set(asked) - set(self.engine_urls))
                        report = self.publisher.last_report if self.publisher is not None else None
                        return Published(detail=f"version {version}" + (
                            f"; dropped dead engines {dropped}" if dropped else ""),
                            metrics=report.metrics() if report is not None else {},
                            weight_digest=report.digest if report is not None else "",
                            engine_digests=dict(report.engine_digests) if report is not None else {})
                if verdict[0] == "fail":
                    raise RuntimeError(verdict[1])
                log.warning("publish of version %d failed (%s); engines %s do not answer: publishing "
                            "to the survivors %s", version, error, verdict[2], verdict[1])
                targets = verdict[1]

    async def _settle(self, error: Exception | None, targets: list[str] | None) -> tuple:
        """Every rank's outcome of one step -> one verdict for all: ("ok",), ("fail", message)
        or ("retry", survivors, dead). Rank 0 decides which engines survive."""
        from miles.weights.publisher import reachable_engines

        if error is None:
            verdict: tuple = ("ok",)
        else:
            verdict = ("fail", f"{type(error).__name__}: {error}")
            if self.rank.rank == 0:
                asked = list(targets or getattr(self, "engine_urls", None) or [])
                alive = await reachable_engines(asked, timeout_s=self.recipe.weights.control_timeout_s)
                if alive and len(alive) < len(asked):
                    verdict = ("retry", alive, sorted(set(asked) - set(alive)))
                elif not alive and asked:
                    verdict = ("fail", f"{verdict[1]} (no engine of {asked} answers any more)")
        if self.rank.world_size == 1:
            return verdict
        verdicts = await asyncio.to_thread(self._exchange, verdict)
        failed = [v for v in verdicts[1:] if v[0] == "fail"]
        return tuple(failed[0]) if failed else tuple(verdicts[0])

    def _exchange(self, verdict: tuple) -> list:
        """All-gather one small msgspec-encoded value per rank over a gloo group of its own."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if getattr(self, "_verdict_group", None) is None:
            w = self.recipe.weights
            self._verdict_group = dist.new_group(backend="gloo", timeout=timedelta(
                seconds=w.connect_timeout_s + w.transfer_timeout_s + w.check_timeout_s))
        data = msgspec.msgpack.encode(list(verdict))
        n = self.rank.world_size
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._verdict_group)
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(out, mine, group=self._verdict_group)
        return [msgspec.msgpack.decode(bytes(t[:int(s.item())].tolist())) for t, s in zip(out, sizes)]

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
        if getattr(self, "snapshot_bytes", 0):
            out["trainer/snapshot_bytes"] = float(self.snapshot_bytes)
        return out

    async def on_stop(self) -> None:
        await self._snapshot_done()
        if self.publisher is not None:
            await self.publisher.close()
        if getattr(self, "transport", None) is not None:
            await asyncio.to_thread(self.transport.close)
        if self.backend is not None:
            self.backend.close()


def open_snapshots(recipe, rank: int):
    """(this rank's SnapshotFile, "") with `loop.snapshot` and the node daemon's directory
    (`MILES_SNAPSHOT_DIR`), else (None, why not)."""
    if not recipe.loop.snapshot:
        return None, "loop.snapshot = false"
    folder = os.environ.get(ENV_DIR, "")
    if not folder or not os.path.isdir(folder):
        return None, (f"no snapshot keeper: {ENV_DIR} = {folder!r} is not a directory (the node "
                      "daemon that kept it is gone)")
    return SnapshotFile(os.path.join(folder, f"trainer-{rank}.snap")), ""


def build_backend(recipe, rank):
    """The recipe's training backend, initialised for `rank`: what every trainer rank builds,
    and what `miles replay` builds to re-run a recorded step offline."""
    from miles.backends.base import Offloadable, make_backend

    rl = phases_for(recipe)["rl"]
    backend = make_backend(recipe.train.backend)
    if recipe.train.sleep_between_steps and not isinstance(backend, Offloadable):
        raise ValueError(f"train.sleep_between_steps = true: train.backend = {recipe.train.backend!r} "
                         "is not Offloadable (no sleep / wake_up; miles/backends/base.py)")
    if recipe.quant.train != "bf16":  # miles/quant/train.py
        backend.quantize_training(recipe.quant)
    backend.init(rl.config, rank, rl.loss)
    return backend


def phases_for(recipe) -> dict:
    """The recipe's training phases by `TrainStep.phase`: "rl" and the SFT warm-start "sft"."""
    from miles.backends.base import TrainPhase

    algo, train = recipe.algo, recipe.train
    if algo.max_response_tokens == 0:
        # Dr. GRPO's constant is the generation budget, which only the rollout section knows.
        algo = msgspec.structs.replace(algo, max_response_tokens=recipe.rollout.max_new_tokens)
    sft_loss = msgspec.structs.replace(algo, loss_type="sft")
    # The warm-start's own schedule: a constant sft.lr (RL's warmup and decay are RL's steps).
    sft_cfg = msgspec.structs.replace(train, lr=recipe.sft.lr, min_lr=min(train.min_lr, recipe.sft.lr),
                                      warmup_steps=0, lr_decay_style="constant", lr_decay_steps=0,
                                      old_logprobs="auto")
    return {"rl": TrainPhase("rl", algo, train), "sft": TrainPhase("sft", sft_loss, sft_cfg)}
