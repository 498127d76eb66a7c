"""Evaluator: scores the policy on the held-out set, in one of three modes by where weights come from.

- `shared`: through the rollout engines' gateway (the weights they serve now). Rollout
  admission is paused for the duration so a small debug set is not drowned by training traffic.
- `fleet`: a dedicated embedded engine loaded from the checkpoint snapshot of that step
  (`checkpoint_dir/hf`), started for the evaluation and stopped after it.
- `external`: a user command (`eval.command`, with `{checkpoint}` and `{step}` filled in) that
  prints one JSON object of metrics on its last line.

Every result carries the step and version it belongs to and its lag (seconds from the request to
the result). A failed evaluation returns `ok = false` with the error: that point is skipped and
training goes on.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time

import numpy as np

from miles.actors.base import Actor
from miles.rl.rewards import call_maybe_async, load_function
from miles.wire.messages import EvalResult, Evaluate, GetEngines, PauseAdmission, Sample


class Evaluator(Actor):
    def __init__(self, name: str = "evaluator"):
        super().__init__(name)
        self.lock = asyncio.Lock()

    async def on_start(self) -> None:
        from miles.rl.sources import make_source, tokenizer_for

        r = self.recipe
        self.cfg = r.eval
        self.reward_fn = load_function(r.rollout.reward, "rollout.reward")
        self.tokenizer = tokenizer_for(r.model.path)
        if self.cfg.mode in ("shared", "fleet"):
            source = make_source(r, split="eval")
            n = self.cfg.n_prompts or len(source.rows)
            self.prompts = [next(source) for _ in range(min(n, len(source.rows)))]

    async def on_evaluate(self, msg: Evaluate) -> EvalResult:
        t0 = time.monotonic()
        async with self.lock:
            try:
                metrics = await asyncio.wait_for(self._evaluate(msg), self.cfg.timeout_s)
                return EvalResult(step=msg.step, version=msg.version, ok=True, metrics=metrics,
                                  lag_s=time.monotonic() - t0)
            except Exception as e:
                return EvalResult(step=msg.step, version=msg.version, ok=False,
                                  lag_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")

    async def _evaluate(self, msg: Evaluate) -> dict[str, float]:
        mode = self.cfg.mode
        if mode == "external":
            return await self._external(msg)
        if mode == "fleet":
            from miles.engines.embedded import launch_embedded_engine
            engine = await launch_embedded_engine(f"{msg.checkpoint_dir}/hf",
                                                  extra_args=["--torch-threads", "1"])
            try:
                return await self._score(engine.url)
            finally:
                await engine.stop_async()
        rollout = self.runtime.ref("rollout")
        engines = await self.runtime.ref("engines").call(GetEngines())
        await rollout.call(PauseAdmission(paused=True))
        try:
            return await self._score(engines.gateway_url)
        finally:
            await rollout.call(PauseAdmission(paused=False))

    async def _score(self, url: str) -> dict[str, float]:
        from miles.engines.client import EngineClient, SamplingParams

        r = self.recipe
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens or r.rollout.max_new_tokens,
                                temperature=self.cfg.temperature, sampling_seed=r.run.seed)
        async with EngineClient(url) as client:
            async def one(prompt):
                ids = self.tokenizer.encode(prompt.prompt, add_special_tokens=False)
                result = await client.generate(ids, params, routing_key=f"eval-{prompt.index}")
                sample = Sample(tokens=np.asarray(ids + result.output_ids, np.int32),
                                response_length=len(result.output_ids), label=prompt.label,
                                prompt=prompt.prompt, metadata=dict(prompt.metadata),
                                response=self.tokenizer.decode(result.output_ids, skip_special_tokens=True))
                reward = await call_maybe_async(self.reward_fn, sample)
                return float(next(iter(reward.values())) if isinstance(reward, dict) else reward), \
                    len(result.output_ids)
            results = await asyncio.gather(*(one(p) for p in self.prompts))
        rewards = [x for x, _ in results]
        return {"eval/reward": float(np.mean(rewards)), "eval/n": float(len(rewards)),
                "eval/response_len": float(np.mean([n for _, n in results]))}

    async def _external(self, msg: Evaluate) -> dict[str, float]:
        cmd = self.cfg.command.format(checkpoint=msg.checkpoint_dir, step=msg.step)
        proc = await asyncio.create_subprocess_exec(*shlex.split(cmd), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"eval.command exited with {proc.returncode}: {out.decode()[-300:]}")
        last = out.decode().strip().splitlines()[-1]
        return {f"eval/{k}": float(v) for k, v in json.loads(last).items()}
