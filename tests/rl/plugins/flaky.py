"""Plug-ins that fail on purpose, loaded by import path in the reliability tests."""

from miles import plugins

_first_answer = plugins.load("rollout.reward", "first_answer")


def first_attempt_fails(sample):
    """The built-in reward, except that the first attempt of sample 0 of every other prompt
    fails: a transient error the buffer's policy retries."""
    if sample.index == 0 and sample.metadata["retries"] == 0 and sample.metadata["prompt_index"] % 2:
        raise RuntimeError("transient reward failure (first attempt)")
    return _first_answer(sample)
