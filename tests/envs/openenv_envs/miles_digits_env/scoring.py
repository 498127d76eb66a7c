"""The digits environment's task and its scoring: plain Python (no OpenEnv import), so a test
in Miles' venv recomputes the reward the environment gave."""

from __future__ import annotations

import random
import re

N_DIGITS = 3
MAX_ATTEMPTS = 2


def target_for(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(str(rng.randrange(10)) for _ in range(N_DIGITS))


def prompt_for(target: str) -> str:
    return f"Say the digits {target}."


def retry_prompt(reply: str, target: str) -> str:
    return f"You said {reply.strip()[:40]!r}. Say the digits {target}."


def score(reply: str, target: str) -> float:
    """The fraction of target digits the reply's digits match, position by position."""
    want = target.split()
    got = re.findall(r"\d", reply)
    return sum(a == b for a, b in zip(got, want)) / len(want)
