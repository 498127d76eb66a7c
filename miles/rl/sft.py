"""The SFT warm start's rows and the figures that judge it.

    sft_sample(tok, prompt, name)          one prompt/answer row as a training Sample
    EpochLoss                              the mean step loss of every epoch (not the last batch)
    await reproduction(url, tok, prompts)  greedy reproduction and summed NLL per row, on the engines

Design decisions:
- The loss on the console used to be the last batch's: one batch says little, and a token-mean
  loss hides the few decisive tokens of an episode (at a token-mean of 0.04 over 170 tokens an
  exact episode has probability e^-7). So a warm start reports, per epoch, the mean of its steps'
  losses (every row of the epoch counted once: the rows are reshuffled per epoch, seeded by
  `run.seed` and the epoch, `miles.rl.sources.make_source`), and at the end two per-row figures.
- `sft/greedy_reproduced`: the fraction of rows whose answer greedy decoding reproduces token for
  token. Greedy decoding reproduces the answer exactly when every answer token is the argmax under
  teacher forcing, so this is that fraction; for a transcript row it is "the policy replays the
  transcript given the same tool results".
- `sft/row_nll`: the mean over rows of the summed NLL of the answer tokens (nats per row; exp(-x)
  is the probability of sampling the row's answer exactly at temperature 1).
- Both are measured on the engines after the warm start's weights are published (prompt log-probs
  as the teacher scorer reads them, `miles.rl.teacher_scores.score_sample`), not in the trainer:
  the numbers are those of the policy that rollout and eval will sample, and no backend changes.
  At most `REPRODUCTION_ROWS` rows (the first of the first epoch's seeded order) are scored.
"""

from __future__ import annotations

import asyncio

import numpy as np

from miles.rl.data import Prompt
from miles.rl.teacher_scores import score_sample
from miles.wire.messages import Sample

REPRODUCTION_ROWS = 128   # rows scored at the end of the warm start (two engine requests each)
CONCURRENCY = 8


def sft_sample(tok, prompt: Prompt, name: str) -> Sample:
    """Loss on the answer (and its end-of-sequence token) only."""
    ids = tok.encode(prompt.prompt, add_special_tokens=False)
    answer = tok.encode(prompt.label, add_special_tokens=False) + [tok.eos_token_id]
    return Sample(tokens=np.asarray(ids + answer, np.int32), response_length=len(answer),
                  loss_mask=np.ones(len(answer), np.uint8), rollout_id=name, status="completed",
                  reward=0.0)


class EpochLoss:
    """Step losses grouped by epoch (a step belongs to the epoch its first row came from)."""

    def __init__(self):
        self.epoch, self.losses = 0, []

    def add(self, epoch: int, loss: float) -> dict[str, float] | None:
        """The finished epoch's figures when `epoch` starts a new one, else None."""
        done = self.close() if epoch != self.epoch and self.losses else None
        self.epoch = epoch
        self.losses.append(float(loss))
        return done

    def close(self) -> dict[str, float]:
        out = {"sft/epoch": float(self.epoch), "sft/loss_epoch": float(np.mean(self.losses)),
               "sft/steps_in_epoch": float(len(self.losses))}
        self.losses = []
        return out


async def reproduction(url: str, tok, prompts: list[Prompt]) -> dict[str, float]:
    """Greedy reproduction and summed answer NLL per row, under the weights `url` serves now."""
    from miles.engines.client import EngineClient, SamplingParams

    limit = asyncio.Semaphore(CONCURRENCY)
    async with EngineClient(url) as client:
        async def one(i: int, p: Prompt) -> tuple[bool, float]:
            s = sft_sample(tok, p, f"sft-check-{i}")
            answer = s.tokens[s.prompt_length:].tolist()
            async with limit:
                greedy = await client.generate(s.tokens[:s.prompt_length].tolist(),
                                               SamplingParams(max_new_tokens=len(answer), temperature=0.0))
                logprobs = await score_sample(client, s)
            return list(greedy.output_ids) == answer, -float(np.sum(logprobs, dtype=np.float64))
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {"sft/greedy_reproduced": float(np.mean([ok for ok, _ in results])),
            "sft/row_nll": float(np.mean([nll for _, nll in results])),
            "sft/rows_checked": float(len(results))}
