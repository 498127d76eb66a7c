"""RolloutWorker: turns prompts into scored groups of samples, scheduling per sample.

Design decisions:
- Per-sample scheduling: a semaphore of `rollout.max_inflight_samples` bounds concurrent
  episodes (an engine request, or a plug-in's turns, tools and verifier); every finished trajectory frees its slot at once, so a long sample never holds back
  the short ones of other groups. Groups are started only when the buffer admits them
  (`Reserve`), which is where staleness is controlled; the worker itself never waits for the
  trainer. A group the buffer sends back for a retry is regenerated in its slot at once by its
  own task, never through admission (in sync mode no new slot opens before that group is in).
- Token in, token out: prompts are tokenized here once (`miles.rl.prompts`, as the evaluator
  does); the engine's output ids are kept as they are (never re-tokenized), with the engine's
  logprobs (None when it sent none: never invented zeros) and per-token weight-version spans.
- Deterministic sampling: each sample's `sampling_seed` is a hash of (run seed, prompt index,
  sample index, attempt) (`miles.seeds.sample_seed`; an episode's turn k > 0 hashes the turn in
  too), so the same recipe and seed give the same tokens under the same weights, and no two
  samples share a stream. This is what makes sync and fully-async identical at staleness 0.
- Engines go through the gateway with `X-SMG-Routing-Key: <group id>`: samples of one prompt
  share a prefix and land on one engine.
- Transient engine errors (connection refused/reset, 5xx, timeouts, a request aborted by a dying
  engine) are retried per request with bounded exponential back-off (tenacity: 0.2 s doubling
  to 5 s, for up to `rollout.engine_retry_s`), from the prompt with the same seed; the partial
  tokens of an aborted request are dropped and counted (`rollout/requests_retried`,
  `rollout/partial_tokens_dropped`). While requests fail so, admission pauses until the gateway
  answers `/health` again: no new groups, no prompts burned.
- Failures are data: an engine error past its budget or a reward-function error marks the sample
  "failed"; the buffer's policy decides (retry the prompt, drop it). Nothing accepted is lost
  silently: every reserved slot ends as a kept group or an explicit release (retried, and logged
  loudly if it still fails). A synchronous reward function runs in a thread, so a slow one never
  stalls the event loop (and its heartbeats).
- The buffer journals where the worker is: each `Reserve` names its prompt and the data source's
  state after reading it. A restarted worker (incarnation > 0) asks the buffer
  (`GetRolloutResume`), regenerates the slots its predecessor left in place (same seeds) and reads
  on from the journalled position: no prompt lost, none skipped, none trained twice.
- Resume loses no prompt: at a checkpoint the driver stores the prompts started but not yet
  trained (groups generating here, waiting for a retry, or held by the buffer), and a resumed
  worker generates those first (`source.at(index)`, same seeds) before reading on from the
  saved position.
- Plug-in points by import path: `rollout.reward` (per sample or batched per group), the depths
  `rollout.generate` / `rollout.agent` (each sample is an episode: `miles.envs.episode`, which
  also runs the verifier and destroys the episode's sandbox) and `rollout.function` (one call per
  step: `miles.envs.function`), and the worker class itself (`rollout.worker`; `generate_sample`
  is the one engine call of the built-in path). An episode may return several samples (a
  trajectory tree): a group is then larger than `n_samples_per_prompt`.
- On-policy distillation with the teacher on the rollout side (`[teacher]`): every finished
  sample is scored by the teacher fleet (`miles.rl.teacher_scores`: its prompt log-probs of the
  response tokens) inside the episode's slot, before its group goes to the buffer. A failed
  scoring marks that sample failed with the error, like an engine error.
- For `rollout.function`: `generate_group(prompt, attempt)` runs the configured per-sample path
  for one prompt (scored, not put into the buffer); `env` (an `EpisodeEnv`: engine, tokenizer,
  sandbox pool, sessions) and `sampling_for(prompt_index, sample_index, attempt)` are what a
  custom loop builds episodes from.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from tenacity import (AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay,
                      wait_exponential)

from miles.algo.routing import pack_routing
from miles.engines.routed_experts import num_routed_experts, routed_experts_layout_from_config
from miles.engines.sampling_params import sampling_params
from miles.envs.episode import EpisodeEnv, run_episode
from miles.rl.data import Prompt
from miles.rl.prompts import prompt_token_ids
from miles import plugins
from miles.rl.otel import NOOP, telemetry
from miles.rl.provenance import Stamper, note_engine
from miles.rl.rewards import call_off_loop, check_reward
from miles.rl.sources import make_source, tokenizer_for
from miles.runtime import Actor
from miles.seeds import sample_seed
from miles.wire.messages import (GetEngines, GetRolloutResume, GetRolloutState, Group,
                                 NoteRolloutStart, OrphanSlot, PauseAdmission, PutGroup,
                                 PutReply, ReleaseSlot, Reserve, RolloutState, Sample,
                                 StartRollout, StopRollout)

BUFFER_RETRIES = 3   # re-sends of an idempotent buffer call after the buffer restarted


class EngineAborted(Exception):
    """The engine ended a request early (it was stopping or died): retried from the prompt."""


def engine_request(recipe, sample: Sample) -> tuple[list[int], Any, str]:
    """(prompt ids, sampling params, rid) of the request the built-in worker sent for a trained
    sample: the seed is derived, so it is rebuilt exactly (`miles replay --resend`)."""
    meta = sample.metadata
    seed = sample_seed(recipe.run.seed, int(meta.get("prompt_index", 0)), sample.index,
                       int(meta.get("retries", 0)))
    prompt = sample.tokens[:sample.prompt_length].tolist()
    return prompt, sampling_params(recipe.rollout, seed), f"{sample.rollout_id}-{seed}"


def transient(e: BaseException) -> bool:
    from miles.engines.client import EngineUnavailable
    return isinstance(e, (EngineUnavailable, EngineAborted, ConnectionError, asyncio.TimeoutError))


class RolloutWorker(Actor):
    def __init__(self, name: str = "rollout"):
        super().__init__(name)
        self._running = False
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._engines_up = asyncio.Event()  # cleared while engine requests fail transiently
        self._engines_up.set()
        self._resumed = asyncio.Event()     # the restart check with the buffer is done
        self._tasks_groups: set[asyncio.Task] = set()
        self._group_prompts: dict[asyncio.Task, int] = {}  # running group -> its prompt index
        self.replay_queue: list[int] = []  # prompts untrained at the checkpoint we resumed from
        self._pending: tuple[Prompt, dict | None, list[int], str] | None = None  # read, not admitted
        self._reserves = 0
        self._loop_task: asyncio.Task | None = None
        self._env: EpisodeEnv | None = None
        self.teacher = None                 # a TeacherScorer with [teacher], else None
        self.stamper: Stamper | None = None  # logging.provenance: stamps each finished sample
        self.telemetry = NOOP                # logging.otel: an episode span per sample
        self.num_experts: int | None = None   # R3: the model's routed experts (the wire dtype)
        self.inflight = 0
        self.idle_since: float | None = time.monotonic()
        self.engine_idle_s = 0.0
        self.admission_paused_s = 0.0
        self.recent_rewards: collections.deque = collections.deque(maxlen=512)
        self.counts = {"groups_started": 0, "groups_put": 0, "samples": 0, "samples_failed": 0,
                       "tokens_generated": 0, "retries": 0, "requests_retried": 0,
                       "partial_tokens_dropped": 0, "groups_resumed": 0}

    # ----- set-up ------------------------------------------------------------------------------

    async def on_start(self) -> None:
        r = self.recipe
        self.cfg = r.rollout
        self.seed = r.run.seed
        self.stamper = Stamper(r) if r.logging.provenance or r.logging.otel != "none" else None
        self.telemetry = telemetry(r, "rollout")
        engines = await self.runtime.ref("engines").call(GetEngines(), timeout_s=r.engine.start_timeout_s)
        self.model_path = engines.model_path
        self.tokenizer = tokenizer_for(self.model_path)
        # R3: the (layers, top_k) that decode routed experts come from the model's config; the
        # gateway does not forward /model_info, so the client cannot ask the engines for it.
        layout = routed_experts_layout_from_config(self.model_path) if self.cfg.return_routed_experts else None
        # ... and the expert count fixes the wire dtype for every sample of the model
        self.num_experts = num_routed_experts(self.model_path) if layout is not None else None
        from miles.engines.client import EngineClient
        self.client = EngineClient(engines.gateway_url, timeout_s=60.0,
                                   generate_timeout_s=self.cfg.request_timeout_s,
                                   routed_experts_layout=layout)
        self.source = make_source(r, split="train")
        self.reward_fn = plugins.load("rollout.reward", self.cfg.reward,
                                      batched=self.cfg.reward_batched)
        self.buffer = self.runtime.ref("buffer")
        self.semaphore = asyncio.Semaphore(self.cfg.max_inflight_samples)
        if r.teacher.path:
            from miles.rl.teacher_scores import TeacherScorer
            self.teacher = TeacherScorer(self.runtime.ref("teacher_engines"), r, self.model_path)
            await self.teacher.open()
        self._env = await EpisodeEnv.open(r, engines, self.client, self.tokenizer, role="rollout",
                                          incarnation=self.incarnation, retry=self._retrying,
                                          reward_fn=self.reward_fn)
        if self.incarnation > 0:
            self._spawn(self._resume_after_restart())
        else:
            self._resumed.set()

    async def on_stop(self) -> None:
        await self._stop()
        if self._env is not None:
            await self._env.close()
        if hasattr(self, "client"):
            await self.client.close()
        if self.teacher is not None:
            await self.teacher.close()
        await asyncio.to_thread(self.telemetry.close)

    # ----- control -----------------------------------------------------------------------------

    async def on_start_rollout(self, msg: StartRollout) -> None:
        await self._resumed.wait()
        if self._running:  # a re-send, or this incarnation resumed from the buffer's journal
            return
        if msg.data_state:
            self.source.restore(msg.data_state)
        await self.buffer.call(NoteRolloutStart(data_state=self.source.state(), replay=list(msg.replay),
                                                owner=self.incarnation), retries=BUFFER_RETRIES)
        self._begin(list(msg.replay), [], "the checkpoint")

    async def _resume_after_restart(self) -> None:
        try:
            res = await self.buffer.call(GetRolloutResume(owner=self.incarnation),
                                         timeout_s=self.recipe.engine.start_timeout_s,
                                         retries=BUFFER_RETRIES)
            if not res.started:
                print(f"[rollout] incarnation {self.incarnation}: no rollout was started yet; "
                      f"waiting for StartRollout", flush=True)
                return
            if res.data_state:
                self.source.restore(res.data_state)
            print(f"[rollout] incarnation {self.incarnation} resumes from the buffer's journal: "
                  f"regenerating {len(res.orphans)} groups in their slots", flush=True)
            self._begin(list(res.replay), list(res.orphans), "the restart")
        finally:
            self._resumed.set()

    def _begin(self, replay: list[int], orphans: list[OrphanSlot], where: str) -> None:
        self.replay_queue = replay
        if (self.replay_queue or orphans) and not hasattr(self.source, "at"):
            print(f"cannot replay {len(self.replay_queue) + len(orphans)} prompts that were in "
                  f"flight at {where}: data source {type(self.source).__name__} has no at(index)",
                  flush=True)
            self.replay_queue = []
            for o in orphans:
                self._spawn(self._release(o.slot, "prompt cannot be regenerated (no at(index))"))
            orphans = []
        replay = f", replaying {len(self.replay_queue)} prompts in flight at the checkpoint" \
            if self.replay_queue else ""
        print(f"starting at data position {self.source.state().get('position', '?')}{replay}", flush=True)
        self._running = True
        for o in orphans:
            self.counts["groups_resumed"] += 1
            self._start_group(self.source.at(o.prompt_index), o.slot, o.attempt)
        if self.cfg.function:  # rollout.function: one call per step replaces per-sample scheduling
            from miles.envs.function import run_function_loop
            self._loop_task = asyncio.get_running_loop().create_task(run_function_loop(self))
        else:
            self._loop_task = asyncio.get_running_loop().create_task(self._admit_loop())

    async def on_stop_rollout(self, msg: StopRollout) -> None:
        await self._stop()
        if self._env is not None:
            await self._env.settle()

    async def _stop(self) -> None:
        # Groups cut off here were never trained: a checkpoint taken after this still lists them.
        pending = [self._pending[0].index] if self._pending else []
        self.replay_queue = [*self._group_prompts.values(), *pending, *self.replay_queue]
        self._pending = None
        self._running = False
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks_groups):
            task.cancel()
        await asyncio.gather(*self._tasks_groups, return_exceptions=True)

    def on_pause_admission(self, msg: PauseAdmission) -> None:
        (self._admission_open.clear if msg.paused else self._admission_open.set)()

    def on_get_rollout_state(self, msg: GetRolloutState) -> RolloutState:
        pending = [self._pending[0].index] if self._pending else []
        in_flight = [*self._group_prompts.values(), *pending, *self.replay_queue]
        return RolloutState(data_state=self.source.state(), metrics=self.metrics(),
                            in_flight=sorted(in_flight))

    # ----- the admission loop ------------------------------------------------------------------

    def _next_prompt(self) -> tuple[Prompt, dict | None, list[int], str]:
        """The next prompt, the source's state after it, the replay list left after it, and the
        id of its Reserve."""
        if self.replay_queue:
            prompt = self.source.at(self.replay_queue.pop(0))
        else:
            prompt = next(self.source)
        return prompt, self.source.state(), list(self.replay_queue), self._request_id()

    def _request_id(self) -> str:
        self._reserves += 1
        return f"{self.incarnation}-{self._reserves}"

    async def _admit_loop(self) -> None:
        while self._running:
            try:
                await self._admit_one()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop must outlive one bad call (the pending prompt stays)
                print(f"ERROR [rollout] admission: {type(e).__name__}: {e}; trying again in 1 s",
                      flush=True)
                await asyncio.sleep(1.0)

    async def _admit_one(self) -> None:
        """Read the next prompt (kept until a slot takes it), reserve a slot, start its group."""
        await self._admission_open.wait()
        await self._wait_engines_up()
        if self._pending is None:
            self._pending = self._next_prompt()
        prompt, data_state, replay, request_id = self._pending
        # The request id stays with the prompt until a slot takes it: a Reserve re-sent after an
        # error can then never give one prompt two slots.
        reservation = await self.buffer.call(
            Reserve(prompt_index=prompt.index, data_state=data_state, replay=replay,
                    request_id=request_id, owner=self.incarnation),
            timeout_s=10**9, retries=BUFFER_RETRIES)
        if reservation.retry_prompt >= 0 and reservation.retry_prompt != prompt.index:
            # The slot went to a prompt rejected as stale; ours waits for the next slot.
            self._pending = (prompt, data_state, replay, self._request_id())
            if not hasattr(self.source, "at"):
                self._spawn(self._release(reservation.slot, "stale prompt cannot be regenerated"))
                return
            prompt = self.source.at(reservation.retry_prompt)
        else:
            self._pending = None
        self._start_group(prompt, reservation.slot, 0)

    def _start_group(self, prompt: Prompt, slot: int, attempt: int) -> None:
        self.counts["groups_started"] += 1
        task = asyncio.get_running_loop().create_task(self._run_group(prompt, slot, attempt))
        self._tasks_groups.add(task)
        self._group_prompts[task] = prompt.index
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks_groups.discard(task)
        self._group_prompts.pop(task, None)

    async def _run_group(self, prompt: Prompt, slot: int, attempt: int) -> None:
        try:
            while (await self._generate_group(prompt, slot, attempt)).decision == "retry":
                self.counts["retries"] += 1
                attempt += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leak a reserved slot: the buffer would wait for it forever
            print(f"group for prompt {prompt.index} failed: {type(e).__name__}: {e}", flush=True)
            await self._release(slot, f"{type(e).__name__}: {e}")

    async def _release(self, slot: int, reason: str) -> None:
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(5), reraise=True,
                                               wait=wait_exponential(multiplier=0.2, max=5.0)):
                with attempt:
                    await self.buffer.call(ReleaseSlot(slot=slot, reason=reason), timeout_s=30.0,
                                           retries=BUFFER_RETRIES)
        except Exception as e:
            print(f"ERROR [rollout] slot {slot} could not be released ({type(e).__name__}: {e}); "
                  f"the buffer will hold its admission window until it is", flush=True)

    async def generate_group(self, prompt: Prompt, attempt: int = 0) -> Group:
        """`n_samples_per_prompt` episodes of `prompt` by the configured path, with rewards; the
        buffer is not touched (`rollout.function` loops call this)."""
        group_id = f"p{prompt.index}-a{attempt}-{uuid.uuid4().hex[:6]}"
        prompt_ids = self.tokenize_prompt(prompt)
        # return_exceptions: without it gather ends at the first cancelled episode while its
        # siblings are still destroying their sandboxes and collecting their sessions.
        episodes = await asyncio.gather(*(
            self._sample(prompt, prompt_ids, group_id, i, attempt)
            for i in range(self.cfg.n_samples_per_prompt)), return_exceptions=True)
        for episode in episodes:
            if isinstance(episode, BaseException):
                raise episode
        samples = [s for episode in episodes for s in episode]
        for i, s in enumerate(samples):   # a trajectory tree adds samples: positions are per group
            s.index = i
            if s.routed_experts is not None:   # R3: engine int32 -> uint8/uint16 before it travels
                s.routed_experts = pack_routing(s.routed_experts, self.num_experts)
        if self.cfg.reward_batched:
            await self._reward_group(samples)
        return Group(group_id=group_id, samples=samples, prompt_index=prompt.index)

    @property
    def env(self) -> EpisodeEnv:
        """The episodes' shared parts (opened in `on_start`; a worker driven without it gets
        one without sandboxes or sessions)."""
        if self._env is None:
            self._env = EpisodeEnv(self.recipe, self.client, self.tokenizer, role="rollout",
                                   incarnation=self.incarnation, retry=self._retrying,
                                   reward_fn=self.reward_fn)
        return self._env

    def sampling_for(self, prompt_index: int, sample_index: int, attempt: int):
        return sampling_params(self.cfg, sample_seed(self.seed, prompt_index, sample_index, attempt))

    async def _generate_group(self, prompt: Prompt, slot: int, attempt: int) -> PutReply:
        group = await self.generate_group(prompt, attempt)
        reply = await self.buffer.call(PutGroup(group=group, slot=slot, owner=self.incarnation),
                                       timeout_s=10**9, retries=BUFFER_RETRIES)
        self.counts["groups_put"] += 1
        if self.env.episodes is not None:   # <run>/episodes.jsonl, with the buffer's decision
            self.env.episodes.write(group, reply.decision, reply.reason)
        return reply

    async def _sample(self, prompt: Prompt, prompt_ids: list[int], group_id: str, index: int,
                      attempt: int) -> list[Sample]:
        """One episode (one sample, or a trajectory tree of several), scored."""
        sample = Sample(tokens=np.asarray(prompt_ids, np.int32), response_length=0,
                        group_id=group_id, rollout_id=f"{group_id}-{index}", index=index,
                        prompt=prompt.prompt, label=prompt.label,
                        metadata={**prompt.metadata, "retries": attempt, "prompt_index": prompt.index})
        seed = sample_seed(self.seed, prompt.index, index, attempt)
        queued_at = time.time()
        async with self.semaphore:
            self._busy(+1)
            started_at = time.time()
            try:
                samples = await run_episode(self.env, sample, self.sampling_for(prompt.index, index, attempt),
                                            generate=lambda ctx, s: self._generate_retrying(s, seed),
                                            verify=not self.cfg.reward_batched)
            except Exception as e:
                sample.status, sample.metadata["error"] = "failed", f"{type(e).__name__}: {e}"
                samples = [sample]
            finally:
                self._busy(-1)
            if self.teacher is not None:
                await asyncio.gather(*(self._teacher_score(s) for s in samples if s.status != "failed"))
        if self.stamper is not None:
            sampling = self.sampling_for(prompt.index, index, attempt)
            for s in samples:
                self.stamper.stamp(s, sampling, queued_at=queued_at, started_at=started_at)
                self.telemetry.episode(s)
        for s in samples:
            self.counts["samples"] += 1
            if s.status == "failed":
                self.counts["samples_failed"] += 1
            elif s.reward is not None:
                try:
                    self.recent_rewards.append(s.scalar_reward(self.recipe.train.reward_key))
                except ValueError:
                    pass  # a dict reward without train.reward_key: the trainer names the problem
        return samples

    async def _teacher_score(self, sample: Sample) -> None:
        try:
            await self.teacher.score(sample)
        except Exception as e:  # a teacher failure is this sample's, never the run's
            sample.status, sample.metadata["error"] = "failed", f"teacher: {type(e).__name__}: {e}"

    async def _retrying(self, call):
        """`await call()`, retried (same input, same seed) on transient engine errors with back-off."""
        async for attempt in AsyncRetrying(
                retry=retry_if_exception(transient), reraise=True,
                wait=wait_exponential(multiplier=0.2, max=5.0),
                stop=stop_after_delay(self.cfg.engine_retry_s), before_sleep=self._note_retry):
            with attempt:
                out = await call()
                if getattr(out, "aborted", False) or getattr(out, "status", "") == "aborted":
                    n = getattr(out, "response_length", None) or len(getattr(out, "output_ids", []))
                    self.counts["partial_tokens_dropped"] += n
                    raise EngineAborted(f"the engine aborted the request after {n} tokens")
                self._engines_up.set()
                return out
        raise AssertionError("unreachable: tenacity reraises the last error")

    async def _generate_retrying(self, sample: Sample, seed: int) -> Sample:
        """`generate_sample`, retried from the prompt (same seed) on transient engine errors."""
        return await self._retrying(lambda: self.generate_sample(
            msgspec.structs.replace(sample, metadata=dict(sample.metadata)), seed))

    def _note_retry(self, state) -> None:
        self.counts["requests_retried"] += 1
        self._engines_up.clear()

    async def _wait_engines_up(self) -> None:
        """While engine requests fail transiently, start nothing until the gateway answers."""
        if self._engines_up.is_set():
            return
        t0, delay = time.monotonic(), 0.2
        print("[rollout] engine requests are failing: admission paused until the gateway is "
              "healthy", flush=True)
        while not self._engines_up.is_set():
            if await self.client.health():
                break
            try:
                await asyncio.wait_for(self._engines_up.wait(), delay)
            except asyncio.TimeoutError:
                delay = min(5.0, delay * 2)
        self._engines_up.set()
        self.admission_paused_s += time.monotonic() - t0
        print(f"[rollout] admission resumed after {time.monotonic() - t0:.1f}s", flush=True)

    async def _call_reward(self, arg: Any) -> Any:
        return await call_off_loop(self.reward_fn, arg)

    async def _reward_group(self, samples: list[Sample]) -> None:
        ok = [s for s in samples if s.status in ("completed", "truncated")]
        try:
            rewards = await self._call_reward(ok)
            if len(rewards) != len(ok):
                raise ValueError(f"returned {len(rewards)} rewards for {len(ok)} samples")
            for s, r in zip(ok, rewards):
                s.reward = check_reward(r, f"rollout.reward {self.cfg.reward!r}")
        except Exception as e:
            for s in ok:
                s.status, s.metadata["error"] = "failed", f"reward: {type(e).__name__}: {e}"

    # ----- overridable pieces ------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt.prompt, self.recipe.data.apply_chat_template)

    async def generate_sample(self, sample: Sample, seed: int) -> Sample:
        """One engine call; override for multi-turn or tool use (keep tokens token-exact).
        Raise (or return status "aborted") on an engine failure: the caller retries transient
        ones from the prompt."""
        cfg = self.cfg
        params = sampling_params(cfg, seed)
        result = await self.client.generate(sample.tokens.tolist(), params, return_logprob=True,
                                            return_routed_experts=cfg.return_routed_experts,
                                            routing_key=sample.group_id,
                                            rid=f"{sample.rollout_id}-{seed}")
        out = np.asarray(result.output_ids, np.int32)
        sample.tokens = np.concatenate([sample.tokens, out])
        sample.response_length = len(out)
        sample.loss_mask = np.ones(len(out), np.uint8)
        # None when the engine sent none: zeros would be silently wrong ratios in the trainer.
        sample.rollout_logprobs = (np.asarray(result.output_logprobs, np.float32)
                                   if result.output_logprobs is not None else None)
        sample.weight_versions = result.version_spans()
        if self.stamper is not None:
            note_engine(sample, result.meta_info)
        if result.routed_experts is not None:
            sample.routed_experts = np.ascontiguousarray(result.routed_experts, np.int32)
        sample.response = self.tokenizer.decode(out.tolist(), skip_special_tokens=True)
        sample.status = {"stop": "completed", "length": "truncated"}.get(result.finish_reason.type, "aborted")
        self.counts["tokens_generated"] += len(out)
        return sample

    # ----- metrics -----------------------------------------------------------------------------

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        if self.inflight == 0 and delta > 0 and self.idle_since is not None:
            self.engine_idle_s += now - self.idle_since
            self.idle_since = None
        self.inflight += delta
        if self.inflight == 0:
            self.idle_since = now

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        idle = self.engine_idle_s + (time.monotonic() - self.idle_since if self.idle_since else 0.0)
        out.update({f"rollout/{k}": float(v) for k, v in self.counts.items()})
        out.update({"rollout/inflight": float(self.inflight), "rollout/engine_idle_s": idle,
                    "rollout/admission_paused_s": self.admission_paused_s})
        if self.recent_rewards:  # every sample, before the buffer's filter (the batch is biased)
            out["rollout/reward_recent"] = sum(self.recent_rewards) / len(self.recent_rewards)
        if self.teacher is not None:
            out.update(self.teacher.metrics())
        if self._env is not None:
            out.update(self.env.metrics.values())
            out.update(self.env.pool_values())
        return out
