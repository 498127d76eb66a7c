"""A HUD environment for the Miles tests: one template, the prompt out, the answer in, the score out."""

from __future__ import annotations

import re

from hud import Environment

env = Environment("miles-digits")


def score(answer: str | None, digits: str) -> float:
    """The fraction of `digits` the answer's digits match, position by position."""
    want = digits.split()
    got = re.findall(r"\d", answer or "")
    return sum(a == b for a, b in zip(got, want)) / len(want)


@env.template(id="say_digits", description="Say the given digits.")
async def say_digits(digits: str, fail: str = ""):
    if fail == "start":
        raise RuntimeError("miles-digits: start failed on purpose")
    answer = yield f"Say the digits {digits}."
    if fail == "grade":
        raise RuntimeError("miles-digits: grading failed on purpose")
    yield score(answer, digits)
