"""The OpenEnv episode driver: runs in the OpenEnv venv (not Miles'), one episode per `POST /run`.

    python miles/envs/servers/openenv_server.py --port P      # started by miles.envs.openenv_env

Each `/run` opens one OpenEnv client session (the environment's `EnvClient` subclass, or
`GenericEnvClient`) on the environment server's WebSocket channel, resets it, and loops: the
observation becomes a user message, the policy answers through the episode's TITO session
(`base_url`, OpenAI chat completions), the answer becomes the environment's action, `step` returns
`StepResult(observation, reward, done)`. The session is closed when the episode ends, whatever
the outcome. `GET /health` answers once the server is up.

Design decisions:
- Only OpenEnv, its dependencies (FastAPI, uvicorn, openai) and the stdlib are imported: Miles'
  own packages are not installed in this venv, and the env's client and action classes are.
- The glue between text and the environment is data for a simple text environment
  (`action_field`: the action's text field; `observation_field`: the observation's text shown to
  the model) or code for any other one (`glue`: a module with `action(reply, observation, task)`
  and/or `message(observation, task)`), imported here where the env's own classes are.
- The episode's reward is the environment's: the sum of the `StepResult` rewards (None counts as
  0; an environment that scores at the end gives its final reward). Every step's reward is
  returned too.
- An episode that ends without `done` (`max_turns` replies) says so (`done: false`); the adapter
  marks it truncated. Errors (the environment's, the server's, the policy's) come back as
  `{"status": "error", "error": ...}` with HTTP 200 and the messages so far, so the adapter can
  say which call failed.
- The episodes' OpenAI clients share one httpx client: one each costs an SSL context, 0.2 s an
  episode, measured as most of the driver's own time.
- The assistant message goes back into the history exactly as the session server returned it,
  so the session appends only the new user turn (token-exact multi-turn).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import pkgutil
import time
from typing import Any

from fastapi import FastAPI, Request

app = FastAPI()
_http: Any = None   # one HTTP client for every episode's policy calls (see _policy)


def _policy(req: dict[str, Any]) -> Any:
    """An OpenAI client on this episode's session. They share one httpx client: making one per
    client builds an SSL context, 0.2 s each (most of an episode's overhead, measured)."""
    global _http
    import openai
    if _http is None:
        _http = openai.DefaultAsyncHttpxClient(timeout=float(req.get("turn_timeout_s") or 120.0))
    return openai.AsyncOpenAI(base_url=req["base_url"].rstrip("/") + "/v1", api_key=req.get("api_key") or "none",
                              timeout=float(req.get("turn_timeout_s") or 120.0), max_retries=0, http_client=_http)


def _observation_dict(observation: Any) -> dict[str, Any]:
    if isinstance(observation, dict):
        return observation
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    return dict(vars(observation))


def _message(observation: Any, req: dict[str, Any], glue: Any) -> str:
    if glue is not None and hasattr(glue, "message"):
        return str(glue.message(observation, req.get("task") or {}))
    obs = _observation_dict(observation)
    field = req.get("observation_field") or "prompt"
    if field not in obs:
        raise KeyError(f"openenv.observation_field = {field!r}: the observation has fields {sorted(obs)}")
    return str(obs[field])


def _action(reply: str, observation: Any, req: dict[str, Any], glue: Any) -> Any:
    if glue is not None and hasattr(glue, "action"):
        return glue.action(reply, observation, req.get("task") or {})
    return {req.get("action_field") or "message": reply}


async def _episode(req: dict[str, Any], out: dict[str, Any]) -> None:
    client_cls = pkgutil.resolve_name(req.get("client") or "openenv.core.generic_client:GenericEnvClient")
    glue = importlib.import_module(req["glue"]) if req.get("glue") else None
    sampling = dict(req.get("sampling") or {})
    extra = {k: sampling.pop(k) for k in ("top_k",) if k in sampling}
    policy = _policy(req)
    timings = out["timings"]
    messages = out["messages"]
    t = time.monotonic()
    # one env session per episode (the server's /ws), closed by the context in every outcome
    async with client_cls(base_url=req["env_url"],
                          message_timeout_s=float(req.get("env_timeout_s") or 60.0)) as env:
        out["phase"] = "reset"
        result = await env.reset(**(req.get("reset") or {}))
        timings["env_s"] += time.monotonic() - t
        messages.append({"role": "user", "content": _message(result.observation, req, glue)})
        for _ in range(int(req.get("max_turns") or 4)):
            out["phase"] = "policy"
            t = time.monotonic()
            reply = await policy.chat.completions.create(model="policy", messages=messages, **sampling,
                                                         extra_body=extra or None)
            timings["llm_s"] += time.monotonic() - t
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            out["phase"] = "step"
            t = time.monotonic()
            result = await env.step(_action(message.content or "", result.observation, req, glue))
            timings["env_s"] += time.monotonic() - t
            out["step_rewards"].append(result.reward)
            out["steps"] += 1
            if result.done:
                out["done"] = True
                break
            messages.append({"role": "user", "content": _message(result.observation, req, glue)})
        out["last_observation"] = _observation_dict(result.observation)
        t = time.monotonic()
    timings["env_s"] += time.monotonic() - t


@app.post("/run")
async def run(request: Request) -> dict[str, Any]:
    req = await request.json()
    out: dict[str, Any] = {"status": "ok", "messages": [], "step_rewards": [], "steps": 0, "done": False,
                           "timings": {"env_s": 0.0, "llm_s": 0.0}, "phase": "connect"}
    try:
        await asyncio.wait_for(_episode(req, out), float(req.get("episode_timeout_s") or 600.0))
    except Exception as e:  # noqa: BLE001 - every failure goes back to the adapter, named
        out["status"] = "error"
        out["error"] = f"{out['phase']}: {type(e).__name__}: {e}"
    out["reward"] = float(sum(r or 0.0 for r in out["step_rewards"]))
    return json.loads(json.dumps(out, default=str))


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    # OpenEnv's client package and openai take seconds to import on a busy 2-core machine: before
    # /health answers, not in the first episode (measured: 38 s of a first episode, then 0.6 s)
    import openai  # noqa: F401
    from openenv.core.generic_client import GenericEnvClient  # noqa: F401
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
