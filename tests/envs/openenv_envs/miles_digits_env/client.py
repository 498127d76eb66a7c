"""The digits environment's typed OpenEnv client (what an OpenEnv env package ships)."""

from __future__ import annotations

from typing import Any, Dict

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from .models import DigitsAction, DigitsObservation


class DigitsEnv(EnvClient[DigitsAction, DigitsObservation, State]):
    def _step_payload(self, action: DigitsAction) -> Dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: Dict[str, Any]) -> StepResult[DigitsObservation]:
        obs = payload.get("observation", {})
        observation = DigitsObservation(prompt=obs.get("prompt", ""), attempt=obs.get("attempt", 0),
                                        score=obs.get("score", 0.0), done=payload.get("done", False),
                                        reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: Dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))
