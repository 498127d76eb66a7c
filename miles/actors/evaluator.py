"""Evaluator: scores the policy on the held-out set, in one of three modes by where weights come from.

- `shared`: through the rollout engines' gateway (the weights they serve now). Rollout
  admission is paused for the duration so a small debug set is not drowned by training traffic.
- `fleet`: a dedicated embedded engine loaded from the HF weights snapshot of that step
  (`Evaluate.checkpoint_dir` is that directory: the driver writes HF-only snapshots to
  `<output_dir>/eval/step_N`), started for the evaluation and stopped after it.
- `external`: a user command (`eval.command`, with `{checkpoint}` and `{step}` filled in) that
  prints one JSON object of metrics on its last line.

Design decisions:
- A result carries the version the engines actually served, read from the responses'
  `weight_versions` spans: in fully-async runs training publishes newer versions while the
  evaluation runs, so the version at request time would be wrong. When an update crossed the
  evaluation, `version` is the oldest served and `version_max` the newest (also in the metrics).
- Prompts are tokenized exactly as rollout does (`miles.rl.prompts.prompt_token_ids`, chat
  template included), and a dict reward is read with `Sample.scalar_reward(train.reward_key)`, as
  the trainer does: eval scores the task that is trained.
- At most `eval.max_concurrency` requests are in flight: the eval set must not flood the engines
  that serve rollouts.
- The external command runs through the one supervised-process helper (`miles.supervise`): on
  timeout or cancellation its whole process group is killed, and its output goes to a log file.
- With a depth set (`rollout.generate` / `rollout.agent`), each eval prompt is one episode of
  the same runner the rollout worker uses (`miles.envs.episode.run_episode`: plug-in, sandbox,
  verifier), sampled at `eval.temperature`: an agent recipe's held-out reward is the agent's.
  Its sandboxes are labelled `miles.role=eval` (the worker's sweep leaves them alone); in fleet
  mode an agent gets a session server of its own in front of the evaluation engine.
- A failed evaluation returns `ok = false` with the error: that point is skipped and training
  goes on. Rollout admission is resumed whatever happened.
- pass@k: each prompt is sampled `eval.samples_per_prompt` (n) times, sample j of prompt p with
  seed `miles.seeds.eval_seed(run.seed, p, j)` (a hash, in a domain of its own: no two samples
  share draws, nor an eval sample a training one; n > 1 needs `eval.temperature` > 0 to
  differ); a sample passes when its scalar reward is at least `eval.pass_threshold`.
  `eval/pass@1` and `eval/pass@k` (k = n) are the unbiased estimator of Chen et al. 2021
  (`pass_at_k`) averaged over prompts; `eval/reward` is the mean over all samples, `eval/n` the
  number of prompts. Rows that name groups (`metadata["eval_groups"]`, a list of names: the SWE
  tasks give their bug's difficulty and template) also get `eval/<group>/pass@1`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shlex
import time
from pathlib import Path

import msgspec
import numpy as np

from miles.rl.prompts import prompt_token_ids
from miles import plugins
from miles.rl.rewards import call_maybe_async
from miles.rl.sources import make_source, tokenizer_for
from miles.runtime import Actor
from miles.seeds import eval_seed
from miles.supervise import run_command
from miles.wire.messages import EngineSet, EvalResult, Evaluate, GetEngines, PauseAdmission, Sample

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which c passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Evaluator(Actor):
    def __init__(self, name: str = "evaluator"):
        super().__init__(name)
        self.lock = asyncio.Lock()

    async def on_start(self) -> None:
        r = self.recipe
        self.cfg = r.eval
        self.reward_fn = plugins.load("rollout.reward", r.rollout.reward,
                                      batched=r.rollout.reward_batched)
        self.tokenizer = tokenizer_for(r.model.path)
        if self.cfg.mode in ("shared", "fleet"):
            source = make_source(r, split="eval")
            n = self.cfg.n_prompts or len(source.rows)
            self.prompts = [next(source) for _ in range(min(n, len(source.rows)))]

    async def on_evaluate(self, msg: Evaluate) -> EvalResult:
        t0 = time.monotonic()
        async with self.lock:
            try:
                metrics, served = await asyncio.wait_for(self._evaluate(msg), self.cfg.timeout_s)
            except Exception as e:  # noqa: BLE001 - a failed eval skips its point, never training
                if isinstance(e, asyncio.TimeoutError):
                    e = TimeoutError(f"eval.timeout_s = {self.cfg.timeout_s}: step {msg.step} "
                                     f"({self.cfg.mode} mode) did not finish")
                log.warning("evaluation of step %d failed: %s", msg.step, e)
                return EvalResult(step=msg.step, version=msg.version, ok=False,
                                  lag_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
            low, high = served if served is not None else (msg.version, -1)
            return EvalResult(step=msg.step, version=low, version_max=high, ok=True,
                              metrics=metrics, lag_s=time.monotonic() - t0)

    async def _evaluate(self, msg: Evaluate) -> tuple[dict[str, float], tuple[int, int] | None]:
        mode = self.cfg.mode
        if mode == "external":
            return await self._external(msg), None
        if mode == "fleet":
            from miles.engines.embedded import launch_embedded_engine
            engine = await launch_embedded_engine(
                msg.checkpoint_dir, extra_args=["--torch-threads", "1"],
                log_path=self._logdir() / f"eval-engine-step{msg.step}.log")
            try:
                return await self._score(engine.url, EngineSet(gateway_url=engine.url, engine_urls=[engine.url],
                                                               model_path=msg.checkpoint_dir))
            finally:
                await engine.stop_async()
        rollout = self.runtime.ref("rollout")
        engines = await self.runtime.ref("engines").call(GetEngines())
        await rollout.call(PauseAdmission(paused=True))
        try:
            return await self._score(engines.gateway_url, engines)
        finally:
            await self._resume_admission(rollout)

    async def _resume_admission(self, rollout) -> None:
        # A rollout left paused would stall training: retry, and say so loudly if it never works.
        from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(5), reraise=True,
                                               wait=wait_exponential(multiplier=0.2, max=5.0)):
                with attempt:
                    await rollout.call(PauseAdmission(paused=False), timeout_s=10.0)
        except Exception as e:  # noqa: BLE001
            log.error("could not resume rollout admission after the evaluation: %s", e)
            raise

    def _logdir(self) -> Path:
        path = Path(self.recipe.output_dir) / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _score(self, url: str, engines: EngineSet | None = None) -> tuple[dict[str, float], tuple[int, int] | None]:
        from miles.engines.client import EngineClient, SamplingParams, parse_weight_version

        r = self.recipe
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens or r.rollout.max_new_tokens,
                                temperature=self.cfg.temperature, sampling_seed=r.run.seed)
        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        served: list[int] = []
        if r.rollout.generate or r.rollout.agent:
            engines = engines or EngineSet(gateway_url=url, engine_urls=[url], model_path=r.model.path)
            return await self._score_episodes(url, engines, params, limit)
        async with EngineClient(url) as client:
            async def one(prompt, j):
                ids = prompt_token_ids(self.tokenizer, prompt.prompt, r.data.apply_chat_template)
                async with limit:
                    result = await client.generate(ids, self._nth(params, prompt, j),
                                                   routing_key=f"eval-{prompt.index}")
                served.extend(parse_weight_version(s.version) for s in result.weight_versions)
                if not result.weight_versions and result.weight_version:
                    served.append(parse_weight_version(result.weight_version))
                sample = Sample(tokens=np.asarray(ids + result.output_ids, np.int32),
                                response_length=len(result.output_ids), label=prompt.label,
                                prompt=prompt.prompt, metadata=dict(prompt.metadata),
                                response=self.tokenizer.decode(result.output_ids, skip_special_tokens=True))
                sample.reward = await call_maybe_async(self.reward_fn, sample)
                return sample.scalar_reward(r.train.reward_key), len(result.output_ids)
            results = await self._per_prompt(one)
        return self._summary(results, served)

    def _nth(self, params, prompt, j: int):
        """Sample j of a prompt: its own seed, so the n samples of pass@k are n draws."""
        return msgspec.structs.replace(params, sampling_seed=eval_seed(self.recipe.run.seed,
                                                                       prompt.index, j))

    async def _per_prompt(self, one) -> list[list[tuple[float, int]]]:
        n = self.cfg.samples_per_prompt
        flat = await asyncio.gather(*(one(p, j) for p in self.prompts for j in range(n)))
        return [flat[i:i + n] for i in range(0, len(flat), n)]

    def _summary(self, results: list[list[tuple[float, int]]], served: list[int]):
        flat = [x for per_prompt in results for x in per_prompt]
        n = k = self.cfg.samples_per_prompt   # pass@k at k = n: the most the n samples can tell
        passed = [sum(x >= self.cfg.pass_threshold for x, _ in per_prompt) for per_prompt in results]
        metrics = {"eval/reward": float(np.mean([x for x, _ in flat])), "eval/n": float(len(results)),
                   "eval/response_len": float(np.mean([m for _, m in flat])),
                   "eval/pass@1": float(np.mean([pass_at_k(n, c, 1) for c in passed])),
                   "eval/pass@k": float(np.mean([pass_at_k(n, c, k) for c in passed])),
                   "eval/k": float(k)}
        # per-group pass@1 where the rows name their groups (metadata["eval_groups"], e.g. a bug's
        # difficulty and template): eval/<group>/pass@1
        groups: dict[str, list[int]] = {}
        for prompt, c in zip(self.prompts, passed):
            for g in (prompt.metadata or {}).get("eval_groups") or []:
                groups.setdefault(str(g), []).append(c)
        for g, cs in sorted(groups.items()):
            metrics[f"eval/{g}/pass@1"] = float(np.mean([pass_at_k(n, c, 1) for c in cs]))
        if not served:
            return metrics, None
        metrics["eval/version_min"], metrics["eval/version_max"] = float(min(served)), float(max(served))
        return metrics, (min(served), max(served))

    async def _score_episodes(self, url: str, engines: EngineSet, params, limit):
        """Each eval prompt as one episode of the configured depth (the worker's runner)."""
        from miles.engines.client import EngineClient
        from miles.envs.episode import EpisodeEnv, run_episode

        r = self.recipe
        served: list[int] = []
        async with EngineClient(url, generate_timeout_s=r.rollout.request_timeout_s) as client:
            env = await EpisodeEnv.open(r, engines, client, self.tokenizer, role="eval",
                                        incarnation=self.incarnation)
            try:
                async def one(prompt, j):
                    ids = prompt_token_ids(self.tokenizer, prompt.prompt, r.data.apply_chat_template)
                    key = f"eval-{prompt.index}"
                    sample = Sample(tokens=np.asarray(ids, np.int32), group_id=key,
                                    rollout_id=key if j == 0 else f"{key}-s{j}", prompt=prompt.prompt,
                                    label=prompt.label, metadata=dict(prompt.metadata))
                    async with limit:
                        samples = await run_episode(env, sample, self._nth(params, prompt, j))
                    served.extend(v.version for s in samples for v in s.weight_versions)
                    last = samples[-1]
                    ok = last.status in ("completed", "truncated")
                    return (last.scalar_reward(r.train.reward_key) if ok else 0.0), \
                        sum(s.response_length for s in samples)
                results = await self._per_prompt(one)
            finally:
                await env.close()
        return self._summary(results, served)

    async def _external(self, msg: Evaluate) -> dict[str, float]:
        cmd = self.cfg.command.format(checkpoint=msg.checkpoint_dir, step=msg.step)
        result = await run_command(f"eval.command (step {msg.step})", shlex.split(cmd),
                                   timeout_s=self.cfg.timeout_s,
                                   log_path=self._logdir() / f"eval-step{msg.step}.log")
        if result.exit_code != 0:
            raise RuntimeError(f"eval.command = {self.cfg.command!r} exited with {result.exit_code}: "
                               f"{result.output[-300:]}")
        lines = result.output.strip().splitlines()
        if not lines:
            raise RuntimeError(f"eval.command = {self.cfg.command!r} printed nothing (expected one "
                               f"JSON object of metrics on its last line; log {result.log_path})")
        return {f"eval/{k}": float(v) for k, v in json.loads(lines[-1]).items()}
