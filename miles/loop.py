"""THE RL LOOP. Read `LoopDriver.run` top to bottom: it is the whole algorithm.

    warm-start (SFT), publish, evaluate
    start rollout                      (the RolloutWorker fills the buffer on its own)
    for each step:
        batch   <- buffer              (waits here: trainer idle time)
        train on batch                 (all trainer ranks)
        publish weights version+1      (engines pause in place, never abort)
        tell the buffer the version    (opens admission for newer groups)
        evaluate / checkpoint now and then

The three modes differ only in where the rollout waits, and that is one number: how many
versions a group may lag when it is trained (`loop.mode` sync = 0, one_step_off = 1,
fully_async = `loop.max_staleness`). The buffer admits a new group only if it can be trained
within that lag, so with 0 the engines generate a batch, wait for the new weights, generate the
next (on-policy); with k > 0 they keep generating while the trainer trains.

Design decisions:
- The driver is an actor like the others (`actors.driver`, main = true): its exit ends the job.
- Samples flow rollout -> buffer -> driver -> trainers over ZeroMQ with arrays as raw frames;
  weights never go through here (the trainer publishes them by NCCL / IPC / disk).
- Checkpoints hold the trainer state plus the loop's own (step, version, data position, and the
  prompts already read but not yet trained: in flight in the rollout worker or held by the
  buffer); on start the newest complete checkpoint in the run directory is resumed, those prompts
  are generated again first, and a SIGINT'ed run continues where it stopped with no prompt lost.
- Evaluation is asynchronous in fully-async mode (its result is logged when it arrives, with its
  lag) and a failed evaluation is logged and skipped, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np

from miles.actors.base import Actor
from miles.rl.logger import MetricsLogger
from miles.wire.messages import (BufferMetricsRequest, Evaluate, GetBatch, GetEngines,
                                 GetMetrics, GetQueuedPrompts, GetRolloutState, LoadCheckpoint,
                                 PublishWeights,
                                 Sample, SaveCheckpoint, SetVersion, StartRollout, StopRollout,
                                 TrainStep)


class LoopDriver(Actor):
    async def run(self) -> int:
        r = self.recipe
        await self.connect()
        step, version, data_state, replay = await self.resume_or_warm_start()
        self.log = MetricsLogger(r.output_dir, r.logging, r.loop.num_steps, r.run.name, resume=step > 0)
        if self.log.bar is not None:
            self.log.bar.update(step)  # a resumed run shows the steps it already has
        await self.evaluate(step, version, wait=True)
        await self.buffer.call(SetVersion(version=version))
        await self.rollout.call(StartRollout(data_state=data_state, replay=replay))

        for step in range(step + 1, r.loop.num_steps + 1):
            batch = await self.buffer.call(GetBatch(n_groups=r.loop.groups_per_step),
                                           timeout_s=r.loop.timeout_s)
            t0 = time.monotonic()
            train_metrics = await self.train([s for g in batch.groups for s in g.samples])
            train_s = time.monotonic() - t0
            version += 1
            await self.publish(version)
            await self.buffer.call(SetVersion(version=version))
            self.log_step(step, version, batch, train_metrics, train_s, time.monotonic() - t0)
            if r.loop.eval_every and step % r.loop.eval_every == 0 and step < r.loop.num_steps:
                await self.evaluate(step, version, wait=r.loop.mode == "sync")
            if r.loop.save_every and step % r.loop.save_every == 0:
                await self.checkpoint(step, version)

        await self.rollout.call(StopRollout())
        if not (r.loop.save_every and r.loop.num_steps % r.loop.save_every == 0):
            await self.checkpoint(r.loop.num_steps, version)
        await self.evaluate(r.loop.num_steps, version, wait=True)
        await asyncio.gather(*self.pending_evals)
        png = self.log.close(plot=r.logging.plot)
        print(json.dumps({"done": True, "steps": r.loop.num_steps, "version": version,
                          "reward_curve": str(png) if png else None}), flush=True)
        return 0

    # ----- the pieces the loop is made of --------------------------------------------------------

    async def connect(self) -> None:
        rt, r = self.runtime, self.recipe
        self.buffer, self.rollout = rt.ref("buffer"), rt.ref("rollout")
        self.evaluator = rt.ref("evaluator") if "evaluator" in r.actors else None
        spec = r.actors["trainer"]
        world = len(spec.nodes or [spec.node]) * spec.procs_per_node
        self.trainers = [rt.ref(f"trainer/{i}") for i in range(world)]
        for ref in [*self.trainers, self.buffer, self.rollout]:
            await rt.lookup(ref.name, wait_s=r.engine.start_timeout_s)
        await rt.ref("engines").call(GetEngines(), timeout_s=r.engine.start_timeout_s)
        self.pending_evals: list[asyncio.Task] = []
        self.ckpt_root = Path(r.output_dir) / "checkpoints"

    async def on_all_trainers(self, msg, timeout_s: float | None = None) -> list:
        timeout_s = timeout_s or self.recipe.loop.timeout_s
        return await asyncio.gather(*(t.call(msg, timeout_s=timeout_s) for t in self.trainers))

    async def train(self, samples: list[Sample], phase: str = "rl") -> dict[str, float]:
        results = await self.on_all_trainers(TrainStep(samples=samples, phase=phase))
        return results[0].metrics

    async def publish(self, version: int) -> None:
        await self.on_all_trainers(PublishWeights(version=version))

    async def resume_or_warm_start(self) -> tuple[int, int, dict, list[int]]:
        r = self.recipe
        latest = self.latest_checkpoint() if r.loop.resume else None
        if latest is not None:
            states = await self.on_all_trainers(LoadCheckpoint(path=str(latest)))
            state = states[0].extra_state
            print(f"[driver] resumed from {latest} at step {state['step']}", flush=True)
            await self.publish(int(state["version"]))  # engines get the resumed weights
            return (int(state["step"]), int(state["version"]), dict(state.get("data_state", {})),
                    [int(i) for i in state.get("replay_prompts", [])])
        version = 0
        if r.sft.steps:
            await self.warm_start()
            version = 1
            await self.publish(version)
        return 0, version, {}, []

    async def warm_start(self) -> None:
        """A short supervised warm-start on prompt/answer pairs (loss on the answer only)."""
        from miles.rl.sources import make_source, tokenizer_for

        r = self.recipe
        # Loading a tokenizer imports transformers: seconds on a cold machine. Off the event loop,
        # or this actor misses its heartbeats.
        tok = await asyncio.to_thread(tokenizer_for, r.model.path)
        source = await asyncio.to_thread(make_source, r, "sft")
        t0 = time.monotonic()
        for i in range(r.sft.steps):
            samples = []
            for _ in range(r.sft.batch_size):
                p = next(source)
                prompt = tok.encode(p.prompt, add_special_tokens=False)
                answer = tok.encode(p.label, add_special_tokens=False) + [tok.eos_token_id]
                samples.append(Sample(tokens=np.asarray(prompt + answer, np.int32),
                                      response_length=len(answer), loss_mask=np.ones(len(answer), np.uint8),
                                      rollout_id=f"sft{i}-{len(samples)}", status="completed", reward=0.0))
            metrics = await self.train(samples, phase="sft")
        print(json.dumps({"sft_steps": r.sft.steps, "sft_loss": round(metrics.get("loss", float("nan")), 4),
                          "sft_s": round(time.monotonic() - t0, 1)}), flush=True)

    async def evaluate(self, step: int, version: int, wait: bool) -> None:
        if self.evaluator is None or self.recipe.eval.mode == "off":
            return
        ckpt = ""
        if self.recipe.eval.mode in ("fleet", "external"):
            ckpt = str(await self.checkpoint(step, version, hf=True))

        async def run() -> None:
            result = await self.evaluator.call(Evaluate(step=step, version=version, checkpoint_dir=ckpt),
                                               timeout_s=self.recipe.eval.timeout_s + 30)
            extra = {"version": result.version, "eval_lag_s": round(result.lag_s, 3)}
            if result.ok:
                self.log.log("eval", step, result.metrics, **extra)
            else:
                self.log.log("eval_failed", step, {"error": result.error}, **extra)

        task = asyncio.get_running_loop().create_task(run())
        if wait:
            await task
        else:
            self.pending_evals.append(task)

    def latest_checkpoint(self) -> Path | None:
        root = Path(self.recipe.output_dir) / "checkpoints"
        done = sorted((p for p in root.glob("step_*") if (p / "loop_state.json").exists()),
                      key=lambda p: int(p.name.split("_")[1]))
        return done[-1] if done else None

    async def checkpoint(self, step: int, version: int, hf: bool = False) -> Path:
        path = self.ckpt_root / f"step_{step:06d}"
        # The rollout first, then the buffer: a group that moves between them meanwhile is in the
        # buffer's queue by the time it is asked (no batch is taken during a checkpoint).
        state = await self.rollout.call(GetRolloutState())
        queued = await self.buffer.call(GetQueuedPrompts())
        extra = {"step": step, "version": version, "data_state": state.data_state,
                 "replay_prompts": sorted(set(state.in_flight) | set(queued.indices))}
        await self.on_all_trainers(SaveCheckpoint(path=str(path), extra_state=extra))
        if hf:
            await self.on_all_trainers(SaveCheckpoint(path=str(path / "hf"), hf=True))
        (path / "loop_state.json").write_text(json.dumps(extra))  # written last: marks it complete
        return path

    def log_step(self, step, version, batch, train_metrics, train_s, step_s) -> None:
        rewards = [float(next(iter(s.reward.values())) if isinstance(s.reward, dict) else s.reward or 0.0)
                   for g in batch.groups for s in g.samples]
        lengths = [s.response_length for g in batch.groups for s in g.samples]
        metrics = {**{f"train/{k}": v for k, v in train_metrics.items()},
                   "rollout/reward": float(np.mean(rewards)), "rollout/response_len": float(np.mean(lengths)),
                   "perf/train_s": train_s, "perf/step_s": step_s,
                   "batch/staleness_avg": float(np.mean(batch.staleness)) if batch.staleness else 0.0}
        self.log.log("train", step, metrics, version=version)
        asyncio.get_running_loop().create_task(self._log_actor_metrics(step))

    async def _log_actor_metrics(self, step: int) -> None:
        try:
            buf = await self.buffer.call(BufferMetricsRequest(), timeout_s=10)
            roll = await self.rollout.call(GetMetrics(), timeout_s=10)
            keep = {k: v for k, v in {**buf.values, **roll.values}.items() if "/" in k}
            self.log.log("actors", step, keep)
        except Exception as e:  # metrics are best effort
            print(f"[driver] actor metrics unavailable: {e}", flush=True)
