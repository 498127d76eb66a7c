"""RolloutWorker: turns prompts into scored groups of samples, scheduling per sample.

Design decisions:
- Per-sample scheduling: a semaphore of `rollout.max_inflight_samples` bounds concurrent engine
  requests; every finished trajectory frees its slot at once, so a long sample never holds back
  the short ones of other groups. Groups are started only when the buffer admits them
  (`Reserve`), which is where staleness is controlled; the worker itself never waits for the
  trainer.
- Token in, token out: prompts are tokenized here once; the engine's output ids are kept as they
  are (never re-tokenized), with the engine's logprobs and per-token weight-version spans.
- Deterministic sampling: each sample's `sampling_seed` is derived from (run seed, prompt index,
  sample index, attempt), so the same recipe and seed give the same tokens under the same weights.
  This is what makes sync and fully-async identical at staleness 0.
- Engines go through the gateway with `X-SMG-Routing-Key: <group id>`: samples of one prompt
  share a prefix and land on one engine.
- Failures are data: an engine error or a reward-function error marks the sample "failed"; the
  buffer's policy decides (retry the prompt, drop it). Nothing accepted is lost silently: every
  reserved slot ends as a kept group or an explicit release.
- Resume loses no prompt: at a checkpoint the driver stores the prompts started but not yet
  trained (groups generating here, waiting for a retry, or held by the buffer), and a resumed
  worker generates those first (`source.at(index)`, same seeds) before reading on from the
  saved position.
- Plug-in points by import path: `rollout.reward` (per sample or batched per group), and the
  worker class itself (`rollout.worker`); `generate_sample` is the method to override for a
  custom generate function (multi-turn, tools, agents).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import Any

import numpy as np

from miles.actors.base import Actor
from miles.rl.data import Prompt
from miles.rl.rewards import call_maybe_async, check_reward, load_function
from miles.wire.messages import (GetEngines, GetRolloutState, Group, PauseAdmission,
                                 PutGroup, ReleaseSlot, Reserve, RolloutState, Sample,
                                 StartRollout, StopRollout)


def sample_seed(run_seed: int, prompt_index: int, sample_index: int, attempt: int) -> int:
    return (run_seed * 1_000_003 + prompt_index * 1_009 + sample_index * 7 + attempt * 100_003) % (2**31 - 1)


class RolloutWorker(Actor):
    def __init__(self, name: str = "rollout"):
        super().__init__(name)
        self._running = False
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._tasks_groups: set[asyncio.Task] = set()
        self._group_prompts: dict[asyncio.Task, int] = {}  # running group -> its prompt index
        self.replay_queue: list[int] = []  # prompts untrained at the checkpoint we resumed from
        self._loop_task: asyncio.Task | None = None
        self.inflight = 0
        self.idle_since: float | None = time.monotonic()
        self.engine_idle_s = 0.0
        self.recent_rewards: collections.deque = collections.deque(maxlen=512)
        self.counts = {"groups_started": 0, "groups_put": 0, "samples": 0, "samples_failed": 0,
                       "tokens_generated": 0, "retries": 0}

    # ----- set-up ------------------------------------------------------------------------------

    async def on_start(self) -> None:
        from miles.engines.client import EngineClient
        from miles.rl.sources import make_source, tokenizer_for

        r = self.recipe
        self.cfg = r.rollout
        self.seed = r.run.seed
        engines = await self.runtime.ref("engines").call(GetEngines(), timeout_s=r.engine.start_timeout_s)
        self.model_path = engines.model_path
        self.tokenizer = tokenizer_for(self.model_path)
        self.client = EngineClient(engines.gateway_url, timeout_s=60.0,
                                   generate_timeout_s=self.cfg.request_timeout_s)
        self.source = make_source(r, split="train")
        self.reward_fn = load_function(self.cfg.reward, "rollout.reward")
        self.buffer = self.runtime.ref("buffer")
        self.semaphore = asyncio.Semaphore(self.cfg.max_inflight_samples)
        self.retry_queue: list[tuple[Prompt, int, int]] = []  # (prompt, slot, attempt)

    async def on_stop(self) -> None:
        await self._stop()
        if hasattr(self, "client"):
            await self.client.close()

    # ----- control -----------------------------------------------------------------------------

    async def on_start_rollout(self, msg: StartRollout) -> None:
        if msg.data_state:
            self.source.restore(msg.data_state)
        self.replay_queue = list(msg.replay)
        if self.replay_queue and not hasattr(self.source, "at"):
            print(f"cannot replay {len(self.replay_queue)} prompts that were in flight at the "
                  f"checkpoint: data source {type(self.source).__name__} has no at(index)", flush=True)
            self.replay_queue = []
        replay = f", replaying {len(self.replay_queue)} prompts in flight at the checkpoint" \
            if self.replay_queue else ""
        print(f"starting at data position {self.source.state().get('position', '?')}{replay}", flush=True)
        if not self._running:
            self._running = True
            self._loop_task = asyncio.get_running_loop().create_task(self._admit_loop())

    async def on_stop_rollout(self, msg: StopRollout) -> None:
        await self._stop()

    async def _stop(self) -> None:
        # Groups cut off here were never trained: a checkpoint taken after this still lists them.
        self.replay_queue = [*self._group_prompts.values(), *self.replay_queue]
        self._running = False
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks_groups):
            task.cancel()
        await asyncio.gather(*self._tasks_groups, return_exceptions=True)

    def on_pause_admission(self, msg: PauseAdmission) -> None:
        (self._admission_open.clear if msg.paused else self._admission_open.set)()

    def on_get_rollout_state(self, msg: GetRolloutState) -> RolloutState:
        in_flight = [*self._group_prompts.values(), *(p.index for p, _, _ in self.retry_queue),
                     *self.replay_queue]
        return RolloutState(data_state=self.source.state(), metrics=self.metrics(),
                            in_flight=sorted(in_flight))

    # ----- the admission loop ------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while self._running:
            await self._admission_open.wait()
            if self.retry_queue:
                prompt, slot, attempt = self.retry_queue.pop(0)
            else:
                reservation = await self.buffer.call(Reserve(), timeout_s=10**9)
                slot, attempt = reservation.slot, 0
                if reservation.retry_prompt >= 0 and hasattr(self.source, "at"):
                    prompt = self.source.at(reservation.retry_prompt)
                elif self.replay_queue:
                    prompt = self.source.at(self.replay_queue.pop(0))
                else:
                    prompt = next(self.source)
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
            await self._generate_group(prompt, slot, attempt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leak a reserved slot: the buffer would wait for it forever
            print(f"group for prompt {prompt.index} failed: {type(e).__name__}: {e}", flush=True)
            try:
                await self.buffer.call(ReleaseSlot(slot=slot, reason=f"{type(e).__name__}: {e}"))
            except Exception:
                pass

    async def _generate_group(self, prompt: Prompt, slot: int, attempt: int) -> None:
        group_id = f"p{prompt.index}-a{attempt}-{uuid.uuid4().hex[:6]}"
        prompt_ids = self.tokenize_prompt(prompt)
        samples = await asyncio.gather(*(
            self._sample(prompt, prompt_ids, group_id, i, attempt)
            for i in range(self.cfg.n_samples_per_prompt)))
        if self.cfg.reward_batched:
            await self._reward_group(samples)
        group = Group(group_id=group_id, samples=list(samples), prompt_index=prompt.index)
        reply = await self.buffer.call(PutGroup(group=group, slot=slot), timeout_s=10**9)
        self.counts["groups_put"] += 1
        if reply.decision == "retry":
            self.counts["retries"] += 1
            self.retry_queue.append((prompt, slot, attempt + 1))

    async def _sample(self, prompt: Prompt, prompt_ids: list[int], group_id: str, index: int,
                      attempt: int) -> Sample:
        sample = Sample(tokens=np.asarray(prompt_ids, np.int32), response_length=0,
                        group_id=group_id, rollout_id=f"{group_id}-{index}", index=index,
                        prompt=prompt.prompt, label=prompt.label,
                        metadata={**prompt.metadata, "retries": attempt, "prompt_index": prompt.index})
        async with self.semaphore:
            self._busy(+1)
            try:
                sample = await self.generate_sample(sample, sample_seed(self.seed, prompt.index, index, attempt))
            except Exception as e:
                sample.status, sample.metadata["error"] = "failed", f"{type(e).__name__}: {e}"
            finally:
                self._busy(-1)
        self.counts["samples"] += 1
        if sample.status in ("completed", "truncated") and not self.cfg.reward_batched:
            try:
                sample.reward = check_reward(await call_maybe_async(self.reward_fn, sample),
                                             f"rollout.reward {self.cfg.reward!r}")
            except Exception as e:
                sample.status, sample.metadata["error"] = "failed", f"reward: {type(e).__name__}: {e}"
        if sample.status == "failed":
            self.counts["samples_failed"] += 1
        elif isinstance(sample.reward, (int, float)):
            self.recent_rewards.append(float(sample.reward))
        return sample

    async def _reward_group(self, samples: list[Sample]) -> None:
        ok = [s for s in samples if s.status in ("completed", "truncated")]
        try:
            rewards = await call_maybe_async(self.reward_fn, ok)
            if len(rewards) != len(ok):
                raise ValueError(f"returned {len(rewards)} rewards for {len(ok)} samples")
            for s, r in zip(ok, rewards):
                s.reward = check_reward(r, f"rollout.reward {self.cfg.reward!r}")
        except Exception as e:
            for s in ok:
                s.status, s.metadata["error"] = "failed", f"reward: {type(e).__name__}: {e}"

    # ----- overridable pieces ------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt.prompt, list):
            return list(self.tokenizer.apply_chat_template(prompt.prompt, add_generation_prompt=True,
                                                           tokenize=True))
        if self.recipe.data.apply_chat_template:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.prompt}], add_generation_prompt=True, tokenize=True))
        return self.tokenizer.encode(prompt.prompt, add_special_tokens=False)

    async def generate_sample(self, sample: Sample, seed: int) -> Sample:
        """One engine call; override for multi-turn or tool use (keep tokens token-exact)."""
        from miles.engines.client import SamplingParams

        cfg = self.cfg
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, sampling_seed=seed,
                                stop_token_ids=cfg.stop_token_ids or None,
                                ignore_eos=cfg.ignore_eos or None)
        result = await self.client.generate(sample.tokens.tolist(), params, return_logprob=True,
                                            return_routed_experts=cfg.return_routed_experts,
                                            routing_key=sample.group_id,
                                            rid=f"{sample.rollout_id}-{seed}")
        out = np.asarray(result.output_ids, np.int32)
        sample.tokens = np.concatenate([sample.tokens, out])
        sample.response_length = len(out)
        sample.loss_mask = np.ones(len(out), np.uint8)
        sample.rollout_logprobs = np.asarray(result.output_logprobs or [0.0] * len(out), np.float32)
        sample.weight_versions = result.version_spans()
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
        out.update({"rollout/inflight": float(self.inflight), "rollout/engine_idle_s": idle})
        if self.recent_rewards:  # every sample, before the buffer's filter (the batch is biased)
            out["rollout/reward_recent"] = sum(self.recent_rewards) / len(self.recent_rewards)
        return out
