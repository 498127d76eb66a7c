"""The digits environment served by OpenEnv's `create_app` (HTTP + the /ws episode channel).

    uvicorn miles_digits_env.server:app
"""

from __future__ import annotations

import threading
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from .models import DigitsAction, DigitsObservation
from .scoring import MAX_ATTEMPTS, prompt_for, retry_prompt, score, target_for

_live = 0                 # instances made and not closed: the tests' leak check
_live_lock = threading.Lock()


class DigitsEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        global _live
        super().__init__()
        with _live_lock:
            _live += 1
        self._closed = False
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = ""
        self._fail = ""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              fail: str = "", **kwargs: Any) -> DigitsObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target = target_for(int(seed or 0))
        self._fail = fail
        if fail == "reset":
            raise RuntimeError("digits env: reset failed on purpose")
        return DigitsObservation(prompt=prompt_for(self._target), attempt=0, done=False, reward=None)

    def step(self, action: DigitsAction, timeout_s: Optional[float] = None, **kwargs: Any) -> DigitsObservation:
        if self._fail == "step":
            raise RuntimeError("digits env: step failed on purpose")
        self._state.step_count += 1
        s = score(action.message, self._target)
        done = s == 1.0 or self._state.step_count >= MAX_ATTEMPTS
        return DigitsObservation(prompt="" if done else retry_prompt(action.message, self._target),
                                 attempt=self._state.step_count, score=s, done=done,
                                 reward=s if done else 0.0)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        global _live
        if not self._closed:
            self._closed = True
            with _live_lock:
                _live -= 1


app = create_app(DigitsEnvironment, DigitsAction, DigitsObservation, env_name="miles_digits",
                 max_concurrent_envs=64)


@app.get("/miles/live")
def live() -> dict:
    return {"live": _live}


@app.on_event("shutdown")
def report() -> None:
    print(f"[miles_digits] live environments at shutdown: {_live}", flush=True)
