"""User-style plug-ins for the agentic fault test (`tests/chaos/test_agentic_faults.py`).

- `faulty_agent`: a `rollout.agent` that, per episode at random (seeded by prompt, sample and
  attempt, so a rerun injects the same faults), raises after its first turn, sleeps past
  `agent.episode_timeout_s`, runs a command the sandbox backend fails, or finishes normally after
  two turns with a sandbox command between them.
- `FaultySubprocessBackend`: the subprocess backend, except that an exec whose command carries
  `FAULT_MARK` fails the way a broken sandbox does (a `SandboxError` out of `exec`). Importing this
  module registers it as `faulty_subprocess`; the agent's module is imported (recipe check, then
  the worker's episode set-up) before the backend is built, so `sandbox.backend =
  "faulty_subprocess"` finds it.
- `LeakCheckingDriver`: the loop's driver; when the loop is done (the rollout is stopped, the job
  not yet ended: the session server and the rollout worker still run) it counts, with deadlines,
  the sessions left open in the session server (`GET /sessions` with the job's token) and the
  sandboxes the backend still holds (records with the run label; TTL reaper processes of
  sandboxes under the run's own `base_dir`), and writes them to `<output_dir>/leak_check.json`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import traceback
from pathlib import Path

import aiohttp
import psutil

from miles.loop import LoopDriver
from miles.sandboxes.base import SandboxError
from miles.sandboxes.local import SubprocessBackend, SubprocessSandbox
from miles.sandboxes.registry import register_backend
from miles.wire.messages import GetEngines

FAULT_MARK = "#inject-exec-failure"
FAULTS = ("raise", "timeout", "exec_failure", "normal")
WEIGHTS = (0.12, 0.12, 0.12, 0.64)


class FaultySandbox(SubprocessSandbox):
    async def _exec(self, argv, cwd, env, timeout_s):
        if any(FAULT_MARK in a for a in argv):
            raise SandboxError(f"sandbox {self.id}: injected exec failure")
        return await super()._exec(argv, cwd, env, timeout_s)


class FaultySubprocessBackend(SubprocessBackend):
    name = "subprocess"          # the same records and reapers: the subprocess backend's sweep finds them
    sandbox_cls = FaultySandbox

    async def destroy_record(self, record, reaper=None):
        try:
            return await super().destroy_record(record, reaper)
        except BaseException:   # the pool logs one line; a leak needs the whole story
            print(f"[faulty_subprocess] destroy_record({record.id}) failed:\n{traceback.format_exc()}",
                  flush=True)
            raise


register_backend("faulty_subprocess", FaultySubprocessBackend)


def episode_fault(task: dict) -> str:
    key = f"{task['prompt_index']}/{task['retries']}/{task['id'].rsplit('-', 1)[-1]}"
    return random.Random(key).choices(FAULTS, WEIGHTS)[0]


async def faulty_agent(base_url: str, task: dict) -> dict:
    fault = episode_fault(task)
    sandbox = task["sandbox"]
    messages = [{"role": "user", "content": task["prompt"]}]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {task['api_key']}"}) as http:
        async def ask() -> str:
            body = {"model": "policy", "messages": messages, "max_tokens": 4, "temperature": 1.0}
            async with http.post(f"{base_url}/v1/chat/completions", json=body) as r:
                reply = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"chat completion failed: HTTP {r.status}: {reply}")
            content = reply["choices"][0]["message"].get("content") or ""
            messages.append({"role": "assistant", "content": content})
            return content

        await ask()
        if fault == "raise":
            raise RuntimeError("injected agent failure after turn 1")
        if fault == "timeout":
            await sandbox.exec("true")
            await asyncio.sleep(3600)
        tool = await sandbox.exec("cat secret.txt" + (f" {FAULT_MARK}" if fault == "exec_failure" else ""))
        messages.append({"role": "user", "content": f"tool: {tool.stdout.strip()}"})
        final = await ask()
    return {"reward": float(bool(task.get("label")) and task["label"] in final),
            "metrics": {"tool_calls": 1.0}, "fault": fault}


async def _count_until_zero(count, deadline_s: float) -> dict:
    """Poll `count()` until it is 0 or the deadline passes: first and last counts, the wait."""
    t0 = time.monotonic()
    first = last = await count()
    while last and time.monotonic() - t0 < deadline_s:
        await asyncio.sleep(0.5)
        last = await count()
    return {"first": first, "last": last, "waited_s": round(time.monotonic() - t0, 2)}


class LeakCheckingDriver(LoopDriver):
    async def run(self) -> int:
        code = await super().run()
        if code == 0:
            report = await self.check_leaks()
            (Path(self.recipe.output_dir) / "leak_check.json").write_text(json.dumps(report))
            print(f"[driver] leak check: {json.dumps(report)}", flush=True)
        return code

    async def check_leaks(self) -> dict:
        engines = await self.engines.call(GetEngines(), timeout_s=60)
        token = Path(engines.session_token_file).read_text().strip()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async def open_sessions() -> int:
                async with http.get(f"{engines.session_url}/sessions") as r:
                    r.raise_for_status()
                    return len((await r.json())["sessions"])
            sessions = await _count_until_zero(open_sessions, 60.0)
            async with http.get(f"{engines.session_url}/sessions") as r:
                left = (await r.json())["sessions"]
            sessions["open"] = []
            for sid in left:   # what a leftover is: whose, how far it got
                async with http.get(f"{engines.session_url}/sessions/{sid}") as r:
                    info = await r.json()
                sessions["open"].append({k: info.get(k) for k in ("id", "rollout_id", "metadata", "turns",
                                                                  "created_s")})
        backend = SubprocessBackend(**self.recipe.sandbox.options)

        async def live_sandboxes() -> int:
            return len(run_records(backend, self.recipe.run.name)) + len(reapers(backend.base_dir))
        sandboxes = await _count_until_zero(live_sandboxes, 30.0)
        sandboxes["records"] = [r.id for r in run_records(backend, self.recipe.run.name)]
        sandboxes["reapers"] = [describe(pid) for pid in reapers(backend.base_dir)]
        await backend.close()
        return {"sessions": sessions, "sandboxes": sandboxes}


def run_records(backend, run_name: str) -> list:
    """The backend's records of live sandboxes labelled with the run."""
    return [r for r in backend.records() if r.labels.get("miles.run") == run_name]


def describe(pid: int) -> dict:
    """What a leftover reaper says about its sandbox: id, age, parent."""
    try:
        p = psutil.Process(pid)
        sid = next((a.removeprefix("miles-reaper-") for a in p.cmdline() if a.startswith("miles-reaper-")), "")
        return {"pid": pid, "sandbox": sid, "age_s": round(time.time() - p.create_time(), 1),
                "ppid": p.ppid(), "parent": " ".join(p.parent().cmdline()[:4]) if p.parent() else "",
                "status": p.status()}
    except psutil.Error as e:
        return {"pid": pid, "error": repr(e)}


def reapers(base_dir: str) -> list[int]:
    """Pids of TTL reapers of sandboxes under `base_dir` (each is an `sh` whose script removes
    its sandbox's root there): a live one is a sandbox not destroyed."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(a.startswith("miles-reaper-") for a in cmd) and any(base_dir + "/" in a for a in cmd) \
                and p.pid != os.getpid():
            out.append(p.pid)
    return out


