"""OpenEnv environments as a `rollout.agent`: each episode is one OpenEnv client session (reset, then
step until done) on a real OpenEnv environment server, the policy speaking through the episode's
TITO session.

    [data]
    task = "miles.envs.openenv_env:example_tasks"   # or rows naming metadata.openenv
    [rollout]
    agent = "miles.envs.openenv_env:agent"

Bring your own: an OpenEnv environment (an `Environment` subclass served by `create_app`, its
`Action`/`Observation` models, optionally its `EnvClient` subclass) installed in the OpenEnv venv
or on `pythonpath`, and data rows whose `metadata.openenv` says where it is:

    {"app": "my_env.server:app",        # started here with uvicorn; or "url": a running server
     "pythonpath": ["envs"],            # directories (relative to the repo) the env imports from
     "client": "my_env.client:MyEnv",   # default: OpenEnv's GenericEnvClient (dict actions)
     "action_field": "message",         # the action's text field the model's reply fills
     "observation_field": "prompt",     # the observation's text shown to the model
     "glue": "my_env.miles_glue",       # or code: action(reply, obs, task) / message(obs, task)
     "reset": {"seed": 3}}              # this episode's reset() arguments

Design decisions:
- OpenEnv cannot live in Miles' venv (it requires gradio, which caps huggingface-hub < 2 and
  pillow < 13), so it has its own (`scripts/envs/setup_openenv.sh`, Python 3.12). Two supervised
  children of the process that first needs them, started once per process and stopped at its
  exit: the environment server (uvicorn on the `app`) and our episode driver
  (`miles/envs/servers/openenv_server.py`, `POST /run`), which holds the OpenEnv client classes.
  `MILES_OPENENV_PYTHON` names another interpreter with OpenEnv installed.
- One OpenEnv session per episode: the driver opens the client's WebSocket (`/ws`: the server
  makes one environment instance per connection) and closes it when the episode ends.
- The reward is the environment's: the sum of the `StepResult` rewards (an environment that
  scores at the end gives its final reward); per-step rewards go to `metadata["agent"]`.
- A failed environment call (server down, an exception in the env, a bad response) raises here
  with the driver's error (which call failed and why): the agent layer marks the samples
  `failed` with it in `metadata["agent_error"]`, keeps their tokens, and the run goes on.
- An episode that used `agent.max_turns` replies without `done` is `truncated`.
- Tokens are exact by construction: every model call goes to the session endpoint (`base_url`);
  the conversation comes back in `metadata["agent"]["messages"]` so a test can check it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from miles.tito.families import get_family
from miles.tito.messages import parse_openai_messages

ROOT = Path(__file__).resolve().parents[2]
DRIVER_SCRIPT = Path(__file__).resolve().parent / "servers" / "openenv_server.py"
SETUP_SCRIPT = ROOT / "scripts" / "envs" / "setup_openenv.sh"
EXAMPLE_ENVS = ROOT / "tests" / "envs" / "openenv_envs"
RUN_TIMEOUT_S = 1800.0
START_TIMEOUT_S = 120.0
SPEC_KEYS = {"app", "url", "pythonpath", "client", "action_field", "observation_field", "glue", "reset"}


class OpenEnvError(RuntimeError):
    """An OpenEnv episode gave no reward: the environment's error, or the driver's."""


def openenv_python() -> str:
    """The OpenEnv venv's python: `MILES_OPENENV_PYTHON`, else what the (idempotent) set-up script
    made. Its failure is an error naming the script and its output."""
    if os.environ.get("MILES_OPENENV_PYTHON"):
        return os.environ["MILES_OPENENV_PYTHON"]
    r = subprocess.run(["bash", str(SETUP_SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise OpenEnvError(f"{SETUP_SCRIPT.relative_to(ROOT)} failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout)[-2000:]}")
    return lines[-1] if os.path.isabs(lines[-1]) else str(ROOT / lines[-1])


def check_spec(spec: Any) -> dict[str, Any]:
    """`metadata.openenv`, checked: errors name the key and the value."""
    if not isinstance(spec, dict):
        raise OpenEnvError(f"metadata.openenv: expected a table (app or url, client, ...), got {spec!r:.200}")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise OpenEnvError(f"metadata.openenv: unknown keys {sorted(unknown)}; expected some of {sorted(SPEC_KEYS)}")
    if bool(spec.get("app")) == bool(spec.get("url")):
        raise OpenEnvError(f"metadata.openenv: give exactly one of app (an import path to start) or url "
                           f"(a running server), got app={spec.get('app')!r} url={spec.get('url')!r}")
    for key in ("app", "url", "client", "action_field", "observation_field", "glue"):
        if key in spec and not isinstance(spec[key], str):
            raise OpenEnvError(f"metadata.openenv.{key}: expected a string, got {spec[key]!r:.200}")
    if spec.get("app") and ":" not in spec["app"]:
        raise OpenEnvError(f"metadata.openenv.app: expected 'module:attribute' of the create_app app, "
                           f"got {spec['app']!r}")
    paths = spec.get("pythonpath", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise OpenEnvError(f"metadata.openenv.pythonpath: expected a list of directories, got {paths!r:.200}")
    if not isinstance(spec.get("reset", {}), dict):
        raise OpenEnvError(f"metadata.openenv.reset: expected a table of reset() arguments, got {spec['reset']!r:.200}")
    return spec


class _Servers:
    """This process's OpenEnv children: one driver and one env server per (app, pythonpath)."""

    def __init__(self) -> None:
        self.procs: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        self._lock = asyncio.Lock()

    async def driver(self, pythonpath: list[str]) -> str:
        key = "driver:" + os.pathsep.join(pythonpath)
        return await self._ensure(key, [str(DRIVER_SCRIPT)], pythonpath, "openenv-driver")

    async def env_server(self, app: str, pythonpath: list[str]) -> str:
        key = f"env:{app}:" + os.pathsep.join(pythonpath)
        return await self._ensure(key, ["-m", "uvicorn", app, "--host", "127.0.0.1", "--log-level", "warning"],
                                  pythonpath, "openenv-env")

    async def _ensure(self, key: str, argv: list[str], pythonpath: list[str], name: str) -> str:
        async with self._lock:
            if key in self.urls and self.procs[key].alive:
                return self.urls[key]
            from miles.engines.procs import ServerProcess, free_port
            python = await asyncio.to_thread(openenv_python)
            port = free_port()
            logs = Path(os.environ.get("MILES_OPENENV_LOG_DIR") or (ROOT / ".cache" / "envs" / "openenv-logs"))
            logs.mkdir(parents=True, exist_ok=True)
            tag = hashlib.sha1(key.encode()).hexdigest()[:8]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in pythonpath),
                   "ENABLE_WEB_INTERFACE": "false"}   # no gradio UI: nothing but the episode API
            proc = ServerProcess(name, [python, *argv, "--port", str(port)], env=env, cwd=ROOT,
                                 log_path=logs / f"{name}-{tag}-{os.getpid()}.log").start()
            url = f"http://127.0.0.1:{port}"
            try:
                await proc.wait_healthy(url, timeout_s=START_TIMEOUT_S)
            except BaseException:
                await proc.stop_async(grace_s=2)
                raise
            self.procs[key], self.urls[key] = proc, url
            return url

    async def close(self) -> None:
        procs, self.procs, self.urls = list(self.procs.values()), {}, {}
        await asyncio.gather(*(p.stop_async(grace_s=5) for p in procs))


