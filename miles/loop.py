"""THE RL LOOP. Read `LoopDriver.run` top to bottom: it is the whole algorithm.

    warm-start (SFT), publish, evaluate
    start rollout                      (the RolloutWorker fills the buffer on its own)
    for each step:
        batch   <- buffer              (waits here: trainer idle time; restarted engines get weights)
        train on batch                 (all trainer ranks)
        confirm the batch              (the buffer forgets it: trained exactly once)
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
  weights never go through here (the trainer publishes them by NCCL / IPC / disk). The batch is
  sharded here (`shard_batch`, by the backends' own batch plan, computed once): each trainer
  rank receives only the samples its data-parallel index trains (log-probs and R3 routing with
  them) plus a few bytes per sample of the whole batch (`BatchIndex`), so bytes per rank per
  step are O(batch / DP), not O(batch).
- Checkpoints hold the trainer state plus the loop's own (step, version, data position, and the
  prompts already read but not yet trained: in flight in the rollout worker or held by the
  buffer); on start the newest complete checkpoint in the run directory is resumed, those prompts
  are generated again first, and a SIGINT'ed run continues where it stopped with no prompt lost.
- Evaluation is asynchronous in fully-async mode (its result is logged when it arrives, with its
  lag) and a failed evaluation is logged and skipped, never fatal. Fleet and external evaluation
  read HF weights written to `<output_dir>/eval/step_NNNNNN` (not a resume point).
- Batches are two-phase: `GetBatch` names a request id and the groups stay the buffer's until
  `ConfirmBatch` after the train step, so a buffer that dies before or after handing a batch out
  (it restarts from its journal) loses nothing and trains nothing twice: the driver waits for the
  new incarnation, re-sends `SetVersion` and then the same request.
- While it waits for a batch (the trainers are idle then) the driver polls the fleet every
  `engine.health_interval_s`; when the engine set changed (a restarted engine waits for weights)
  every trainer rank publishes the current version to the new set, then the fleet is told
  (`EnginesUpdated`). In sync mode with one engine nothing else would ever give it weights.
- A trainer rank that dies is healed (`loop.snapshot`, miles/rl/heal.py): the node daemon
  restarts its process group, every rank restores its in-memory snapshot of the last train
  call, the step in flight is trained again if it was not in the snapshot yet, and the call that
  failed is re-sent. Where no snapshot can do it, the job ends with exit code 75
  (`RESUME_EXIT_CODE`) and `miles run` starts it again from the newest disk checkpoint by itself
  (`loop.auto_resumes` times); the prompts in flight at that checkpoint are generated again, so
  nothing accepted is lost. The driver's own death ends the job (resume by hand).
- A restarted rollout worker resumes by itself from the buffer's journal (see `actors/rollout.py`);
  the driver's calls to it are idempotent and re-sent after a restart.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import numpy as np

from miles.actors.buffer import rollout_rewards
from miles.backends.batch import batch_arrays
from miles.backends.batch_plan import sample_owners
from miles.backends.config import trainer_dp_layout
from miles.rl.heal import MAX_HEALS_PER_CALL, Healer, TrainerDied, gather_or_cancel
from miles.rl.logger import MetricsLogger
from miles.rl.otel import NOOP, step_spans, telemetry
from miles.rl.provenance import ProvenanceLog
from miles.rl.sft import EpochLoss, REPRODUCTION_ROWS, reproduction, sft_sample
from miles.rl.sources import make_source, tokenizer_for
from miles.runtime import Actor, ActorDied, ActorTimeout, RemoteError
from miles.wire.messages import (Batch, BatchIndex, BufferMetricsRequest, ConfirmBatch, Drain,
                                 EnginesUpdated, Evaluate, GetBatch, GetEngines, GetMetrics,
                                 GetQueuedPrompts, GetRolloutState, LoadCheckpoint, Message, Ok,
                                 PublishWeights, Sample, SaveCheckpoint, SetVersion, StartJob,
                                 StartRollout, StopRollout, TrainStep)

ACTOR_RETRIES = 3    # re-sends of an idempotent call after the actor restarted


RESUME_EXIT_CODE = 75  # EX_TEMPFAIL: `miles run` starts the job again from its newest checkpoint


ACTOR_COUNTERS = ("calls", "tells", "handler_errors", "cancelled")


def actor_counters(name: str, values: dict) -> dict[str, float]:
    """An actor's own message counters (Actor.metrics) as `actor/<name>/<counter>` metrics, which
    the node daemon's /metrics exports as miles_actor_<counter>_total{actor=...}."""
    return {f"actor/{name}/{k}": float(values[k]) for k in ACTOR_COUNTERS if k in values}


