"""Reward functions: built-ins for exact match and math answers, and user functions by import path.

Contract: `async def reward(sample) -> float | dict[str, float]` (a plain function works too),
or, with `rollout.reward_batched = true`, `async def reward(samples) -> list[...]` called once per
group (for reward models that batch); the contract and the loader are `miles.plugins`
(`rollout.reward`), which names the built-ins below. The sample carries `response` (decoded text), `label`,
`prompt` and `metadata`.

Design decisions:
- A failing reward function fails that sample (status "failed", reward None), not the run; the
  buffer's policy decides what happens to its group.
- `math` extracts the last number (or a \\boxed{...}) of the response and compares it
  numerically with the label, which is what verifiable-reward math tasks use.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any, Callable

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _norm(text: str) -> str:
    return " ".join(text.strip().split()).lower()


def exact_match(sample) -> float:
    if sample.label is None:
        raise ValueError("exact_match needs a label")
    return float(_norm(sample.response) == _norm(sample.label))


def extract_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_answer(sample) -> float:
    if sample.label is None:
        raise ValueError("math needs a label")
    got = extract_answer(sample.response)
    if got is None:
        return 0.0
    try:
        return float(abs(float(got) - float(sample.label)) < 1e-6)
    except ValueError:
        return float(_norm(got) == _norm(sample.label))


def first_answer(sample) -> float:
    """The first number of the response must equal the label (no credit for later guesses)."""
    if sample.label is None:
        raise ValueError("first_answer needs a label")
    numbers = _NUMBER.findall(sample.response)
    return float(bool(numbers) and numbers[0] == sample.label.strip())


async def call_maybe_async(fn: Callable, *args) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


async def call_off_loop(fn: Callable, *args, **kwargs) -> Any:
    """Await an async reward; run a plain one in a thread, so a slow one never stalls the event
    loop (and the actor's heartbeats)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*args, **kwargs)
    out = await asyncio.to_thread(fn, *args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def check_reward(value: Any, where: str) -> float | dict[str, float]:
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ValueError(f"{where}: reward must be a number or a dict of numbers, got {value!r}")
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    return float(value)
