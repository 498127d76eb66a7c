"""Miles' glue for the digits environment with its typed client: the model's reply as a
`DigitsAction`, the observation as the next user message (here: with the attempt number)."""

from __future__ import annotations

from typing import Any

from .models import DigitsAction, DigitsObservation


def action(reply: str, observation: DigitsObservation, task: dict[str, Any]) -> DigitsAction:
    return DigitsAction(message=reply.strip())


def message(observation: DigitsObservation, task: dict[str, Any]) -> str:
    assert isinstance(observation, DigitsObservation), type(observation)   # the typed client's
    return observation.prompt if observation.attempt == 0 else f"[attempt {observation.attempt + 1}] {observation.prompt}"