FILTER_WARN_S = 60.0  # a step waiting this long for its batch says whether the filter starves it
                     # (or half of loop.timeout_s, when that is sooner)


class Drained(Exception):
    """The wait for a batch was abandoned: the job drains (SIGTERM / SIGUSR1)."""


class LoopDriver(Actor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drain_reason, self.drain_asked = "", asyncio.Event()
        self.telemetry = NOOP   # logging.otel's spans, set at start (a driver built in parts has none)

    async def run(self) -> int:
        try:
            return await self.run_loop()
        except TrainerDied as e:
            latest = self.latest_checkpoint()
            print(f"[driver] {e}; the trainer group cannot continue: the job restarts from "
                  f"{latest or 'the beginning (no checkpoint yet)'} (exit code {RESUME_EXIT_CODE})",
                  flush=True)
            return RESUME_EXIT_CODE

    async def run_loop(self) -> int:
        r = self.recipe
        await self.connect()
        if r.logging.provenance:   # before the first publish: versions.jsonl lists it
            fresh = not (r.loop.resume and self.latest_checkpoint() is not None)
            self.provenance = ProvenanceLog(r.output_dir, fresh=fresh)
        step, self.version, data_state, replay = await self.resume_or_warm_start()
        self.log = MetricsLogger(r.output_dir, r.logging, r.loop.num_steps, r.run.name, resume=step > 0)
        for sft_step, metrics in self.sft_records:   # the warm start's, phase "sft"
            self.log.log("sft", sft_step, metrics)
        await self.evaluate(step, self.version, wait=True)
        await self.buffer_call(SetVersion(version=self.version))
        await self.buffer_call(StartJob(resumed_step=step, fresh=step == 0 and not self.resumed,
                                        driver=self.run_id))
        await self.rollout.call(StartRollout(data_state=data_state, replay=replay),
                                retries=ACTOR_RETRIES)

        for step in range(step + 1, r.loop.num_steps + 1):
            if self.drain_asked.is_set():
                return await self.drain(step - 1)
            await self.start_recording(step)
            self.step = step
            t_wait = time.monotonic()
            try:
                batch, request_id = await self.next_batch(step)
            except Drained:  # abandoned while it waited for its batch: nothing trained, nothing lost
                return await self.drain(step - 1)
            t0, wall0 = time.monotonic(), time.time()
            samples = [s for g in batch.groups for s in g.samples]
            train_metrics = await self.train(samples)
            train_s = time.monotonic() - t0
            await self.buffer_call(ConfirmBatch(request_id=request_id, step=step))
            lineage = self.provenance.write(step, samples) if self.provenance is not None else {}
            self.version += 1
            t_pub = time.monotonic()
            weights = await self.publish(self.version)
            await self.buffer_call(SetVersion(version=self.version))
            times = {"perf/wait_s": t0 - t_wait, "perf/publish_s": time.monotonic() - t_pub, **weights,
                     **lineage}
            self.log_step(step, self.version, batch, train_metrics, train_s, time.monotonic() - t0, times)
            if self.telemetry.enabled:
                step_spans(self.telemetry, step, self.version, samples, wall0, train_s, t_pub - t0,
                           times, self.recipe.weights.transport, self.provenance)
            if r.loop.eval_every and step % r.loop.eval_every == 0 and step < r.loop.num_steps:
                await self.evaluate(step, self.version, wait=r.loop.mode == "sync")
            if r.loop.save_every and step % r.loop.save_every == 0:
                await self.checkpoint(step, self.version)

        if self.runtime.recorder is not None:
            self.runtime.recorder.step = 0
            self.runtime.recorder.close()
        await self.rollout.call(StopRollout(), retries=ACTOR_RETRIES)
        if not (r.loop.save_every and r.loop.num_steps % r.loop.save_every == 0):
            await self.checkpoint(r.loop.num_steps, self.version)
        await self.evaluate(r.loop.num_steps, self.version, wait=True)
        await asyncio.gather(*self.pending_evals)
        png = await asyncio.to_thread(self.log.close, plot=r.logging.plot)  # matplotlib takes ~1 s
        await asyncio.to_thread(self.telemetry.close)
        print(json.dumps({"done": True, "steps": r.loop.num_steps, "version": self.version,
                          "reward_curve": str(png) if png else None}), flush=True)
        return 0

    # ----- the pieces the loop is made of --------------------------------------------------------

    def on_drain(self, msg: Drain) -> Ok:
        """SIGTERM / SIGUSR1 reached the node daemon: the loop drains at its next step boundary,
        or abandons the wait for a batch (module docstring)."""
        self.drain_reason = msg.reason or "asked"
        self.drain_asked.set()
        return Ok(detail="draining")

    async def drain(self, step: int) -> int:
        """Stop the rollout, checkpoint `step` (its prompts read but not trained are in it),
        say in one line that the run is resumable, and end the job with exit code 0."""
        t0 = time.monotonic()
        await self.rollout.call(StopRollout(), retries=ACTOR_RETRIES)
        path = self.ckpt_root / f"step_{step:06d}"
        if step > 0 and not (path / "loop_state.json").exists():
            path = await self.checkpoint(step, self.version)
        where = f"the checkpoint {path}" if step > 0 else "the start (no step trained yet)"
        print(json.dumps({"drained": True, "step": step, "version": self.version,
                          "checkpoint": str(path) if step > 0 else None,
                          "drain_s": round(time.monotonic() - t0, 2)}), flush=True)
        print(f"[driver] drained on {self.drain_reason} after step {step}: resumable from {where}; "
              f"run the same command again to resume", flush=True)
        if getattr(self, "log", None) is not None:
            await asyncio.to_thread(self.log.close, plot=False)
        return 0

    async def connect(self) -> None:
        rt, r = self.runtime, self.recipe
        self.buffer, self.rollout = rt.ref("buffer"), rt.ref("rollout")
        self.evaluator = rt.ref("evaluator") if "evaluator" in r.actors else None
        spec = r.actors["trainer"]
        world = len(spec.nodes or [spec.node]) * spec.procs_per_node
        self.trainers = [rt.ref(f"trainer/{i}") for i in range(world)]
        self.healer = Healer(self)
        for ref in [*self.trainers, self.buffer, self.rollout]:
            await rt.lookup(ref.name, wait_s=r.engine.start_timeout_s)
        self.engines = rt.ref("engines")
        engine_set = await self.engines.call(GetEngines(), timeout_s=r.engine.start_timeout_s,
                                             retries=ACTOR_RETRIES)
        self.engine_generation = engine_set.generation
        self.run_id = uuid.uuid4().hex[:8]  # batch request ids are unique to this driver
        self.version = 0
        self.sft_records: list[tuple[int, dict]] = []   # (step, metrics) of the warm start
        self.pending_evals: list[asyncio.Task] = []
        self.ckpt_root = Path(r.output_dir) / "checkpoints"
        self.provenance: ProvenanceLog | None = None   # logging.provenance (run_loop opens it)
        self.telemetry = telemetry(r, "driver")        # logging.otel (NOOP when "none")
        self.step = 0                                  # the step in flight (provenance rows)
        if r.logging.record_wire:
            from miles.wire.recorder import WireRecorder
            rt.recorder = WireRecorder(Path(r.output_dir) / "wire" / "driver.mlw",
                                       set(r.logging.record_steps) or None)

    async def start_recording(self, step: int) -> None:
        """The flight recorder (`logging.record_wire`): before a recorded step the trainers save
        the state they train it from (`wire/step_NNNNNN/pre_state`), then every call of the step
        and its reply are written to `wire/driver.mlw`; `miles replay` re-runs it from both."""
        rec = self.runtime.recorder
        if rec is None:
            return
        rec.step = 0
        if rec.wants(step):
            pre = rec.path.parent / f"step_{step:06d}" / "pre_state"
            await self.on_all_trainers(SaveCheckpoint(path=str(pre), extra_state={"step": step - 1}))
        rec.step = step

    async def on_all_trainers(self, msg, timeout_s: float | None = None) -> list:
        """`msg` to every trainer rank, or `msg[i]` to rank i when it is a list. A rank that dies
        meanwhile is healed from the in-memory snapshots and the call re-sent (`miles/rl/heal.py`);
        where that cannot be, `TrainerDied` ends the job for a restart from disk."""
        timeout_s = timeout_s or self.recipe.loop.timeout_s
        msgs = msg if isinstance(msg, list) else [msg] * len(self.trainers)
        for heals in range(MAX_HEALS_PER_CALL + 1):
            try:
                return await gather_or_cancel([t.call(m, timeout_s=timeout_s)
                                               for t, m in zip(self.trainers, msgs)])
            except ActorDied as e:
                if heals == MAX_HEALS_PER_CALL:
                    raise TrainerDied(f"{e} (healed {heals} times during this call already)") from None
                record = await self.healer.heal(e, type(msgs[0]).__name__)
                if getattr(self, "log", None) is not None:
                    self.log.log("heal", self.healer.train_call, record)
        raise AssertionError("unreachable")

    async def train(self, samples: list[Sample], phase: str = "rl") -> dict[str, float]:
        msgs = self.healer.stamp(shard_batch(samples, self.recipe.train, len(self.trainers), phase))
        results = await self.on_all_trainers(msgs)
        return results[0].metrics

    async def buffer_call(self, msg: Message, timeout_s: float = 60.0) -> Message:
        """A buffer call that survives buffer restarts: wait for the new incarnation (it has
        its journal), tell it the version again, re-send the (idempotent) message."""
        for restarts in range(ACTOR_RETRIES + 1):
            try:
                return await self.buffer.call(msg, timeout_s=timeout_s)
            except ActorDied as e:
                if restarts == ACTOR_RETRIES:
                    raise
                print(f"[driver] {e}; waiting for its restart", flush=True)
                incarnation = await self.buffer.wait_restarted(self.recipe.engine.start_timeout_s)
                print(f"[driver] buffer incarnation {incarnation}: re-sending SetVersion("
                      f"{self.version}) and {type(msg).__name__}", flush=True)
                await self.buffer.call(SetVersion(version=self.version), retries=ACTOR_RETRIES)
        raise AssertionError("unreachable")

    async def next_batch(self, step: int) -> tuple[Batch, str]:
        """Wait for the step's batch; meanwhile give restarted engines the current weights."""
        r = self.recipe
        request_id = f"{self.run_id}-step{step}"
        get = asyncio.get_running_loop().create_task(self.buffer_call(
            GetBatch(n_groups=r.loop.groups_per_step, request_id=request_id),
            timeout_s=r.loop.timeout_s))
        start = await self.filter_counts()
        waited, warn_s = time.monotonic(), min(FILTER_WARN_S, r.loop.timeout_s / 2)
        try:
            while not (await asyncio.wait({get}, timeout=r.engine.health_interval_s))[0]:
                if self.drain_asked.is_set():
                    raise Drained()
                await self.sync_engines()
                if time.monotonic() - waited >= warn_s:  # say why the batch is not filling
                    waited = time.monotonic()
                    why = self.starving(start, await self.filter_counts())
                    if why:
                        print(f"step {step}: still waiting for a batch: {why}", flush=True)
            return get.result(), request_id
        except ActorTimeout:
            why = self.starving(start, await self.filter_counts())
            raise TimeoutError(f"step {step}: no batch of {r.loop.groups_per_step} groups from the "
                               f"buffer within loop.timeout_s = {r.loop.timeout_s} s"
                               + (f": {why}" if why else "")) from None
        finally:
            get.cancel()

    async def filter_counts(self) -> tuple[float, float] | None:
        """(kept, filtered) groups so far, from the buffer; None when it does not answer at once."""
        try:
            values = (await self.buffer.call(BufferMetricsRequest(), timeout_s=5.0)).values
            return values.get("buffer/kept", 0.0), values.get("buffer/filtered", 0.0)
        except Exception:  # noqa: BLE001 - a diagnostic only; the wait itself goes on
            return None

    def starving(self, start, now) -> str:
        """Why no batch fills, when `buffer.filter` drops (nearly) every group the rollout makes."""
        if start is None or now is None:
            return ""
        kept, filtered = now[0] - start[0], now[1] - start[1]
        if filtered < 4 * self.recipe.loop.groups_per_step or kept >= filtered / 20:
            return ""
        return (f"buffer.filter = {self.recipe.buffer.filter!r} dropped {filtered:.0f} groups and "
                f"kept {kept:.0f} meanwhile (every sample of a group got the same reward: the "
                "policy solves none, or all, of its prompts)")

    async def sync_engines(self) -> None:
        try:
            # a restarted fleet (a new incarnation) answers once its engines are up
            engine_set = await self.engines.call(
                GetEngines(), timeout_s=self.recipe.engine.start_timeout_s, retries=ACTOR_RETRIES)
            if engine_set.generation == self.engine_generation:
                return
            urls = [*engine_set.engine_urls, *engine_set.pending_urls]
            if not urls:  # an empty set means "the connected one" to the trainers: wait instead
                return
            print(f"[driver] engine set generation {engine_set.generation}: publishing version "
                  f"{self.version} to {urls}", flush=True)
            await self.on_all_trainers(PublishWeights(version=self.version, engine_urls=urls))
            await self.engines.call(EnginesUpdated(generation=engine_set.generation,
                                                   version=self.version), timeout_s=60.0,
                                    retries=ACTOR_RETRIES)
            self.engine_generation = engine_set.generation
        except (ActorDied, ActorTimeout, RemoteError, ConnectionError) as e:  # again next interval
            print(f"[driver] engine set sync failed, retrying: {type(e).__name__}: {e}", flush=True)

    async def publish(self, version: int) -> dict[str, float]:
        """Every trainer rank publishes `version`; returns rank 0's `weights/...` metrics (stall
        time and its parts)."""
        def get_engines():  # retried across a fleet restart
            return self.engines.call(GetEngines(), timeout_s=self.recipe.engine.start_timeout_s,
                                     retries=ACTOR_RETRIES)
        engine_set = await get_engines()
        deadline = time.monotonic() + self.recipe.engine.start_timeout_s
        while not (engine_set.engine_urls or engine_set.pending_urls):  # every engine restarting
            if time.monotonic() > deadline:
                raise TimeoutError(f"publish of version {version}: no engine came back within "
                                   f"engine.start_timeout_s = {self.recipe.engine.start_timeout_s} s")
            await asyncio.sleep(self.recipe.engine.health_interval_s)
            engine_set = await get_engines()
        while True:
            try:
                replies = await self.on_all_trainers(PublishWeights(
                    version=version, engine_urls=[*engine_set.engine_urls, *engine_set.pending_urls]))
                break
            except RemoteError as e:
                # Every engine died around the publish: the fleet restarts them, and a restarted
                # engine comes back pending; publish to it then. Any other failure is fatal.
                if "answers any more" not in str(e) or time.monotonic() > deadline:
                    raise
                print(f"[driver] publish of version {version}: no engine answers; waiting for "
                      f"the fleet to restart one", flush=True)
                while True:
                    await asyncio.sleep(self.recipe.engine.health_interval_s)
                    fresh = await get_engines()
                    if fresh.generation != engine_set.generation and (fresh.engine_urls or fresh.pending_urls):
                        engine_set = fresh
                        break
                    if time.monotonic() > deadline:
                        raise
        if self.provenance is not None:
            self.provenance.published(version, self.step, self.recipe.weights.transport, replies[0])
        if engine_set.generation != self.engine_generation:
            await self.engines.call(EnginesUpdated(generation=engine_set.generation,
                                                   version=version), timeout_s=60.0,
                                    retries=ACTOR_RETRIES)
            self.engine_generation = engine_set.generation
        return dict(getattr(replies[0], "metrics", None) or {})

    async def resume_or_warm_start(self) -> tuple[int, int, dict, list[int]]:
        r = self.recipe
        latest = self.latest_checkpoint() if r.loop.resume else None
        # a job after one that died before its first checkpoint: its ledger rolls back all of it
        self.resumed = r.loop.resume and (Path(r.output_dir) / "buffer" / "ledger.bin").exists()
        if latest is not None:
            states = await self.on_all_trainers(LoadCheckpoint(path=str(latest)))
            state = states[0].extra_state
            print(f"[driver] resumed from {latest} at step {state['step']}", flush=True)
            await self.publish(int(state["version"]))  # engines get the resumed weights
            return (int(state["step"]), int(state["version"]), dict(state.get("data_state", {})),
                    [int(i) for i in state.get("replay_prompts", [])])
        version = 0
        if r.sft.steps:
            version = 1
            await self.warm_start(version)
        return 0, version, {}, []

    async def warm_start(self, version: int) -> None:
        """A supervised warm start on prompt/answer pairs (loss on the answer only), rows
        reshuffled per epoch; published as `version`, then judged (`miles.rl.sft`): the mean loss
        of each epoch, greedy reproduction and summed NLL per row under the published weights."""

        r = self.recipe
        # Loading a tokenizer imports transformers: seconds on a cold machine. Off the event loop,
        # or this actor misses its heartbeats.
        tok = await asyncio.to_thread(tokenizer_for, r.model.path)
        source = await asyncio.to_thread(make_source, r, "sft")
        t0 = time.monotonic()
        epochs, records = EpochLoss(), []
        steps, stop = 0, f"sft.steps = {r.sft.steps}"
        for i in range(r.sft.steps):
            epoch = source.position // len(source.rows)
            samples = [sft_sample(tok, next(source), f"sft{i}-{j}") for j in range(r.sft.batch_size)]
            metrics = await self.train(samples, phase="sft")
            steps = i + 1
            done = epochs.add(epoch, metrics.get("loss", float("nan")))
            if done:
                records.append((i, done))
            if (r.sft.until_heldout and steps >= r.sft.check_from and steps % r.sft.check_every == 0
                    and steps < r.sft.steps):
                solved = await self.heldout_check(version)
                records.append((steps, {"sft/heldout_pass@1": solved, "sft/s": time.monotonic() - t0}))
                print(f"[driver] warm start step {steps} ({time.monotonic() - t0:.0f} s): held-out "
                      f"pass@1 {solved:.3f} (sft.until_heldout = {r.sft.until_heldout})", flush=True)
                if solved >= r.sft.until_heldout:
                    stop = f"held-out pass@1 {solved:.3f} >= sft.until_heldout"
                    break
        end = epochs.close() if epochs.losses else {}
        sft_s = time.monotonic() - t0
        await self.publish(version)
        engine_set = await self.engines.call(GetEngines(), timeout_s=r.engine.start_timeout_s,
                                             retries=ACTOR_RETRIES)
        rows = [source.at(k) for k in range(min(len(source.rows), REPRODUCTION_ROWS))]
        judged = await reproduction(engine_set.gateway_url, tok, rows)
        summary = {**end, **judged, "sft/steps": float(steps), "sft/last_loss":
                   float(metrics.get("loss", float("nan"))), "sft/s": sft_s}
        self.sft_records = [*records, (steps, {**summary, "sft/stop": stop})]
        print(json.dumps({"sft_steps": steps, "sft_stop": stop,
                          "sft_loss": round(summary["sft/last_loss"], 4),
                          "sft_loss_epoch": round(end.get("sft/loss_epoch", float("nan")), 4),
                          "sft_row_nll": round(judged["sft/row_nll"], 3),
                          "sft_greedy_reproduced": round(judged["sft/greedy_reproduced"], 3),
                          "sft_s": round(sft_s, 1)}), flush=True)

    async def heldout_check(self, version: int) -> float:
        """`sft.until_heldout`: publish the warm start's weights so far (as `version`, which the
        end of the warm start publishes again) and evaluate them as the step-0 eval would;
        eval/pass@1, or 0 when that evaluation failed (the warm start goes on)."""
        await self.publish(version)
        result = await self.evaluator.call(Evaluate(step=0, version=version),
                                           timeout_s=self.recipe.eval.timeout_s + 30,
                                           retries=ACTOR_RETRIES)
        if not result.ok:
            print(f"[driver] warm-start held-out check failed: {result.error}", flush=True)
            return 0.0
        return float(result.metrics.get("eval/pass@1", 0.0))

    async def evaluate(self, step: int, version: int, wait: bool) -> None:
        if self.evaluator is None or self.recipe.eval.mode == "off":
            return
        ckpt = ""
        if self.recipe.eval.mode in ("fleet", "external"):  # HF weights only: not a resume point
            path = Path(self.recipe.output_dir) / "eval" / f"step_{step:06d}"
            await self.on_all_trainers(SaveCheckpoint(path=str(path), hf=True))
            ckpt = str(path)

        async def run() -> None:
            t_start = time.time()
            try:  # a restarted evaluator gets the request again; any failure skips this point
                result = await self.evaluator.call(
                    Evaluate(step=step, version=version, checkpoint_dir=ckpt),
                    timeout_s=self.recipe.eval.timeout_s + 30, retries=ACTOR_RETRIES)
            except Exception as e:  # noqa: BLE001 - never fatal (module docstring)
                self.log.log("eval_failed", step, {"error": f"{type(e).__name__}: {e}"},
                             version=version)
                return
            extra = {"version": result.version, "eval_lag_s": round(result.lag_s, 3)}
            self.telemetry.span("miles.eval", t_start, time.time(), {
                "miles.step": step, "miles.policy_version": result.version, "miles.eval.ok": result.ok,
                **{f"miles.{k}": v for k, v in result.metrics.items()}})
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

    async def checkpoint(self, step: int, version: int) -> Path:
        path = self.ckpt_root / f"step_{step:06d}"
        # The rollout first, then the buffer: a group that moves between them meanwhile is in the
        # buffer's queue by the time it is asked (no batch is taken during a checkpoint).
        state = await self.rollout.call(GetRolloutState(), retries=ACTOR_RETRIES)
        queued = await self.buffer_call(GetQueuedPrompts())
        extra = {"step": step, "version": version, "data_state": state.data_state,
                 "replay_prompts": sorted(set(state.in_flight) | set(queued.indices))}
        await self.on_all_trainers(SaveCheckpoint(path=str(path), extra_state=extra))
        (path / "loop_state.json").write_text(json.dumps(extra))  # written last: marks it complete
        return path

    def log_step(self, step, version, batch, train_metrics, train_s, step_s, times=None) -> None:
        key = self.recipe.train.reward_key
        # One reward per rollout: a trajectory tree split into 5 samples is still one episode.
        rewards = [r for g in batch.groups for r in rollout_rewards(g, key)]
        lengths = [s.response_length for g in batch.groups for s in g.samples]
        metrics = {**{f"train/{k}": v for k, v in train_metrics.items()},
                   "rollout/reward": float(np.mean(rewards)), "rollout/response_len": float(np.mean(lengths)),
                   "rollout/samples_per_rollout": len(lengths) / max(1, len(rewards)),
                   "perf/train_s": train_s, "perf/step_s": step_s, **(times or {}),
                   "batch/staleness_avg": float(np.mean(batch.staleness)) if batch.staleness else 0.0}
        # which prompts this step trained: what proves nothing was lost or trained twice
        self.log.log("train", step, metrics, version=version,
                     **{"batch/prompt_indices": [g.prompt_index for g in batch.groups]})
        asyncio.get_running_loop().create_task(self._log_actor_metrics(step))

    async def _log_actor_metrics(self, step: int) -> None:
        keep: dict[str, float] = {}
        asks = [(self.buffer, BufferMetricsRequest()), (self.rollout, GetMetrics()),
                (self.engines, GetMetrics())]  # the fleet: engine/..., session/...
        for ref, ask in asks:
            try:  # metrics are best effort: one actor that cannot answer hides no other's
                reply = await ref.call(ask, timeout_s=10)
                keep.update({k: v for k, v in reply.values.items() if "/" in k})
                keep.update(actor_counters(ref.name, reply.values))
            except Exception as e:
                print(f"[driver] {ref.name} metrics unavailable: {e}", flush=True)
        if keep:  # (a row only when some actor answered, as before)
            keep.update(actor_counters(self.name, self.metrics()))
            self.log.log("actors", step, keep)


def shard_batch(samples: list[Sample], train, world_size: int, phase: str = "rl") -> list[TrainStep]:
    """One TrainStep per trainer rank: only the samples that rank's data-parallel index trains
    (model-parallel peers of one DP index get the same shard, R3 routing included), plus a
    `BatchIndex` of the whole batch (a few bytes per sample) from which every rank computes the
    same plan, denominators and metrics as from the whole batch. The plan is the backends' own
    pure function (`sample_owners`), computed here once.

    A batch the plan cannot be made of (empty, fewer groups than optimizer steps, malformed
    samples) goes whole to every rank, whose door check refuses it with its usual message."""

    dp_size, dp_index = trainer_dp_layout(train, world_size)
    try:
        arrays = batch_arrays(samples)
        owners = sample_owners(arrays["group_index"], arrays["lengths"].tolist(), world_size=dp_size,
                               steps=train.steps_per_train, max_tokens=train.max_tokens_per_microbatch)
    except (ValueError, TypeError, AttributeError):
        return [TrainStep(samples=samples, phase=phase) for _ in range(world_size)]
    all_lp = all(s.rollout_logprobs is not None for s in samples)
    steps = []
    for dp in range(dp_size):
        positions = np.flatnonzero(owners == dp).astype(np.int32)
        steps.append(TrainStep(samples=[samples[i] for i in positions.tolist()], phase=phase,
                               index=BatchIndex(positions=positions, all_rollout_logprobs=all_lp, **arrays)))
    return [steps[dp_index[r]] for r in range(world_size)]


def whole_batch(steps: list[TrainStep]) -> list[Sample]:
    """The batch that `shard_batch` sharded, from the TrainSteps of all DP ranks (the inverse of
    `shard_batch`; `miles replay` re-runs a recorded step on one process from it). Steps without
    an index already carry the whole batch."""
    sharded = [s for s in steps if s.index is not None]
    if not sharded:
        return list(steps[0].samples)
    out: list[Sample | None] = [None] * len(sharded[0].index.lengths)
    for step in sharded:
        for i, sample in zip(step.index.positions.tolist(), step.samples):
            out[i] = sample
    missing = [i for i, s in enumerate(out) if s is None]
    if missing:
        raise ValueError(f"whole_batch: samples {missing[:8]} of {len(out)} are in none of the {len(steps)} "
                         "TrainStep(s) given; every DP rank's shard is needed")
    return out
