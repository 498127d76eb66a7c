"""Scoring finished samples with the teacher's engines (`[teacher]`): `Sample.teacher_logprobs`.

Design decisions:
- One `/generate` per sample, through the teacher fleet's gateway: input_ids = the whole sample
  (prompt + response), `max_new_tokens = 0`, `return_logprob` with `logprob_start_len` = the
  prompt length. The engine's prompt log-probs then start at the first response token, each read
  from the logits of the position before it: entry i is log pi_teacher(response[i] |
  tokens[:prompt_length + i]), exactly what the trainer-side teacher pass computes
  (miles/backends/teacher.py). A reply with another count (or a missing first value) is refused,
  never shifted into place.
- The prompt log-probs are of the raw logits (temperature 1), as the trainer's own log-probs are
  at `train.temperature = 1`; a recipe with another temperature is refused at load.
- Transient errors (engine restarting, connection reset, 5xx) are retried with back-off for
  `rollout.engine_retry_s`, asking the fleet for its gateway again (the fleet itself may have been
  restarted on a new port); anything else raises, and the rollout worker marks the sample failed
  with the error (the buffer's policy retries or drops its group): a teacher never ends the run.
- The teacher must share the student's vocabulary (`check_vocab`, from both config.json files):
  token ids mean the same text only then.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from miles.wire.messages import GetEngines, Sample


def model_vocab_size(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def check_vocab(teacher_path: str, student_path: str) -> None:
    teacher, student = model_vocab_size(teacher_path), model_vocab_size(student_path)
    if teacher != student:
        raise ValueError(f"teacher.path = {teacher_path!r}: vocab_size {teacher} differs from the "
                         f"student's {student} ({student_path}); distillation needs the same tokenizer")


def aligned_teacher_logprobs(input_logprobs: list | None, sample: Sample) -> np.ndarray:
    """The engine's prompt log-probs from `logprob_start_len = prompt_length` as the sample's
    response-aligned float32 array; raises when they do not cover the response exactly."""
    n = sample.response_length
    if input_logprobs is None or len(input_logprobs) != n:
        got = "none" if input_logprobs is None else len(input_logprobs)
        raise ValueError(f"teacher engine returned {got} prompt log-probs for a response of {n} "
                         f"tokens (logprob_start_len = {sample.prompt_length})")
    if any(lp is None for lp in input_logprobs):
        raise ValueError("teacher engine returned a prompt log-prob of None inside the response")
    out = np.asarray(input_logprobs, np.float32)
    if not np.isfinite(out).all():
        raise ValueError("teacher engine returned a non-finite prompt log-prob")
    return out


async def score_sample(client, sample: Sample) -> np.ndarray:
    """One scoring request to a teacher engine (or gateway) `client`: the response-aligned
    float32 log-probs of `sample`'s response tokens under the teacher."""
    from miles.engines.client import SamplingParams

    if sample.response_length == 0:
        return np.zeros(0, np.float32)
    result = await client.generate(sample.tokens, SamplingParams(max_new_tokens=0, temperature=1.0),
                                   return_logprob=True, logprob_start_len=sample.prompt_length)
    return aligned_teacher_logprobs(result.input_logprobs, sample)


def transient(e: BaseException) -> bool:
    from miles.engines.client import EngineUnavailable
    return isinstance(e, (EngineUnavailable, ConnectionError, asyncio.TimeoutError))


class TeacherScorer:
    """The rollout worker's side of the teacher fleet: `await score(sample)` fills
    `sample.teacher_logprobs` or raises."""

    def __init__(self, fleet, recipe, student_path: str):
        self.fleet = fleet                    # an actor ref of the teacher fleet
        self.recipe = recipe
        self.student_path = student_path
        self.client = None
        self.counts = {"teacher_scored": 0, "teacher_failed": 0, "teacher_retried": 0}
        self.score_s = 0.0

    async def open(self) -> None:
        engines = await self.fleet.call(GetEngines(), timeout_s=self.recipe.teacher.engine.start_timeout_s)
        check_vocab(engines.model_path, self.student_path)
        await self._connect(engines.gateway_url)

    async def _connect(self, url: str) -> None:
        from miles.engines.client import EngineClient
        if self.client is not None and self.client.base_url == url.rstrip("/"):
            return
        if self.client is not None:
            await self.client.close()
        self.client = EngineClient(url, timeout_s=60.0, generate_timeout_s=self.recipe.teacher.request_timeout_s)

    async def _reconnect(self, state) -> None:
        self.counts["teacher_retried"] += 1
        try:
            engines = await self.fleet.call(GetEngines(), timeout_s=10.0)
            await self._connect(engines.gateway_url)
        except Exception:  # noqa: BLE001 - the fleet restarting: the next attempt asks again
            pass

    async def score(self, sample: Sample) -> None:
        t0 = time.monotonic()
        try:
            sample.teacher_logprobs = await self._score(sample)
            self.counts["teacher_scored"] += 1
        except Exception:
            self.counts["teacher_failed"] += 1
            raise
        finally:
            self.score_s += time.monotonic() - t0

    async def _score(self, sample: Sample) -> np.ndarray:
        async for attempt in AsyncRetrying(
                retry=retry_if_exception(transient), reraise=True,
                wait=wait_exponential(multiplier=0.2, max=5.0),
                stop=stop_after_delay(self.recipe.rollout.engine_retry_s), before_sleep=self._reconnect):
            with attempt:
                return await score_sample(self.client, sample)
        raise AssertionError("unreachable: tenacity reraises the last error")

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/{k}": float(v) for k, v in self.counts.items()}
        out["rollout/teacher_score_s"] = self.score_s
        return out

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
