"""Verifiers (v1) environments as `rollout.agent` plug-ins: Verifiers runs the episode, the policy
answers through the episode's TITO session, the rubric's rewards come back as a dict reward.

    [data]
    task = "miles.envs.verifiers_env:env.<taskset_id>.tasks"      # the env's own taskset, split
    [rollout]
    agent = "miles.envs.verifiers_env:env.<taskset_id>.served"    # Verifiers' env server
    # agent = "miles.envs.verifiers_env:env.<taskset_id>.agent"   # in-process (verifiers importable)
    [train]
    reward_key = "reward"                                          # the rubric's weighted sum

`env.<id>` is `VerifiersEnv({"taskset": {"id": <id>}, "agent": {"runtime": {"type": "subprocess"}}})`.
For any other configuration write a module of your own (the whole `[env]` config of Verifiers,
as a dict) and name its attributes in the recipe:

    from miles.envs.verifiers_env import VerifiersEnv
    mine = VerifiersEnv({"taskset": {"id": "my_taskset", "num_tasks": 50},
                         "agent": {"runtime": {"type": "docker"}}})
    # data.task = "my_module:mine.tasks", rollout.agent = "my_module:mine.served"

The environment package is found the way Verifiers finds it: installed into the env's Python, or
on `PYTHONPATH` (the env server inherits the run's environment).

Design decisions:
- The depth is `rollout.agent`: Verifiers owns the episode (harness, runtime, tools, rubric), and
  every model call it makes reaches our per-session OpenAI endpoint, whose base URL and token go
  into Verifiers' `ClientConfig` (an `eval` client: the request is relayed as the harness wrote
  it, with the episode's sampling). The trained tokens are the session server's, so they are exact
  whatever Verifiers does with the text.
- Two modes, one recipe field (`rollout.agent`): `.agent` loads the env in this process
  (`load_environment`, `env.slots`, `env.run_slot`, inside `env.serving()`); `.served` starts
  Verifiers' own env server (`verifiers.v1.serve.serve_env`, ZeroMQ ROUTER + msgpack) as a
  supervised process on first use, in the env's Python (`python=`, by default the venv that
  `scripts/envs/setup_verifiers.sh` makes: verifiers pins openai<3, Miles' test tools need 3),
  health-checked with a deadline. The prime-rl way: we own the taskset and ship each task's
  `task_data` with the request.
- Our side of the wire is our own small client (pyzmq DEALER + msgspec's msgpack), so Miles'
  Python needs no verifiers for the served mode. It speaks `health`, `run` and `cancel`: an
  episode that is cancelled (a stopped worker, `agent.episode_timeout_s`) sends `cancel` so the
  server stops the rollout. A run's traces stream back as deltas; we keep only what the reward
  needs (each trace's rewards, metrics, errors, and node/call counts checked against the reply).
- The reward is a dict: `reward` (the weighted sum, Verifiers' `Trace.reward`) and each rubric
  criterion's unweighted score under its own name; the rubric's metrics go into the episode's
  metrics. An episode Verifiers reports as not ok, one without a reward, or a failed request
  raises: the session's samples are marked `failed` with the error (`metadata["agent_error"]`),
  and the run goes on.
- The server is started from the main thread by `SupervisedProcess` (a parent-death signal, an
  atexit stop), so a worker that dies leaves no env server; `close()` stops it explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import msgspec

from miles.supervise import SupervisedProcess
from miles.tiny import default_cache_dir

API_KEY_VAR = "MILES_SESSION_API_KEY"    # Verifiers reads an endpoint's key from an env var
MODEL_NAME = "policy"                    # the session server serves one model, whatever its name
SETUP_SCRIPT = "scripts/envs/setup_verifiers.sh"

# The env server: Verifiers' own `serve_env`, one process (max_workers=1), nothing of ours imported.
_SERVE = ("import json, logging, sys\n"
          "logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(message)s')\n"
          "from verifiers.v1.serve import serve_env\n"
          "serve_env(max_workers=1, address=sys.argv[1], config_data=json.loads(sys.argv[2]),"
          " **json.loads(sys.argv[3]))\n")
# The taskset, loaded by Verifiers in the env's Python: one JSON line of dumped TaskData per task.
_DUMP = ("import json, sys\n"
         "from verifiers.v1.utils.loaders import load_taskset, resolve_env_config\n"
         "config = resolve_env_config(json.loads(sys.argv[1]))\n"
         "for task in load_taskset(config.taskset).load():\n"
         "    print(json.dumps({'data': task.data.model_dump(mode='json'), 'prompt': task.data.prompt_text}))\n")


class VerifiersError(RuntimeError):
    """The env server failed, refused a request, or the episode Verifiers ran is not usable."""


def default_python() -> str:
    """`MILES_VERIFIERS_PYTHON`, else this Python if it has verifiers, else the set-up script's venv."""
    import importlib.util
    if os.environ.get("MILES_VERIFIERS_PYTHON"):
        return os.environ["MILES_VERIFIERS_PYTHON"]
    if importlib.util.find_spec("verifiers") is not None:
        return sys.executable
    return str(_setup_venv() / "bin" / "python")