_SERVERS = _Servers()


async def close() -> None:
    """Stop this process's OpenEnv servers (tests, benchmarks; at exit it happens anyway)."""
    await _SERVERS.close()


def log_paths() -> list[Path]:
    """The logs of this process's OpenEnv children (tests read the env server's shutdown line)."""
    return [p.log_path for p in _SERVERS.procs.values()]


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one OpenEnv episode of the environment `task["openenv"]` names."""
    spec = check_spec(task.get("openenv"))
    pythonpath = list(spec.get("pythonpath") or [])
    driver = await _SERVERS.driver(pythonpath)
    env_url = spec.get("url") or await _SERVERS.env_server(spec["app"], pythonpath)
    limits = task.get("limits") or {}
    request = {"env_url": env_url, "base_url": base_url, "api_key": task.get("api_key") or "none",
               "sampling": dict(task.get("sampling") or {}), "max_turns": int(limits.get("max_turns") or 4),
               "turn_timeout_s": float(limits.get("turn_timeout_s") or 120.0),
               "episode_timeout_s": float(limits.get("episode_timeout_s") or 600.0),
               "reset": dict(spec.get("reset") or {}), "task": {"prompt": task.get("prompt"), "label": task.get("label")},
               **{k: spec[k] for k in ("client", "action_field", "observation_field", "glue") if k in spec}}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)) as http:
        try:
            async with http.post(f"{driver}/run", json=request) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            raise OpenEnvError(f"openenv driver {driver}/run: {type(e).__name__}: {e}") from None
    if r.status != 200 or not isinstance(body, dict):
        raise OpenEnvError(f"openenv driver {driver}/run: HTTP {r.status}: {str(body)[:500]}")
    if body.get("status") != "ok":
        raise OpenEnvError(f"openenv episode on {env_url}: {body.get('error') or 'no reward'}")
    wall = time.monotonic() - t0
    timings = {k: float(v) for k, v in (body.get("timings") or {}).items()}
    out = {"reward": float(body["reward"]), "step_rewards": body.get("step_rewards") or [],
           "steps": int(body.get("steps") or 0), "done": bool(body.get("done")),
           "messages": body.get("messages") or [], "last_observation": body.get("last_observation"),
           "metrics": {"openenv_episode_s": wall, "openenv_steps": float(body.get("steps") or 0),
                       **{f"openenv_{k}": v for k, v in timings.items()}}}
    if not out["done"]:
        out["status"] = "truncated"
    return out


def example_rows(n: int, seed: int = 0, **spec: Any) -> list[dict[str, Any]]:
    """`n` rows of the test suite's digits environment (tests/envs/openenv_envs/miles_digits_env),
    started from its create_app app; `spec` overrides `metadata.openenv` keys."""
    sys.path.insert(0, str(EXAMPLE_ENVS))
    try:
        from miles_digits_env.scoring import prompt_for, target_for
    finally:
        sys.path.remove(str(EXAMPLE_ENVS))
    rows = []
    for i in range(n):
        episode_seed = seed * 100_000 + i
        target = target_for(episode_seed)
        meta = {"openenv": {"app": "miles_digits_env.server:app",
                            "pythonpath": [str(EXAMPLE_ENVS.relative_to(ROOT))],
                            "client": "openenv.core.generic_client:GenericEnvClient",
                            "action_field": "message", "observation_field": "prompt",
                            "reset": {"seed": episode_seed}, **spec}}
        rows.append({"prompt": prompt_for(target), "label": target, "metadata": meta})
    return rows


def example_tasks(seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict[str, Any]]]:
    """`data.task` task set: 64 digits episodes, split train/test, and SFT rows (the first turn's
    prompt as the session renders it, the digits as the answer) from other seeds."""
    rows = example_rows(64, seed)
    n_test = max(1, int(len(rows) * test_frac))
    sft = [(r["prompt"], r["label"]) for r in example_rows(2000, seed + 1)]
    return {"test": rows[:n_test], "train": rows[n_test:], "sft": sft_rows(sft)}


def sft_rows(pairs: list[tuple[str, str]], family: str = "qwen3") -> list[dict[str, str]]:
    """Warm-start rows: a one-turn chat (`prompt`, rendered as the session server renders it) and
    the answer the model should give (shared with the HUD example)."""
    fam = get_family(family)
    return [{"prompt": fam.render(parse_openai_messages([{"role": "user", "content": p}]), None, 0, True),
             "label": answer} for p, answer in pairs]
