"""NeMo Gym environments as a `rollout.agent`: each episode is one `POST <agent>/run` of NeMo Gym's
SimpleAgent against a real NeMo Gym resources server, with the episode's TITO session as the
policy (`policy_base_url`, the Responses API).

    [data]
    task = "miles.envs.nemo_gym_env:example_tasks"       # rows: NeMo Gym's own jsonl rows
    [rollout]
    agent = "miles.envs.nemo_gym_env:agent"

Bring your own: a NeMo Gym resources server class (a `SimpleResourcesServer` subclass with
`verify`, and tools as routes) importable in the NeMo Gym venv, named by `MILES_NEMO_GYM_RESOURCES`
("module:Class"); the data rows are NeMo Gym's jsonl rows (`responses_create_params` plus the
fields its `verify` reads), each in a row's `metadata["nemo_gym"]` (`gym_rows(path)` makes them).

Design decisions:
- NeMo Gym 0.4.0 is the last release for Python 3.12 (newer need 3.13.14), Miles runs 3.11: it
  lives in its own venv (`scripts/envs/setup_nemo_gym.sh`), and one server process of that venv
  (`miles/envs/servers/nemo_gym_server.py`) serves the resources server and the agent, a
  supervised child of the process that first needs it. `MILES_NEMO_GYM_URL` names an agent
  server run elsewhere instead.
- The whole protocol is NeMo Gym's: `/run` calls the resources server's `/seed_session`, the
  policy's `/v1/responses` (our session server), the tools, then `/verify`. Our sampling settings
  go into `responses_create_params` (temperature, top_p, max_output_tokens).
- The reward is the `/verify` answer's: `reward_components` (a dict reward, with `reward` added)
  when the server gives them, else `reward`. A failed `/run` (server down, an exception in the
  environment, a response without a reward) raises: the samples are `failed`, the error in
  `metadata["agent_error"]`; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = Path(__file__).resolve().parent / "servers" / "nemo_gym_server.py"
SETUP_SCRIPT = ROOT / "scripts" / "envs" / "setup_nemo_gym.sh"
DEFAULT_RESOURCES = "resources_servers.example_tool_call_multireward.app:ToolCallMultiRewardResourcesServer"
RUN_TIMEOUT_S = 1800.0


class NemoGymError(RuntimeError):
    """A NeMo Gym `/run` gave no reward: the server's error, or a malformed answer."""


