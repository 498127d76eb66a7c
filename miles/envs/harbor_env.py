"""Harbor tasks as a `rollout.agent`: each episode is one Harbor `Trial`, run by Harbor's own trial
machinery in a Harbor trial server, in the episode's Miles sandbox, with the model behind the
episode's TITO session.

    [data]
    task = "miles.envs.harbor_env:example_tasks"        # or rows naming metadata.harbor_task
    [rollout]
    agent = "miles.envs.harbor_env:agent"
    [sandbox]
    backend = "subprocess"                               # any Miles backend

Bring your own: a directory of Harbor tasks (`task.toml`, `instruction.md`, `environment/`,
`tests/test.sh` writing /logs/verifier/reward.txt or reward.json); `task_rows(dir)` makes the data
rows (prompt = instruction.md, `metadata.harbor_task` = the task's path), or write them yourself.
A row's `metadata.harbor_agent` ({"name": "terminus-2"} or {"import_path": "pkg.mod:Agent",
"kwargs": {...}}) picks another Harbor agent than the built-in chat agent.

Design decisions:
- Harbor needs Python >= 3.12 and Miles runs on 3.11, so Harbor lives in its own venv
  (`scripts/envs/setup_harbor.sh`) and runs as a separate server (`POST /run`, `GET /health`,
  `miles/envs/servers/harbor_server.py`), a supervised child of the process that first needs it,
  started once per process. `MILES_HARBOR_URL` points at a server run elsewhere instead.
- The sandbox stays ours: the server's Harbor environment (`BridgeEnvironment`) calls back into
  this process over a small HTTP bridge (exec/upload/upload_dir/download, bytes as base64), and
  the bridge runs each call in the episode's `task["sandbox"]`. The episode runner creates and
  destroys it as for any agent; Harbor's start/stop of the agent's environment touch nothing. One
  token per episode names its sandbox on the bridge; it is dropped when the episode ends.
- Users are Harbor's: each bridged exec runs as the user Harbor resolved for it (`[agent] user`
  for the agent's commands, `[verifier] user` for tests/test.sh, root for its own set-up), through
  the sandbox's `exec(user=)`; a backend that cannot switch users fails the trial naming the user.
- A task whose verifier runs separately (`[verifier] environment_mode = "separate"` or a
  `[verifier.environment]` table) gets a fresh sandbox for Harbor's verifier environment, from
  the episode's pool (`verifier_spec` of our loader's reading of the task): the bridge's
  `open_verifier` when Harbor starts that environment (a token of its own), `close` when Harbor
  stops it, or the episode's end, whichever is first. Harbor copies the agent's artifacts in.
- The reward is Harbor's: its verifier's `rewards` (`reward.json` as a dict reward, `reward.txt`
  as a float). A trial that failed (Harbor's exception, no reward file, server down, bad answer)
  raises here, so the agent layer marks the samples `failed` with the error in
  `metadata["agent_error"]`; the run goes on.
- Tokens are exact by construction: every model call goes to the session endpoint (`base_url`);
  the trial's messages come back in `metadata["agent"]["messages"]` so a test can check them.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, AsyncContextManager, Callable

import aiohttp
from aiohttp import web

from miles.envs.context import run_to_end
from miles.sandboxes.harbor import load_task, task_sandbox, verifier_spec

ROOT = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = Path(__file__).resolve().parent / "servers" / "harbor_server.py"
SETUP_SCRIPT = ROOT / "scripts" / "envs" / "setup_harbor.sh"
RUN_TIMEOUT_S = 1800.0


class HarborError(RuntimeError):
    """A Harbor trial gave no reward: the error is Harbor's, or the server's."""


class SandboxBridge:
    """HTTP front of this process's episode sandboxes, for the Harbor server's environment."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, Any] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._openers: dict[str, Callable[[], AsyncContextManager[Any]]] = {}   # by episode token
        self._opened: dict[str, tuple[str, AsyncContextManager[Any]]] = {}   # token -> (episode's, cm)

    async def start(self) -> None:
        from miles.engines.procs import free_port
        app = web.Application(client_max_size=256 << 20)
        app.add_routes([web.post("/{token}/{op}", self.handle)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def register(self, sandbox: Any, open_verifier: Callable[[], AsyncContextManager[Any]] | None = None
                 ) -> str:
        """The bridge URL of an episode's sandbox; `open_verifier` makes its separate verifier's."""
        token = secrets.token_urlsafe(16)
        self.sandboxes[token] = sandbox
        if open_verifier is not None:
            self._openers[token] = open_verifier
        return f"{self.url}/{token}"

    async def unregister(self, url: str) -> None:
        """Drop an episode's sandbox, and close the verifier sandboxes it opened that are still open."""
        token = url.rsplit("/", 1)[-1]
        self.sandboxes.pop(token, None)
        self._openers.pop(token, None)
        for child in [t for t, (owner, _) in self._opened.items() if owner == token]:
            await self._close(child)

    async def _close(self, token: str) -> None:
        self.sandboxes.pop(token, None)
        _, cm = self._opened.pop(token)
        await run_to_end(cm.__aexit__(None, None, None))

    async def _open_verifier(self, token: str) -> web.Response:
        opener = self._openers.get(token)
        if opener is None:
            return web.json_response({"error": "Harbor asked for a separate verifier sandbox, but this episode "
                                      "has none to give: our reading of the task shares the agent's, or the "
                                      "episode's sandbox has no pool to open another from"}, status=409)
        cm = opener()
        fresh = await cm.__aenter__()
        child = secrets.token_urlsafe(16)
        self.sandboxes[child], self._opened[child] = fresh, (token, cm)
        if token not in self.sandboxes:   # the episode ended meanwhile: nobody would close it
            await self._close(child)
            return web.json_response({"error": "the episode ended"}, status=410)
        return web.json_response({"url": f"{self.url}/{child}"})

    async def handle(self, request: web.Request) -> web.Response:
        sandbox = self.sandboxes.get(request.match_info["token"])
        if sandbox is None:
            return web.json_response({"error": "no such episode sandbox (the episode ended)"}, status=410)
        token, op, body = request.match_info["token"], request.match_info["op"], await request.json()
        try:
            if op == "open_verifier":
                return await self._open_verifier(token)
            if op == "close":
                if token in self._opened:
                    await self._close(token)
                return web.json_response({})
            if op == "exec":
                r = await sandbox.exec(body["command"], cwd=body.get("cwd"), env=body.get("env") or None,
                                       timeout_s=body.get("timeout_s"), user=body.get("user"))
                return web.json_response({"exit_code": -1 if r.timed_out else r.exit_code,
                                          "stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out})
            if op == "upload":
                await sandbox.upload(body["path"], base64.b64decode(body["data"]), int(body.get("mode", 0o644)))
            elif op == "upload_dir":
                await sandbox.upload_dir(body["path"], {k: base64.b64decode(v) for k, v in body["files"].items()})
            elif op == "download_dir":
                return web.json_response({"files": await _download_dir(sandbox, body["path"])})
            elif op == "download":
                try:
                    data = await sandbox.download(body["path"])
                except FileNotFoundError:
                    return web.json_response({"error": f"{body['path']}: no such file"}, status=404)
                return web.json_response({"data": base64.b64encode(data).decode()})
            else:
                return web.json_response({"error": f"unknown operation {op!r}"}, status=404)
        except Exception as e:   # the sandbox's error goes back to Harbor, which fails the trial
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return web.json_response({})


async def _download_dir(sandbox: Any, path: str) -> dict[str, str]:
    """Every file under `path` (none when it does not exist), base64, by relative path."""
    import shlex
    r = await sandbox.exec(f"cd {shlex.quote(path)} 2>/dev/null && find . -type f -print0", timeout_s=60)
    if r.exit_code != 0:
        return {}
    out = {}
    for rel in filter(None, r.stdout.split("\0")):
        rel = rel.removeprefix("./")
        out[rel] = base64.b64encode(await sandbox.download(f"{path.rstrip('/')}/{rel}")).decode()
    return out


class _Process:
    """What one process shares: the bridge, the Harbor server (ours or `MILES_HARBOR_URL`)."""

    def __init__(self) -> None:
        self.bridge: SandboxBridge | None = None
        self.server = None
        self.url = ""
        self._lock = asyncio.Lock()

    async def ready(self) -> tuple[SandboxBridge, str]:
        async with self._lock:
            if self.bridge is None:
                bridge = SandboxBridge()
                await bridge.start()
                self.bridge = bridge
            if not self.url:
                self.url = os.environ.get("MILES_HARBOR_URL", "").rstrip("/") or await self._start_server()
            return self.bridge, self.url

    async def _start_server(self) -> str:
        from miles.engines.procs import ServerProcess, free_port
        python = harbor_python()
        port = free_port()
        logs = Path(os.environ.get("MILES_HARBOR_LOG_DIR") or (ROOT / ".cache" / "envs" / "harbor-logs"))
        logs.mkdir(parents=True, exist_ok=True)
        trials = logs / f"trials-{os.getpid()}"
        self.server = ServerProcess("harbor-server", [python, str(SERVER_SCRIPT), "--port", str(port),
                                                      "--trials-dir", str(trials)],
                                    log_path=logs / f"harbor-server-{os.getpid()}.log").start()
        url = f"http://127.0.0.1:{port}"
        await self.server.wait_healthy(url, timeout_s=120.0)
        return url

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop_async(grace_s=5)
            self.server, self.url = None, ""
        if self.bridge is not None:
            await self.bridge.stop()
            self.bridge = None


_PROCESS = _Process()


def harbor_python() -> str:
    """The Harbor venv's python: `MILES_HARBOR_PYTHON`, else what the (idempotent) set-up script
    made. Its failure is an error naming the script and its output."""
    if os.environ.get("MILES_HARBOR_PYTHON"):
        return os.environ["MILES_HARBOR_PYTHON"]
    r = subprocess.run(["bash", str(SETUP_SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise HarborError(f"{SETUP_SCRIPT.relative_to(ROOT)} failed (exit {r.returncode}): "
                          f"{(r.stderr or r.stdout)[-2000:]}")
    return str(ROOT / lines[-1]) if not os.path.isabs(lines[-1]) else lines[-1]


async def close() -> None:
    """Stop this process's Harbor server and bridge (tests, benchmarks; at exit it happens anyway)."""
    await _PROCESS.close()


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one Harbor trial of `task["harbor_task"]` in `task["sandbox"]`."""
    path = task.get("harbor_task")
    if not isinstance(path, str) or not path:
        raise HarborError(f"metadata.harbor_task: expected the path of a Harbor task directory, got {path!r}")
    bridge, server_url = await _PROCESS.ready()
    limits = task.get("limits") or {}
    sampling = dict(task.get("sampling") or {})
    request = {"task_path": path, "base_url": base_url, "api_key": task.get("api_key") or "none",
               "model": "policy", "sampling": sampling, "max_turns": int(limits.get("max_turns") or 2),
               "agent": task.get("harbor_agent") or {}}
    if limits.get("episode_timeout_s"):
        request["agent_timeout_s"] = float(limits["episode_timeout_s"])
    sandbox = task["sandbox"]
    await sandbox.exec("true", timeout_s=120)   # created now: the bridge needs a live one
    ours = load_task(path)
    open_verifier = None
    if ours.verifier_environment is not None and hasattr(sandbox, "open_another"):
        def open_verifier():
            return sandbox.open_another(verifier_spec(ours, sandbox.spec))
    request["bridge_url"] = bridge.register(sandbox, open_verifier)
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)) as http:
            async with http.post(f"{server_url}/run", json=request) as r:
                body = await r.json(content_type=None)
                if r.status != 200 or not isinstance(body, dict):
                    raise HarborError(f"harbor server {server_url}/run: HTTP {r.status}: {str(body)[:500]}")
    finally:
        await bridge.unregister(request["bridge_url"])
    wall = time.monotonic() - t0
    if body.get("status") != "ok":
        raise HarborError(f"harbor trial of {path}: {body.get('error') or 'no reward'}")
    rewards = {str(k): float(v) for k, v in (body.get("rewards") or {}).items()}
    timings = {k: float(v) for k, v in (body.get("timings") or {}).items()}
    return {"reward": rewards if len(rewards) > 1 else float(body["reward"]),
            "metrics": {"harbor_trial_s": wall, **{f"harbor_{k}": v for k, v in timings.items()}},
            "messages": body.get("messages") or [], "harbor_rewards": rewards}


def task_rows(task_dir: str | Path) -> list[dict[str, Any]]:
    """One data row per Harbor task under `task_dir` (each read and checked by our loader)."""
    rows = []
    for path in sorted(p for p in Path(task_dir).iterdir() if (p / "task.toml").is_file()):
        t = load_task(str(path))
        # the task's own sandbox: its image or environment/Dockerfile, network, limits, env, workdir
        meta: dict[str, Any] = {"harbor_task": t.path, "harbor_name": t.name, "sandbox": task_sandbox(t)}
        rows.append({"prompt": t.instruction, "label": "", "metadata": meta})
    if not rows:
        raise ValueError(f"{task_dir}: no Harbor task directories (with task.toml) found")
    return rows


def write_example_tasks(root: str | Path, n: int = 16, seed: int = 0) -> Path:
    """`n` small Harbor tasks: echo a word into answer.txt. Reward (reward.json): `reward` 1 for the
    word, `answered` 1 for any answer. Pure shell, no image to pull."""
    import random
    rng = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "ember", "quartz"]
    root = Path(root)
    for i in range(n):
        word = rng.choice(words)
        d = root / f"echo-{i:03d}"
        (d / "environment").mkdir(parents=True, exist_ok=True)
        (d / "tests").mkdir(exist_ok=True)
        (d / "task.toml").write_text(
            'schema_version = "1.1"\n\n[task]\nname = "miles/echo-%03d"\n\n[metadata]\ndifficulty = "easy"\n\n'
            '[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 300.0\n\n'
            '[environment]\nbuild_timeout_sec = 600.0\ncpus = 1\nmemory_mb = 512\nallow_internet = false\n' % i)
        (d / "instruction.md").write_text(f"Say the word {word}.\n")
        (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
        (d / "tests" / "test.sh").write_text(
            "#!/bin/bash\nmkdir -p /logs/verifier\n"
            "a=$(cat answer.txt /app/answer.txt 2>/dev/null | head -c 4000)\n"
            f'if printf %s "$a" | grep -qi {word}; then r=1; else r=0; fi\n'
            'if [ -n "$a" ]; then n=1; else n=0; fi\n'
            'echo "{\\"reward\\": $r, \\"answered\\": $n}" > /logs/verifier/reward.json\n')
    return root


def example_tasks(seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict[str, Any]]]:
    """`data.task` task set: the example tasks, written once under the cache, split train/test."""
    root = ROOT / ".cache" / "envs" / f"harbor-example-tasks-{seed}"
    rows = task_rows(write_example_tasks(root, seed=seed))
    n_test = max(1, int(len(rows) * test_frac))
    return {"test": rows[:n_test], "train": rows[n_test:]}
