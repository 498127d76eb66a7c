"""Harbor trial server: runs one Harbor `Trial` per `POST /run`, in Harbor's own Python 3.12 venv.

    python -m miles.envs.servers.harbor_server --port 8123 --trials-dir DIR      (the harbor venv)

    GET  /health -> {"ok": true, "harbor": "<version>", "running": n}
    POST /run    {"task_path", "base_url", "api_key", "model", "bridge_url",
                  "agent": {"name" | "import_path", "kwargs"}, "sampling", "max_turns",
                  "agent_timeout_s", "verifier_timeout_s"}
              -> {"reward", "rewards", "status", "error", "messages", "timings"}

Run by `miles.envs.harbor_env` (the adapter) as a supervised process. Imports only the stdlib,
Harbor and what Harbor installs (aiohttp, pydantic): never Miles, never torch.

Design decisions:
- Harbor's own machinery runs each episode: `Trial.create(TrialConfig(...))` then `trial.run()`:
  its task loading and validation, agent setup/run, its verifier (uploads tests/, runs
  tests/test.sh, downloads /logs/verifier, parses reward.txt / reward.json). The reward is
  Harbor's `verifier_result.rewards`.
- The environment is `BridgeEnvironment` (Harbor's `BaseEnvironment`, by import path): every
  exec/upload/download goes over HTTP to the Miles adapter, which runs it in the episode's Miles
  sandbox. So Harbor tasks run in our sandboxes (any backend), and the sandbox's lifetime stays
  the episode runner's; the agent environment's start/stop create and destroy nothing.
- Each exec carries the user Harbor resolved for it (its explicit `user`, else the environment's
  default user, which Harbor sets to `[agent] user` around the agent and to `[verifier] user`
  around the verifier) to the sandbox's `exec(user=)`.
- A separate verifier (`[verifier] environment_mode = "separate"` / `[verifier.environment]`):
  Harbor makes a second environment for it, which asks the adapter for a fresh sandbox at start
  (`open_verifier`, a new bridge URL) and closes it at stop. Harbor names the agent's environment
  `<trial>__env` (harbor/trial/trial.py); any other of the trial's is a separate verifier's.
- The default agent is `ChatAgent` (Harbor's `BaseAgent`): chat completions against the
  episode's session endpoint (`base_url`, every token through the TITO session server), each
  fenced ```bash block of a reply run in the environment and its output sent back, the last
  reply written to `answer.txt` in the working directory. Any other Harbor agent can be named
  (`agent.name`, e.g. "terminus-2", or `agent.import_path`); it gets `base_url`/`model`.
- Harbor's trial directories (its logs, result.json) are removed after each trial unless
  `--keep-trials`: a long run would fill the disk, and the answer carries what Miles uses.
- A trial that raised or whose verifier gave no reward answers 200 with `status: "failed"` and
  Harbor's exception text: the adapter turns that into a failed sample, never a dead run.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import os

# LiteLLM (imported by Harbor) fetches a price list at import unless told to use its copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from harbor.agents.base import BaseAgent  # noqa: E402
from harbor.environments.base import BaseEnvironment, ExecResult  # noqa: E402
from harbor.environments.capabilities import EnvironmentCapabilities  # noqa: E402
from harbor.models.agent.context import AgentContext  # noqa: E402
from harbor.models.trial.paths import EnvironmentPaths  # noqa: E402
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig  # noqa: E402
from harbor.trial.trial import Trial  # noqa: E402

BASH_BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)
OUTPUT_CHARS = 2000        # of a command's output sent back to the model


class BridgeEnvironment(BaseEnvironment):
    """A Harbor environment whose commands run in a Miles sandbox, reached over the adapter's bridge."""

    def __init__(self, *args, bridge_url: str, **kwargs):
        self.bridge_url = bridge_url.rstrip("/")
        super().__init__(*args, **kwargs)
        self.separate_verifier = not self.session_id.endswith("__env")
        self._opened = False

    @staticmethod
    def type() -> str:
        return "miles-bridge"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # the Miles sandbox was made from the recipe's [sandbox] (network off by default)
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self):
        pass   # the sandbox exists already; Harbor's environment/ is the recipe's concern

    async def _call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=body.get("timeout_s") or 3600)) as http:
            async with http.post(f"{self.bridge_url}/{op}", json=body) as r:
                data = await r.json()
                if r.status == 404 and op == "download":
                    raise FileNotFoundError(body["path"])
                if r.status != 200:
                    raise RuntimeError(f"sandbox bridge {op} {body.get('path', '')}: {data.get('error', r.status)}")
                return data

    async def start(self, force_build: bool) -> None:
        if self.separate_verifier:
            self.bridge_url = (await self._call("open_verifier", {"timeout_s": 1800}))["url"]
            self._opened = True
        # what Harbor's container environments mount: its log directories
        paths = EnvironmentPaths.for_os(self.os)
        dirs = " ".join(shlex.quote(str(d)) for d in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir))
        r = await self._call("exec", {"command": f"mkdir -p {dirs}", "timeout_s": 120})
        if r["exit_code"] != 0:
            raise RuntimeError(f"sandbox bridge: could not create {dirs}: {r['stderr'][-500:]}")

    async def stop(self, delete: bool):
        if self._opened:   # only a separate verifier's sandbox is ours to close
            self._opened = False
            await self._call("close", {})

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        user = self._resolve_user(user)
        r = await self._call("exec", {"command": command, "cwd": cwd, "env": self._merge_env(env) or {},
                                      "timeout_s": timeout_sec, "user": None if user is None else str(user)})
        return ExecResult(stdout=r["stdout"], stderr=r["stderr"], return_code=r["exit_code"])

    async def upload_file(self, source_path: Path | str, target_path: str):
        data = Path(source_path).read_bytes()
        await self._call("upload", {"path": target_path, "data": base64.b64encode(data).decode()})

    async def upload_dir(self, source_dir: Path | str, target_dir: str):
        root = Path(source_dir)
        files = {str(p.relative_to(root)): base64.b64encode(p.read_bytes()).decode()
                 for p in root.rglob("*") if p.is_file()}
        await self._call("upload_dir", {"path": target_dir, "files": files})

    async def download_file(self, source_path: str, target_path: Path | str):
        r = await self._call("download", {"path": source_path})
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(base64.b64decode(r["data"]))

    async def download_dir(self, source_dir: str, target_dir: Path | str):
        r = await self._call("download_dir", {"path": source_dir})
        for rel, data in r["files"].items():
            out = Path(target_dir) / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(base64.b64decode(data))