def nemo_gym_python() -> str:
    """The NeMo Gym venv's python: `MILES_NEMO_GYM_PYTHON`, else what the set-up script made."""
    if os.environ.get("MILES_NEMO_GYM_PYTHON"):
        return os.environ["MILES_NEMO_GYM_PYTHON"]
    r = subprocess.run(["bash", str(SETUP_SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise NemoGymError(f"{SETUP_SCRIPT.relative_to(ROOT)} failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout)[-2000:]}")
    return lines[-1] if os.path.isabs(lines[-1]) else str(ROOT / lines[-1])


class _Process:
    """This process's NeMo Gym server (ours, or `MILES_NEMO_GYM_URL`)."""

    def __init__(self) -> None:
        self.server = None
        self.url = ""
        self.resources_url = ""
        self._lock = asyncio.Lock()

    async def ready(self) -> str:
        async with self._lock:
            if not self.url:
                self.url = os.environ.get("MILES_NEMO_GYM_URL", "").rstrip("/") or await self._start()
            return self.url

    async def _start(self) -> str:
        from miles.engines.procs import ServerProcess, free_port
        python = nemo_gym_python()
        rport, aport = free_port(), free_port()
        logs = Path(os.environ.get("MILES_NEMO_GYM_LOG_DIR") or (ROOT / ".cache" / "envs" / "nemo-gym-logs"))
        logs.mkdir(parents=True, exist_ok=True)
        resources = os.environ.get("MILES_NEMO_GYM_RESOURCES") or DEFAULT_RESOURCES
        self.server = ServerProcess("nemo-gym-server", [
            python, str(SERVER_SCRIPT), "--resources-port", str(rport), "--agent-port", str(aport),
            "--resources", resources], log_path=logs / f"nemo-gym-server-{os.getpid()}.log").start()
        url = f"http://127.0.0.1:{aport}"
        await self.server.wait_healthy(url, timeout_s=180.0)
        self.resources_url = f"http://127.0.0.1:{rport}"
        return url

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop_async(grace_s=5)
        self.server, self.url, self.resources_url = None, "", ""


_PROCESS = _Process()


async def close() -> None:
    """Stop this process's NeMo Gym server (tests, benchmarks; at exit it happens anyway)."""
    await _PROCESS.close()


def _sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    out = {k: sampling[k] for k in ("temperature", "top_p") if k in sampling}
    if "max_tokens" in sampling:
        out["max_output_tokens"] = sampling["max_tokens"]
    return out


def reward_of(verify: dict[str, Any]) -> float | dict[str, float]:
    """The verify response's reward: `reward_components` (+ `reward`) when given, else `reward`."""
    reward = verify.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise NemoGymError(f"verify response: reward = {reward!r} is not a finite number")
    components = verify.get("reward_components")
    if isinstance(components, dict) and components:
        out = {str(k): float(v) for k, v in components.items()}
        out["reward"] = float(reward)
        return out
    return float(reward)


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one NeMo Gym `/run` of the row `task["nemo_gym"]`, policy = `base_url`."""
    row = task.get("nemo_gym")
    if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
        raise NemoGymError("metadata.nemo_gym: expected a NeMo Gym row with responses_create_params, "
                           f"got {str(row)[:200]!r}")
    url = await _PROCESS.ready()
    params = {**row["responses_create_params"], **_sampling(task.get("sampling") or {})}
    body = {**row, "responses_create_params": params, "policy_base_url": base_url,
            "policy_api_key": task.get("api_key") or "none"}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)) as http:
        async with http.post(f"{url}/run", json=body) as r:
            text = await r.text()
    if r.status != 200:
        raise NemoGymError(f"nemo gym {url}/run: HTTP {r.status}: {text[:500]}")
    try:
        verify = json.loads(text)
    except ValueError:
        raise NemoGymError(f"nemo gym {url}/run: not JSON: {text[:300]!r}") from None
    if not isinstance(verify, dict):
        raise NemoGymError(f"nemo gym {url}/run: expected an object, got {text[:300]!r}")
    reward = reward_of(verify)
    output = (verify.get("response") or {}).get("output") or []
    return {"reward": reward, "metrics": {"nemo_gym_run_s": time.monotonic() - t0},
            "output": output, "input": params.get("input")}


def gym_rows(path: str | Path) -> list[dict[str, Any]]:
    """Miles data rows from a NeMo Gym jsonl file: the row under `metadata.nemo_gym`, the last
    user message as the prompt (for logs; the agent sends the row's own input)."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        params = row.get("responses_create_params")
        if not isinstance(params, dict) or "input" not in params:
            raise ValueError(f"{path}:{i + 1}: responses_create_params.input is missing")
        inp = params["input"]
        prompt = inp if isinstance(inp, str) else next(
            (m.get("content") for m in reversed(inp) if isinstance(m, dict) and m.get("role") == "user"), "")
        rows.append({"prompt": prompt if isinstance(prompt, str) else json.dumps(prompt), "label": "",
                     "metadata": {"nemo_gym": row}})
    return rows


def example_rows_path() -> Path:
    """The example jsonl the package ships with the multi-reward tool-call server (in its venv)."""
    python = Path(nemo_gym_python())
    found = sorted((python.parent.parent / "lib").glob(
        "python3.*/site-packages/resources_servers/example_tool_call_multireward/data/example.jsonl"))
    if not found:
        raise NemoGymError(f"the NeMo Gym venv of {python} has no example_tool_call_multireward data")
    return found[0]


def example_tasks(seed: int = 0, test_frac: float = 0.2) -> dict[str, list[dict[str, Any]]]:
    """`data.task` task set: NeMo Gym's example rows for its multi-reward tool-call server."""
    import random
    rows = gym_rows(example_rows_path())
    random.Random(seed).shuffle(rows)
    n_test = max(1, int(len(rows) * test_frac))
    return {"test": rows[:n_test], "train": rows[n_test:]}