def _setup_venv() -> Path:
    """Where SETUP_SCRIPT makes the venv (scripts/envs/_py312.sh's envs_dir, shared by clones)."""
    if os.environ.get("MILES_VERIFIERS_VENV"):
        return Path(os.environ["MILES_VERIFIERS_VENV"])
    envs = os.environ.get("MILES_ENVS_DIR") or Path(default_cache_dir()) / "envs"
    return Path(envs) / "verifiers"


def episode_result(traces: list[dict], ok: bool, errors: list[dict]) -> dict[str, Any]:
    """An agent result from an episode's traces (dumped `Trace`s: rewards, metrics, ok, errors).

    One trace (the usual single-agent episode) gives its rubric; several are averaged criterion by
    criterion (every trace of an episode shares the session's samples)."""
    problems = [f"{e.get('type')}: {e.get('message')}" for e in errors]
    for t in traces:
        problems += [f"{e.get('type')}: {e.get('message')}" for e in t.get("errors") or []]
    if not ok or not traces:
        raise VerifiersError("the Verifiers episode failed: " + ("; ".join(problems) or
                                                               ("it produced no trace" if not traces else "not ok")))
    scores: dict[str, list[float]] = {}
    totals, metrics = [], {}
    for t in traces:
        rewards = t.get("rewards") or {}
        missing = [name for name, r in rewards.items() if r is None]
        if not rewards or missing:
            raise VerifiersError(f"trace {t.get('id')}: the rubric gave no score"
                                 f"{' for ' + ', '.join(missing) if missing else ''}"
                                 f"{': ' + '; '.join(problems) if problems else ''}")
        totals.append(sum(r["score"] * r.get("weight", 1.0) for r in rewards.values()))
        for name, r in rewards.items():
            scores.setdefault(name, []).append(float(r["score"]))
        for name, value in (t.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                metrics.setdefault(f"verifiers/{name}", []).append(float(value))
    reward = {"reward": sum(totals) / len(totals)}
    reward.update({name: sum(v) / len(v) for name, v in scores.items()})
    return {"reward": reward, "metrics": {k: sum(v) / len(v) for k, v in metrics.items()},
            "traces": len(traces)}


def _client_config(base_url: str) -> dict[str, Any]:
    return {"type": "eval", "base_url": f"{base_url}/v1", "api_key_var": API_KEY_VAR}


def _sampling(task: dict) -> dict[str, Any]:
    return {k: v for k, v in (task.get("sampling") or {}).items() if v is not None}


def _task_data(task: dict) -> dict[str, Any]:
    data = (task.get("verifiers") or {}).get("task")
    if not isinstance(data, dict):
        raise VerifiersError(f"task {task.get('id')!r}: metadata['verifiers']['task'] is {data!r}; expected the "
                             f"task's dumped TaskData, as `VerifiersEnv.tasks` writes it")
    return data


class VerifiersEnv:
    """One Verifiers environment configuration: its task set, and the two ways to run its episodes."""

    def __init__(self, env: dict[str, Any], *, python: str = "", max_concurrent: int | None = None,
                 health_timeout_s: float = 120.0, stop_grace_s: float = 10.0):
        taskset = (env or {}).get("taskset")
        if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str) or not taskset["id"]:
            raise ValueError(f"verifiers env: env['taskset']['id'] must name a taskset, got env = {env!r}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"verifiers env: max_concurrent must be at least 1, got {max_concurrent!r}")
        if health_timeout_s <= 0:
            raise ValueError(f"verifiers env: health_timeout_s must be positive, got {health_timeout_s!r}")
        self.env = json.loads(json.dumps(env))   # plain JSON data: it crosses to another Python
        self.python = python
        self.max_concurrent, self.health_timeout_s, self.stop_grace_s = max_concurrent, health_timeout_s, stop_grace_s
        self._local = None     # _LocalEnv, per event loop
        self._server = None    # _ServedEnv, per event loop
        self._rows: list[dict] | None = None
        self._locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # per event loop (tests run several)

    @property
    def taskset_id(self) -> str:
        return self.env["taskset"]["id"]

    # -- data.task ------------------------------------------------------------------------------
    def tasks(self, seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict]]:
        """`data.task`: the taskset as Verifiers loads it, shuffled with `seed`, `test_frac` held out.
        Each row's metadata carries the task (`verifiers.task`, its dumped TaskData)."""
        rows = [dict(row, metadata={"verifiers": dict(row["metadata"]["verifiers"])}) for row in self._load_rows()]
        random.Random(seed).shuffle(rows)
        n_test = min(len(rows) - 1, max(1, int(len(rows) * test_frac)))
        return {"train": rows[n_test:], "test": rows[:n_test]}

    def _load_rows(self) -> list[dict]:
        """The taskset's rows, loaded once (a Python start and a verifiers import each time)."""
        if self._rows is not None:
            return self._rows
        import subprocess
        python = self.python or default_python()
        try:
            out = subprocess.run([python, "-c", _DUMP, json.dumps(self.env)], capture_output=True, text=True,
                                 timeout=300)
        except FileNotFoundError:
            raise VerifiersError(f"verifiers env {self.taskset_id!r}: no Python at {python!r} (run {SETUP_SCRIPT}, "
                                 f"or set MILES_VERIFIERS_PYTHON)") from None
        if out.returncode != 0:
            raise VerifiersError(f"verifiers env {self.taskset_id!r}: loading the taskset in {python} failed "
                                 f"(exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows = []
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                item = json.loads(line)
                rows.append({"prompt": item["prompt"], "label": "",
                             "metadata": {"verifiers": {"taskset": self.taskset_id, "task": item["data"]}}})
        if len(rows) < 2:
            raise VerifiersError(f"verifiers env {self.taskset_id!r}: the taskset has {len(rows)} task(s); "
                                 f"a train and a held-out split need at least 2")
        self._rows = rows
        return rows

    # -- rollout.agent --------------------------------------------------------------------------
    async def agent(self, base_url: str, task: dict) -> dict:
        """In-process mode: the env is loaded into this Python (it needs verifiers importable)."""
        data = _task_data(task)
        local = await self._get("_local", self._open_local)
        t0 = time.monotonic()
        traces, ok, errors = await local.run(data, base_url, task.get("api_key", ""), _sampling(task))
        result = episode_result(traces, ok, errors)
        result["metrics"]["verifiers_s"] = time.monotonic() - t0
        return result

    async def served(self, base_url: str, task: dict) -> dict:
        """Served mode: the episode runs in Verifiers' env server (started on first use)."""
        data = _task_data(task)
        server = await self._get("_server", lambda: self._open_server(task.get("api_key", "")))
        t0 = time.monotonic()
        traces, ok, errors = await server.run(data, _client_config(base_url), _sampling(task))
        result = episode_result(traces, ok, errors)
        result["metrics"]["verifiers_s"] = time.monotonic() - t0
        return result

    async def close(self) -> None:
        """Stop the env server and leave the in-process env's serving context (idempotent)."""
        server, self._server = self._server, None
        local, self._local = self._local, None
        if server is not None:
            await server.close()
        if local is not None:
            await local.close()

    async def _get(self, attr: str, opener):
        loop = asyncio.get_running_loop()
        held = getattr(self, attr)
        if held is not None and held.loop is loop and held.usable:
            return held
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            held = getattr(self, attr)
            if held is not None and held.loop is loop and not held.usable:
                print(f"[verifiers] env server {self.taskset_id!r} (pid {held.process.pid}) exited with code "
                      f"{held.process.returncode}: starting a new one", flush=True)
                await held.close()
                held = None
            if held is None or held.loop is not loop:
                if held is not None and held.process is not None:   # left by an event loop that ended
                    await held.process.stop_async(grace_s=self.stop_grace_s)
                held = await opener()
                setattr(self, attr, held)
            return held

    async def _open_local(self) -> "_LocalEnv":
        local = _LocalEnv(self.env, self.max_concurrent)
        await local.open()
        return local

    async def _open_server(self, api_key: str) -> "_ServedEnv":
        server = _ServedEnv(self, api_key)
        await server.start()
        return server


class _LocalEnv:
    usable = True
    process = None

    def __init__(self, env: dict, max_concurrent: int | None):
        self.env_config, self.loop = env, asyncio.get_running_loop()
        self.gate = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self.stack = contextlib.AsyncExitStack()

    async def open(self) -> None:
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config
        self.env = load_environment(resolve_env_config(self.env_config))
        await self.stack.enter_async_context(self.env.serving())

    async def run(self, task_data: dict, base_url: str, api_key: str, sampling: dict):
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.types import SamplingConfig
        os.environ[API_KEY_VAR] = api_key or "none"   # one token per job: the same for every episode
        task_cls = type(self.env.taskset).task_type()
        task = task_cls(task_cls.data_type().model_validate(task_data), self.env.config.taskset.task)
        ctx = ModelContext(model=MODEL_NAME, client=EvalClientConfig(**_client_config(base_url)),
                           sampling=SamplingConfig(**sampling))
        (slot,) = self.env.slots(task)
        episode = await self.env.run_slot(slot, ctx, self.gate)
        traces = [t.model_dump(mode="json", include={"id", "rewards", "metrics", "errors", "ok"})
                  for t in episode.traces]
        return traces, episode.ok, [e.model_dump(mode="json") for e in episode.errors]

    async def close(self) -> None:
        await self.stack.aclose()


class _ServedEnv:
    """Verifiers' env server as a supervised child, and our DEALER client of its wire protocol."""

    def __init__(self, owner: VerifiersEnv, api_key: str):
        self.owner, self.api_key = owner, api_key
        self.loop = asyncio.get_running_loop()
        self.process = None
        self.socket = None
        self.pending: dict[str, asyncio.Future] = {}
        self.deltas: dict[str, dict[str, dict]] = {}
        self.receiver: asyncio.Task | None = None
        self.watcher: asyncio.Task | None = None
        self.cancels: set[asyncio.Task] = set()

    @property
    def usable(self) -> bool:
        """False once the server process has exited: the next episode starts a new one (the one
        that was running when it died has failed, naming the exit)."""
        return self.process is not None and self.process.alive

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        from miles.engines.procs import free_port
        owner = self.owner
        python = owner.python or default_python()
        if not Path(python).exists() and os.sep in python:
            raise VerifiersError(f"verifiers env {owner.taskset_id!r}: no Python at {python!r} (run "
                                 f"{SETUP_SCRIPT}, or set MILES_VERIFIERS_PYTHON)")
        self.address = f"tcp://127.0.0.1:{free_port()}"
        kwargs = {"max_concurrent": owner.max_concurrent} if owner.max_concurrent else {}
        env = {**os.environ, API_KEY_VAR: self.api_key or "none"}
        name = f"verifiers-env-{owner.taskset_id}"
        self.temp_log = _log_path(name) is None
        self.process = SupervisedProcess(name, [python, "-c", _SERVE, self.address, json.dumps(owner.env),
                                                json.dumps(kwargs)], env=env, log_path=_log_path(name)).start()
        print(f"[verifiers] env server {owner.taskset_id!r} at {self.address}, pid {self.process.pid}, "
              f"log {self.process.log_path}", flush=True)
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            self.socket.setsockopt(opt, value)
        self.socket.connect(self.address)
        self.receiver = asyncio.ensure_future(self._receive())
        self.watcher = asyncio.ensure_future(self._watch())
        try:
            await self._wait_healthy(owner.health_timeout_s)
        except BaseException:
            await self.close()
            raise

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.process.alive:
                raise VerifiersError(f"verifiers env server exited (code {self.process.returncode}) before it "
                                     f"answered health at {self.address}; last lines of {self.process.log_path}:\n"
                                     f"{self.process.log_tail()}")
            try:
                await self.request("health", {}, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                return
            except asyncio.TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise VerifiersError(f"verifiers env server at {self.address} did not answer health within "
                                     f"{timeout_s} s (health_timeout_s); last lines of {self.process.log_path}:\n"
                                     f"{self.process.log_tail()}")
            await asyncio.sleep(0.2)

    async def _watch(self) -> None:
        """A server that exits fails its requests in flight at once, naming the exit and its log."""
        code = await self.process.wait()
        error = VerifiersError(f"verifiers env server (pid {self.process.pid}) exited with code {code}; last "
                               f"lines of {self.process.log_path}:\n{self.process.log_tail()}")
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(error)

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 3:
                continue   # not this protocol's frame: the request it belonged to times out or is cancelled
            rid, kind, data = frames[0].decode(), frames[1], frames[2]
            try:
                payload = msgspec.msgpack.decode(data)
            except msgspec.DecodeError as e:
                payload = {"success": False, "error": f"undecodable {kind!r} frame from the env server: {e}"}
                kind = b"reply"
            if kind == b"delta":
                if rid in self.deltas:
                    _apply_delta(self.deltas[rid], payload)
                continue
            future = self.pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(payload)

    async def request(self, method: str, payload: dict, *, timeout_s: float | None = None,
                      rid: str | None = None) -> dict:
        rid = rid or uuid.uuid4().hex
        future = self.loop.create_future()
        self.pending[rid] = future
        await self.socket.send_multipart([rid.encode(), method.encode(), msgspec.msgpack.encode(payload)])
        try:
            reply = await asyncio.wait_for(future, timeout_s)
        finally:
            self.pending.pop(rid, None)
        if not isinstance(reply, dict) or not reply.get("success", False):
            error = reply.get("error") if isinstance(reply, dict) else repr(reply)
            raise VerifiersError(f"verifiers env server {method}: {error or 'failed'}")
        return reply

    async def run(self, task_data: dict, client: dict, sampling: dict):
        if not self.process.alive:
            raise VerifiersError(f"verifiers env server (pid {self.process.pid}) is gone (exit code "
                                 f"{self.process.returncode}); last lines of {self.process.log_path}:\n"
                                 f"{self.process.log_tail()}")
        rid = uuid.uuid4().hex
        traces = self.deltas[rid] = {}
        try:
            reply = await self.request("run", {"task_data": task_data, "client": client, "model": MODEL_NAME,
                                               "sampling": sampling}, rid=rid)
        except asyncio.CancelledError:   # the episode was stopped: so is the server's rollout
            task = self.loop.create_task(self._cancel(rid))
            self.cancels.add(task)
            task.add_done_callback(self.cancels.discard)
            raise
        finally:
            self.deltas.pop(rid, None)
        head = reply.get("head") or {}
        out = []
        for summary in reply.get("traces") or []:
            trace = traces.get(summary["id"])
            if trace is None or (trace["_nodes"], trace["_calls"]) != (summary["nodes"], summary["calls"]):
                raise VerifiersError(f"served trace {summary['id']}: the deltas did not assemble to what the "
                                     f"server reports ({summary})")
            out.append(trace)
        return out, bool(head.get("ok")), list(head.get("errors") or [])

    async def _cancel(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            await self.request("cancel", {"request_id": rid}, timeout_s=5.0)

    async def close(self) -> None:
        if self.cancels:
            await asyncio.wait(list(self.cancels), timeout=5.0)
        for task in (self.receiver, self.watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.socket is not None:
            self.socket.close()
            self.context.term()
        if self.process is not None:
            code = await self.process.stop_async(grace_s=self.owner.stop_grace_s)
            print(f"[verifiers] env server {self.owner.taskset_id!r} (pid {self.process.pid}) stopped, exit code "
                  f"{code}", flush=True)
            if code == 0 and self.temp_log:   # a clean stop outside a run: its log is of no use
                self.process.log_path.unlink(missing_ok=True)


def _log_path(name: str) -> Path | None:
    """In a run: `<output_dir>/logs/<name>-<actor>.log` (an actor knows its run by MILES_RECIPE, the
    resolved recipe in the run directory). Elsewhere a temporary file (SupervisedProcess')."""
    recipe = os.environ.get("MILES_RECIPE")
    if not recipe:
        return None
    actor = os.environ.get("MILES_ACTOR_NAME", "main").replace("/", "_")
    return Path(recipe).parent / "logs" / f"{name}-{actor}.log"


def _apply_delta(traces: dict[str, dict], delta: dict) -> None:
    """The part of a trace delta (`verifiers.v1.serve.delta`) the reward needs: scalars (rewards,
    metrics, ok, ...), errors, and how many nodes and calls arrived (checked against the reply)."""
    tid = delta.get("trace")
    if delta.get("discard"):   # a retried attempt abandons its traces
        traces.pop(tid, None)
        return
    trace = traces.setdefault(tid, {"id": tid, "errors": [], "_nodes": 0, "_calls": 0})
    trace["_nodes"] += len(delta.get("nodes") or [])
    trace["_calls"] += len(delta.get("calls") or [])
    trace["errors"].extend(delta.get("errors") or [])
    trace.update(delta.get("set") or {})


class _ById:
    """`env.<taskset_id>`: a `VerifiersEnv` of that taskset with the local subprocess runtime."""

    def __init__(self) -> None:
        self._envs: dict[str, VerifiersEnv] = {}

    def __getattr__(self, taskset_id: str) -> VerifiersEnv:
        if taskset_id.startswith("__"):
            raise AttributeError(taskset_id)
        if taskset_id not in self._envs:
            self._envs[taskset_id] = VerifiersEnv({"taskset": {"id": taskset_id},
                                                   "agent": {"runtime": {"type": "subprocess"}}})
        return self._envs[taskset_id]


env = _ById()