class ChatAgent(BaseAgent):
    """Chat completions to `base_url`; ```bash blocks run in the environment; last reply -> answer.txt."""

    def __init__(self, *args, base_url: str, api_key: str = "none", sampling: dict | None = None,
                 max_turns: int = 2, turn_timeout_s: float = 120.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        self.sampling, self.max_turns, self.turn_timeout_s = dict(sampling or {}), max_turns, turn_timeout_s
        self.messages: list[dict[str, Any]] = []
        self.llm_s = 0.0

    @staticmethod
    def name() -> str:
        return "miles-chat"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        pass

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        self.messages = [{"role": "user", "content": instruction}]
        reply = ""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.turn_timeout_s)) as http:
            for turn in range(self.max_turns):
                t0 = time.monotonic()
                async with http.post(f"{self.base_url}/v1/chat/completions", headers=headers,
                                     json={"model": self.model_name or "policy", "messages": self.messages,
                                           **self.sampling}) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise RuntimeError(f"model call {turn}: HTTP {r.status}: {text[:500]}")
                    body = json.loads(text)
                self.llm_s += time.monotonic() - t0
                choice = body["choices"][0]
                reply = choice["message"].get("content") or ""
                self.messages.append({"role": "assistant", "content": reply})
                commands = BASH_BLOCK.findall(reply)
                if not commands or turn + 1 == self.max_turns or choice.get("finish_reason") == "length":
                    break
                outputs = []
                for cmd in commands:
                    res = await environment.exec(cmd, timeout_sec=60)
                    outputs.append(f"exit {res.return_code}\n{(res.stdout or '') + (res.stderr or '')}"[:OUTPUT_CHARS])
                self.messages.append({"role": "user", "content": "\n\n".join(outputs)})
        workdir = getattr(environment.task_env_config, "workdir", None)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "answer.txt").write_text(reply)
            target = f"{workdir}/answer.txt" if workdir else "answer.txt"
            await environment.upload_file(Path(tmp) / "answer.txt", target)
        context.metadata = {**(context.metadata or {}), "turns": len(self.messages) // 2, "llm_s": self.llm_s}


class HarborServer:
    def __init__(self, trials_dir: Path, keep_trials: bool = False):
        self.trials_dir, self.keep_trials = trials_dir, keep_trials
        self.running = 0

    async def health(self, _request: web.Request) -> web.Response:
        from importlib.metadata import version
        return web.json_response({"ok": True, "harbor": version("harbor"), "running": self.running})

    async def run(self, request: web.Request) -> web.Response:
        try:
            req = await request.json()
            for key in ("task_path", "base_url", "bridge_url"):
                if not isinstance(req.get(key), str) or not req[key]:
                    raise ValueError(f"{key}: expected a non-empty string, got {req.get(key)!r}")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        self.running += 1
        t0 = time.monotonic()
        try:
            return web.json_response(await self._trial(req, t0))
        finally:
            self.running -= 1

    async def _trial(self, req: dict[str, Any], t0: float) -> dict[str, Any]:
        agent = req.get("agent") or {}
        kwargs = dict(agent.get("kwargs") or {})
        if not agent.get("name") and not agent.get("import_path"):
            agent = {"import_path": f"{__name__}:ChatAgent"}
            kwargs.update(base_url=req["base_url"], api_key=req.get("api_key") or "none",
                          sampling=req.get("sampling") or {}, max_turns=int(req.get("max_turns") or 2))
        config = TrialConfig(
            task=TaskConfig(path=Path(req["task_path"])), trials_dir=self.trials_dir,
            agent=AgentConfig(name=agent.get("name"), import_path=agent.get("import_path"),
                              model_name=req.get("model") or "policy", base_url=req["base_url"],
                              override_timeout_sec=req.get("agent_timeout_s"), kwargs=kwargs),
            environment=EnvironmentConfig(import_path=f"{__name__}:BridgeEnvironment",
                                          kwargs={"bridge_url": req["bridge_url"]}))
        out: dict[str, Any] = {"reward": None, "rewards": {}, "status": "failed", "error": "", "messages": []}
        try:
            trial = await Trial.create(config)
            result = await trial.run()
        except Exception as e:   # Harbor refused the task or the trial broke: the episode fails, not the server
            out["error"] = f"{type(e).__name__}: {e}"
            return out
        out["messages"] = getattr(trial.agent, "messages", None) or []
        if not self.keep_trials:   # Harbor's record of the trial; what we need is in the answer
            shutil.rmtree(trial.paths.trial_dir, ignore_errors=True)
        vr = result.verifier_result
        rewards = dict(vr.rewards or {}) if vr is not None else {}
        if result.exception_info is not None:
            out["error"] = f"{result.exception_info.exception_type}: {result.exception_info.exception_message}"
        elif not rewards:
            out["error"] = "Harbor's verifier gave no reward"
        else:
            out.update(status="ok", rewards=rewards,
                       reward=rewards.get("reward", next(iter(rewards.values()))))
        out["timings"] = {"trial_s": time.monotonic() - t0}
        for name in ("environment_setup", "agent_setup", "agent_execution", "verifier"):
            t = getattr(result, name)
            if t is not None and t.started_at and t.finished_at:
                out["timings"][f"{name}_s"] = (t.finished_at - t.started_at).total_seconds()
        return out

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([web.get("/health", self.health), web.post("/run", self.run)])
        return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--trials-dir", default="")
    p.add_argument("--keep-trials", action="store_true", help="keep Harbor's trial directories")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    trials = Path(args.trials_dir or tempfile.mkdtemp(prefix="harbor-trials-"))
    trials.mkdir(parents=True, exist_ok=True)
    web.run_app(HarborServer(trials, args.keep_trials).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
