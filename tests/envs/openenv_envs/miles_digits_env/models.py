"""The digits environment's wire types (OpenEnv pydantic models)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class DigitsAction(Action):
    message: str = Field(..., description="The model's reply")


class DigitsObservation(Observation):
    prompt: str = Field(default="", description="What the model is asked to say")
    attempt: int = Field(default=0, description="Replies given so far")
    score: float = Field(default=0.0, description="The last reply's score")
