"""Harbor-layout tasks on any sandbox backend: load a task directory, turn it into a SandboxSpec,
run its verifier, read its reward.

    my-task/
      task.toml          [agent] timeout_sec, [verifier] timeout_sec/env, [environment] ...
      instruction.md     the prompt
      environment/       Dockerfile (+ build context), or [environment].docker_image
      tests/test.sh      writes /logs/verifier/reward.txt (a float) or reward.json ({name: num})
      solution/solve.sh  optional reference solution

Field meanings follow harbor 0.26 (`harbor/models/task/config.py`, `harbor/verifier/verifier.py`);
Harbor itself needs Python >= 3.12, so we read the format ourselves.

Design decisions:
- Paths inside the sandbox are Harbor's: /tests, /logs/verifier, /solution, the task's workdir.
  Every backend shows them at those absolute paths (container layer, bwrap root, subprocess chroot).
- Tests are uploaded only when the verifier runs, after the agent is done, into a /tests that is
  first wiped, and stale reward files are deleted first: an agent can neither read the tests nor
  forge a reward.
- A verifier timeout is `status="timeout"`, an unreadable or missing reward `status="error"`,
  both with `reward=None`: infrastructure failures must not enter training as reward 0. Only
  `status="ok"` carries a reward.
- reward.json wins over reward.txt, as in Harbor; non-finite or non-numeric values are errors.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
import tomllib
from typing import Any, Literal

import msgspec

from miles.sandboxes.base import Sandbox, SandboxError, SandboxSpec, SandboxSpecError

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
REWARD_TXT = f"{VERIFIER_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_DIR}/reward.json"


class HarborTask(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str
    instruction: str
    agent_timeout_s: float | None = None
    verifier_timeout_s: float = 600.0
    build_timeout_s: float = 600.0
    docker_image: str | None = None
    dockerfile: str | None = None
    workdir: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network: bool = True
    env: dict[str, str] = {}
    verifier_env: dict[str, str] = {}
    metadata: dict[str, Any] = {}

    @property
    def tests_dir(self) -> str:
        return os.path.join(self.path, "tests")

    def test_files(self) -> dict[str, bytes]:
        out = {}
        for dirpath, _, filenames in os.walk(self.tests_dir):
            for name in filenames:
                full = os.path.join(dirpath, name)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, self.tests_dir)] = f.read()
        return out


def _get(table: dict, key: str, kind: type | tuple, where: str, default: Any = None) -> Any:
    value = table.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise SandboxSpecError(f"{where}.{key}={value!r} is invalid: expected "
                               f"{getattr(kind, '__name__', kind)}")
    return value


def load_task(path: str) -> HarborTask:
    """Read a Harbor task directory. Errors name the file and the key."""
    path = os.path.abspath(path)
    toml_path = os.path.join(path, "task.toml")
    if not os.path.isfile(toml_path):
        raise SandboxSpecError(f"harbor task {path}: task.toml is missing")
    try:
        with open(toml_path, "rb") as f:
            config = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise SandboxSpecError(f"{toml_path}: {exc}") from None
    instruction_path = os.path.join(path, "instruction.md")
    if not os.path.isfile(instruction_path):
        raise SandboxSpecError(f"harbor task {path}: instruction.md is missing")
    if not os.path.isfile(os.path.join(path, "tests", "test.sh")):
        raise SandboxSpecError(f"harbor task {path}: tests/test.sh is missing")
    with open(instruction_path) as f:
        instruction = f.read()
    agent = config.get("agent", {})
    verifier = config.get("verifier", {})
    env_cfg = config.get("environment", {})
    where = toml_path
    docker_image = _get(env_cfg, "docker_image", str, f"{where} [environment]")
    dockerfile = os.path.join(path, "environment", "Dockerfile")
    if not os.path.isfile(dockerfile):
        dockerfile = None
        if docker_image is None:
            raise SandboxSpecError(f"harbor task {path}: neither environment/Dockerfile nor "
                                   "[environment].docker_image")
    mode = _get(env_cfg, "network_mode", str, f"{where} [environment]")
    allow = _get(env_cfg, "allow_internet", bool, f"{where} [environment]")
    if mode is not None and mode not in ("no-network", "public", "allowlist"):
        raise SandboxSpecError(f"{where} [environment].network_mode={mode!r} is invalid: "
                               "expected 'no-network', 'public' or 'allowlist'")
    # No backend here enforces host allow lists, so 'allowlist' stays closed rather than open.
    network = (mode == "public") if mode is not None else (allow if allow is not None else True)
    memory_mb = _get(env_cfg, "memory_mb", int, f"{where} [environment]")
    if memory_mb is None and isinstance(env_cfg.get("memory"), str):
        memory_mb = _size_mb(env_cfg["memory"], f"{where} [environment].memory")
    storage_mb = _get(env_cfg, "storage_mb", int, f"{where} [environment]")
    if storage_mb is None and isinstance(env_cfg.get("storage"), str):
        storage_mb = _size_mb(env_cfg["storage"], f"{where} [environment].storage")
    name = (config.get("task") or {}).get("name") or os.path.basename(path)
    return HarborTask(
        name=name, path=path, instruction=instruction,
        agent_timeout_s=_get(agent, "timeout_sec", (int, float), f"{where} [agent]"),
        verifier_timeout_s=float(_get(verifier, "timeout_sec", (int, float),
                                      f"{where} [verifier]", 600.0)),
        build_timeout_s=float(_get(env_cfg, "build_timeout_sec", (int, float),
                                   f"{where} [environment]", 600.0)),
        docker_image=docker_image, dockerfile=dockerfile,
        workdir=_get(env_cfg, "workdir", str, f"{where} [environment]"),
        cpus=_get(env_cfg, "cpus", (int, float), f"{where} [environment]"),
        memory_mb=memory_mb, storage_mb=storage_mb, network=network,
        env=dict(_get(env_cfg, "env", dict, f"{where} [environment]", {})),
        verifier_env=dict(_get(verifier, "env", dict, f"{where} [verifier]", {})),
        metadata=dict(config.get("metadata", {})))


def _size_mb(text: str, where: str) -> int:
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    text = text.strip().upper()
    if not text or text[-1] not in units:
        raise SandboxSpecError(f"{where}={text!r} is invalid: expected e.g. '4G' or '512M'")
    return int(float(text[:-1]) * units[text[-1]])


def task_sandbox(task: HarborTask, *, prefer_image: bool = True) -> dict[str, Any]:
    """The SandboxSpec fields `task` itself sets (for a row's `metadata["sandbox"]`): its image or
    environment/Dockerfile, network, lifetime budget, workdir, env and the resources it asks for.
    Container backends use `docker_image` when the task names one (and `prefer_image`), else every
    backend builds environment/Dockerfile (the host ones replay it into a cached rootfs)."""
    use_image = task.docker_image is not None and (prefer_image or task.dockerfile is None)
    fields: dict[str, Any] = dict(
        network=task.network,
        ttl_s=(task.agent_timeout_s or 3600.0) + task.verifier_timeout_s + 300.0,
        env=dict(task.env))
    fields["image" if use_image else "dockerfile"] = task.docker_image if use_image else task.dockerfile
    for name, value in (("workdir", task.workdir), ("cpu", task.cpus), ("memory_mb", task.memory_mb),
                        ("disk_mb", task.storage_mb)):
        if value is not None:
            fields[name] = float(value) if name == "cpu" else value
    return fields


def task_spec(task: HarborTask, *, prefer_image: bool = True, network: bool | None = None,
              labels: dict[str, str] | None = None, ttl_s: float | None = None) -> SandboxSpec:
    """The SandboxSpec for one episode of `task` (`task_sandbox`, with these overrides)."""
    fields = task_sandbox(task, prefer_image=prefer_image)
    if network is not None:
        fields["network"] = network
    if ttl_s:
        fields["ttl_s"] = ttl_s
    return SandboxSpec(**fields, labels={"miles.task": _label(task.name), **(labels or {})})


def _label(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:256]


class VerifierResult(msgspec.Struct, frozen=True):
    status: Literal["ok", "timeout", "error"]
    reward: float | None
    rewards: dict[str, float] = {}
    exit_code: int | None = None
    output: str = ""
    duration_s: float = 0.0
    detail: str = ""


def parse_rewards(text: str, source: str) -> dict[str, float]:
    """Harbor's rules: reward.json is a dict of finite numbers (or one number), reward.txt one
    finite float. Raises ValueError naming the file and the bad value."""
    if not text.strip():
        raise ValueError(f"{source} is empty")
    if source.endswith(".json"):
        value = json.loads(text)
        items = value.items() if isinstance(value, dict) else [("reward", value)]
    else:
        items = [("reward", float(text.strip()))]
    out = {}
    for key, v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{source}: reward {key!r} = {v!r} is not a finite number")
        out[str(key)] = float(v)
    return out


async def run_verifier(sandbox: Sandbox, task: HarborTask,
                       timeout_s: float | None = None) -> VerifierResult:
    """Upload tests/, run tests/test.sh, read /logs/verifier/reward.{json,txt}."""
    if not sandbox.absolute_paths:
        raise SandboxError(f"{sandbox.backend_name} sandbox {sandbox.id} maps paths under its "
                           "root instead of presenting them (subprocess backend without root): "
                           "Harbor's /tests and /logs need root, or the bwrap backend")
    timeout_s = timeout_s or task.verifier_timeout_s
    started = time.monotonic()
    prep = await sandbox.exec(
        f"rm -rf {TESTS_DIR} && rm -f {REWARD_TXT} {REWARD_JSON} && mkdir -p {VERIFIER_DIR}",
        cwd="/", timeout_s=60)
    if not prep.ok:
        return VerifierResult("error", None, exit_code=prep.exit_code, output=prep.stderr,
                              detail="could not reset /tests and /logs/verifier")
    await sandbox.upload_dir(TESTS_DIR, task.test_files())
    script = f"{TESTS_DIR}/test.sh"
    stdout_file = f"{VERIFIER_DIR}/test-stdout.txt"
    cmd = (f"chmod +x {script}; {shlex.quote(script)} > {stdout_file} 2>&1; rc=$?; "
           f"cat {stdout_file}; exit $rc")
    r = await sandbox.exec(cmd, env=task.verifier_env, timeout_s=timeout_s)
    duration = time.monotonic() - started
    if r.timed_out:
        return VerifierResult("timeout", None, exit_code=r.exit_code, output=r.stdout,
                              duration_s=duration,
                              detail=f"verifier exceeded timeout_s={timeout_s}")
    for path in (REWARD_JSON, REWARD_TXT):
        try:
            text = (await sandbox.download(path)).decode("utf-8", errors="replace")
        except FileNotFoundError:
            continue
        try:
            rewards = parse_rewards(text, path)
        except ValueError as exc:
            return VerifierResult("error", None, exit_code=r.exit_code, output=r.stdout,
                                  duration_s=duration, detail=str(exc))
        return VerifierResult("ok", rewards.get("reward", next(iter(rewards.values()))),
                              rewards=rewards, exit_code=r.exit_code, output=r.stdout,
                              duration_s=duration)
    return VerifierResult("error", None, exit_code=r.exit_code, output=r.stdout,
                          duration_s=duration,
                          detail=f"no reward file at {REWARD_TXT} or {REWARD_JSON} "
                                 f"(test.sh exited {r.exit_code})")
