"""Harbor-layout tasks on any sandbox backend: load a task directory, turn it into a SandboxSpec,
run its verifier, read its reward.

    my-task/
      task.toml          [agent] timeout_sec/user, [verifier] timeout_sec/env/user/environment_mode,
                         [verifier.environment], [environment] ..., artifacts
      instruction.md     the prompt
      environment/       Dockerfile (+ build context), or [environment].docker_image
      tests/test.sh      writes /logs/verifier/reward.txt (a float) or reward.json ({name: num})
      tests/Dockerfile   optional: a separate verifier's own image, with the tests in it
      solution/solve.sh  optional reference solution

Field meanings follow harbor 0.26 (`harbor/models/task/config.py`, `harbor/verifier/verifier.py`,
`harbor/models/task/verifier_mode.py`, `harbor/trial/trial.py`; 0.25, which setup_harbor.sh pins,
has the same fields); Harbor itself needs Python >= 3.12, so we read the format ourselves.

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
- Users: `[agent] user` and `[verifier] user` (a name or a uid) are `agent_user` and
  `verifier_user`. tests/test.sh runs as the verifier's user; the set-up around it (wiping,
  `chmod +x`) as the sandbox's default user, as Harbor runs it as root. The agent's user is for
  whoever runs the agent's commands (`exec(user=task.agent_user)`). A backend that cannot switch
  users refuses the exec with an error naming the user; it never runs it as someone else.
- A separate verifier (`[verifier] environment_mode = "separate"`, or a `[verifier.environment]`
  table) runs in a fresh sandbox, as Harbor's does in a fresh environment: `run_verifier` copies
  what Harbor copies from the agent's sandbox (/logs/artifacts and each `artifacts` source, nothing
  else: not the workdir), runs the tests there and closes it, whatever happens. Its image follows
  Harbor's precedence ([verifier.environment].docker_image, else tests/Dockerfile, whose image
  owns /tests, else the task's own); its network is its own AND the agent sandbox's, never more.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shlex
import time
import tomllib
from typing import Any, AsyncContextManager, Callable, Literal

import msgspec

from miles.sandboxes.base import Sandbox, SandboxError, SandboxSpec, SandboxSpecError, sandbox_path

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"
REWARD_TXT = f"{VERIFIER_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_DIR}/reward.json"

OpenSandbox = Callable[[SandboxSpec], AsyncContextManager[Sandbox]]


class Artifact(msgspec.Struct, frozen=True):
    """One `artifacts` entry: a file or directory of the agent's sandbox that a separate verifier
    gets at the same path, less what `exclude` (tar --exclude patterns) names."""
    source: str
    exclude: list[str] = []


class TaskEnvironment(msgspec.Struct, frozen=True, kw_only=True):
    """What an [environment] table asks of a sandbox: the image (or Dockerfile), workdir,
    resources, network and env."""
    docker_image: str | None = None
    dockerfile: str | None = None
    workdir: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network: bool = True
    env: dict[str, str] = {}


class VerifierEnvironment(TaskEnvironment, frozen=True, kw_only=True):
    """Where a separate verifier runs, resolved as Harbor does: [verifier.environment] (else a
    copy of [environment]) for resources, network, workdir and env; the image from
    [verifier.environment].docker_image, else tests/Dockerfile, else the task's own.
    `bundled_tests`: the image owns /tests, so nothing is uploaded there."""
    bundled_tests: bool = False


class HarborTask(TaskEnvironment, frozen=True, kw_only=True):
    """A task directory as read: its own environment's fields, and the rest of task.toml."""
    name: str
    path: str
    instruction: str
    agent_timeout_s: float | None = None
    verifier_timeout_s: float = 600.0
    build_timeout_s: float = 600.0
    verifier_env: dict[str, str] = {}
    metadata: dict[str, Any] = {}
    agent_user: str | None = None
    verifier_user: str | None = None
    verifier_environment: VerifierEnvironment | None = None   # None: it shares the agent's
    artifacts: list[Artifact] = []

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


def _user(table: dict, where: str) -> str | None:
    """Harbor's `user` (a name or a uid: str | int) as the string `exec(user=)` takes."""
    value = table.get("user")
    if value is None:
        return None
    ok = (isinstance(value, str) and re.fullmatch(r"[^\s\x00]+", value) is not None) or \
        (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    if not ok:
        raise SandboxSpecError(f"{where}.user={value!r} is invalid: expected a user name or a "
                               "uid (a non-empty string without spaces, or an integer >= 0)")
    return str(value)


def _environment(table: dict, where: str) -> dict[str, Any]:
    """The fields of an [environment] (or [verifier.environment]) table that a SandboxSpec uses."""
    mode = _get(table, "network_mode", str, where)
    allow = _get(table, "allow_internet", bool, where)
    if mode is not None and mode not in ("no-network", "public", "allowlist"):
        raise SandboxSpecError(f"{where}.network_mode={mode!r} is invalid: "
                               "expected 'no-network', 'public' or 'allowlist'")
    memory_mb = _get(table, "memory_mb", int, where)
    if memory_mb is None and isinstance(table.get("memory"), str):
        memory_mb = _size_mb(table["memory"], f"{where}.memory")
    storage_mb = _get(table, "storage_mb", int, where)
    if storage_mb is None and isinstance(table.get("storage"), str):
        storage_mb = _size_mb(table["storage"], f"{where}.storage")
    return dict(
        docker_image=_get(table, "docker_image", str, where),
        workdir=_get(table, "workdir", str, where),
        cpus=_get(table, "cpus", (int, float), where),
        memory_mb=memory_mb, storage_mb=storage_mb,
        # No backend here enforces host allow lists, so 'allowlist' stays closed rather than open.
        network=(mode == "public") if mode is not None else (allow if allow is not None else True),
        env=dict(_get(table, "env", dict, where, {})))


def _verifier_environment(path: str, verifier: dict, env_cfg: dict, own: dict[str, Any],
                          where: str) -> VerifierEnvironment | None:
    """Harbor's resolution of where the verifier runs (harbor/models/task/verifier_mode.py)."""
    mode = _get(verifier, "environment_mode", str, f"{where} [verifier]")
    if mode not in (None, "shared", "separate"):
        raise SandboxSpecError(f"{where} [verifier].environment_mode={mode!r} is invalid: "
                               "expected 'shared' or 'separate'")
    table = _get(verifier, "environment", dict, f"{where} [verifier]")
    if mode == "shared" and table is not None:
        raise SandboxSpecError(f"{where} [verifier].environment_mode='shared' is incompatible "
                               "with [verifier.environment]: omit the table or set "
                               "environment_mode='separate'")
    if mode != "separate" and table is None:
        return None
    fields = _environment(table if table is not None else env_cfg,
                          f"{where} [verifier.environment]" if table is not None
                          else f"{where} [environment]")
    image, dockerfile, bundled = fields.pop("docker_image"), None, True
    tests = os.path.join(path, "tests")
    if table is None or image is None:
        if os.path.isfile(os.path.join(tests, "docker-compose.yaml")):
            raise SandboxSpecError(f"harbor task {path}: tests/docker-compose.yaml (a compose "
                                   "verifier environment) is not supported: give "
                                   "tests/Dockerfile or [verifier.environment].docker_image")
        if os.path.isfile(os.path.join(tests, "Dockerfile")):
            image, dockerfile = None, os.path.join(tests, "Dockerfile")
        else:   # the task's own image, a fresh copy of it
            image, dockerfile, bundled = own["docker_image"], own["dockerfile"], False
    return VerifierEnvironment(docker_image=image, dockerfile=dockerfile, bundled_tests=bundled,
                               **fields)


def _artifacts(config: dict, where: str) -> list[Artifact]:
    raw = config.get("artifacts", [])
    if not isinstance(raw, list):
        raise SandboxSpecError(f"{where} artifacts={raw!r} is invalid: expected a list of paths "
                               "or {source, exclude} tables")
    out = []
    for i, entry in enumerate(raw):
        at = f"{where} artifacts[{i}]"
        entry = {"source": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise SandboxSpecError(f"{at}={entry!r} is invalid: expected a path or a table")
        source = _get(entry, "source", str, at)
        if not source or ".." in source.split("/"):
            raise SandboxSpecError(f"{at}.source={source!r} is invalid: expected a path without "
                                   "'..'")
        service = _get(entry, "service", str, at)
        if service not in (None, "main"):
            raise SandboxSpecError(f"{at}.service={service!r} is invalid: a Miles sandbox has "
                                   "one service, 'main'")
        exclude = _get(entry, "exclude", list, at, [])
        if not all(isinstance(p, str) for p in exclude):
            raise SandboxSpecError(f"{at}.exclude={exclude!r} is invalid: expected a list of "
                                   "patterns")
        out.append(Artifact(source, list(exclude)))
    return out


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
    with open(instruction_path) as f:
        instruction = f.read()
    agent = config.get("agent", {})
    verifier = config.get("verifier", {})
    env_cfg = config.get("environment", {})
    where = toml_path
    own = _environment(env_cfg, f"{where} [environment]")
    own["dockerfile"] = os.path.join(path, "environment", "Dockerfile")
    if not os.path.isfile(own["dockerfile"]):
        own["dockerfile"] = None
        if own["docker_image"] is None:
            raise SandboxSpecError(f"harbor task {path}: neither environment/Dockerfile nor "
                                   "[environment].docker_image")
    separate = _verifier_environment(path, verifier, env_cfg, own, where)
    # a verifier image that owns /tests needs none here (Harbor skips the upload then)
    if not (separate and separate.bundled_tests) and \
            not os.path.isfile(os.path.join(path, "tests", "test.sh")):
        raise SandboxSpecError(f"harbor task {path}: tests/test.sh is missing")
    name = (config.get("task") or {}).get("name") or os.path.basename(path)
    return HarborTask(
        name=name, path=path, instruction=instruction,
        agent_timeout_s=_get(agent, "timeout_sec", (int, float), f"{where} [agent]"),
        verifier_timeout_s=float(_get(verifier, "timeout_sec", (int, float),
                                      f"{where} [verifier]", 600.0)),
        build_timeout_s=float(_get(env_cfg, "build_timeout_sec", (int, float),
                                   f"{where} [environment]", 600.0)),
        **own,
        verifier_env=dict(_get(verifier, "env", dict, f"{where} [verifier]", {})),
        metadata=dict(config.get("metadata", {})),
        agent_user=_user(agent, f"{where} [agent]"),
        verifier_user=_user(verifier, f"{where} [verifier]"),
        verifier_environment=separate, artifacts=_artifacts(config, where))


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


def verifier_spec(task: HarborTask, agent_spec: SandboxSpec) -> SandboxSpec:
    """The fresh sandbox of `task`'s separate verifier: the agent sandbox's spec (the recipe's
    defaults, the run's labels) with the verifier environment's image or Dockerfile, resources,
    workdir and env over it. An image is preferred where the agent's sandbox used one. Its network
    needs both its own table and the agent's sandbox to allow it: never more than the agent had."""
    v = task.verifier_environment
    if v is None:
        raise SandboxSpecError(f"harbor task {task.name}: its verifier shares the agent's sandbox")
    use_image = v.docker_image is not None and (agent_spec.dockerfile is None
                                                 or v.dockerfile is None)
    fields: dict[str, Any] = dict(image=None, rootfs=None, dockerfile=None, workdir=v.workdir,
                                  env=dict(v.env), network=agent_spec.network and v.network,
                                  ttl_s=task.verifier_timeout_s + 300.0)
    fields["image" if use_image else "dockerfile"] = v.docker_image if use_image else v.dockerfile
    for name, value in (("cpu", v.cpus), ("memory_mb", v.memory_mb), ("disk_mb", v.storage_mb)):
        if value is not None:
            fields[name] = float(value) if name == "cpu" else value
    return agent_spec.replace(**fields)


def _excluded(rel: str, patterns: list[str]) -> bool:
    """tar --exclude, unanchored (Harbor excludes with tar): a pattern that matches any run of
    the path's components drops it (a matched directory drops what is under it)."""
    parts = rel.split("/")
    runs = ("/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
    return any(fnmatch.fnmatchcase(run, p.strip("/")) for run in runs for p in patterns)


async def collect_artifacts(sandbox: Sandbox,
                            task: HarborTask) -> tuple[dict[str, bytes], list[str]]:
    """What Harbor carries from the agent's environment to a separate verifier's: the files of
    /logs/artifacts and of each `artifacts` source (a file or a directory, less its `exclude`),
    by absolute path, and the directories among the sources. A missing source is skipped, as
    Harbor's collection is best-effort. Symlinks are not followed."""
    entries = list(task.artifacts)
    if not any(sandbox_path(a.source, sandbox.workdir) == ARTIFACTS_DIR for a in entries):
        entries.insert(0, Artifact(ARTIFACTS_DIR))
    files: dict[str, bytes] = {}
    dirs: list[str] = []
    for artifact in entries:
        source = sandbox_path(artifact.source, sandbox.workdir, "artifacts.source")
        q = shlex.quote(source)
        r = await sandbox.exec(f"if [ -f {q} ]; then printf 'file\\0'; elif [ -d {q} ]; then "
                               f"printf 'dir\\0'; cd {q} && find . -type f -print0; fi",
                               cwd="/", timeout_s=60)
        kind, *rels = r.stdout.split("\0") if r.ok else [""]
        if kind == "file":
            files[source] = await sandbox.download(source)
        elif kind == "dir":
            dirs.append(source)
            for rel in filter(None, (x.removeprefix("./") for x in rels)):
                if not _excluded(rel, artifact.exclude):
                    files[f"{source.rstrip('/')}/{rel}"] = await sandbox.download(
                        f"{source.rstrip('/')}/{rel}")
    return files, dirs


async def run_verifier(sandbox: Sandbox, task: HarborTask, timeout_s: float | None = None, *,
                       open_sandbox: OpenSandbox | None = None) -> VerifierResult:
    """Harbor's verifier of `task`, once the agent is done in `sandbox`: in `sandbox` itself, or,
    where the task gives its verifier a separate environment, in a fresh sandbox
    `open_sandbox(verifier_spec(task, sandbox.spec))` that gets the agent's artifacts first and is
    closed afterwards, whatever happens. From a pool whose slot `sandbox` holds, that is
    `lambda spec: pool.sandbox(spec, own_slot=False)` (an episode's `LazySandbox.open_another`)."""
    _require_absolute_paths(sandbox)
    if task.verifier_environment is None:
        return await _verify(sandbox, task, timeout_s or task.verifier_timeout_s)
    if open_sandbox is None:
        raise SandboxError(f"harbor task {task.name}: its verifier runs in a separate environment "
                           "([verifier] environment_mode / [verifier.environment]), so "
                           "run_verifier needs open_sandbox= (e.g. LazySandbox.open_another)")
    files, dirs = await collect_artifacts(sandbox, task)
    async with open_sandbox(verifier_spec(task, sandbox.spec)) as fresh:
        _require_absolute_paths(fresh)
        if dirs:   # as Harbor leaves them: there, and writable by the verifier's user
            q = " ".join(shlex.quote(d) for d in dirs)
            r = await fresh.exec(f"mkdir -p {q} && chmod 777 {q}", cwd="/", timeout_s=60)
            if not r.ok:
                return VerifierResult("error", None, exit_code=r.exit_code, output=r.stderr,
                                      detail="could not create the artifact directories")
        if files:
            await fresh.upload_dir("/", {path.lstrip("/"): data for path, data in files.items()})
        return await _verify(fresh, task, timeout_s or task.verifier_timeout_s,
                             upload_tests=not task.verifier_environment.bundled_tests)


def _require_absolute_paths(sandbox: Sandbox) -> None:
    if not sandbox.absolute_paths:
        raise SandboxError(f"{sandbox.backend_name} sandbox {sandbox.id} maps paths under its "
                           "root instead of presenting them (subprocess backend without root): "
                           "Harbor's /tests and /logs need root, or the bwrap backend")


async def _verify(sandbox: Sandbox, task: HarborTask, timeout_s: float, *,
                  upload_tests: bool = True) -> VerifierResult:
    """Reset /logs/verifier (and /tests), upload tests/, run tests/test.sh as the verifier's
    user, read /logs/verifier/reward.{json,txt}."""
    started = time.monotonic()
    # 0777 as Harbor makes it (as root): the verifier's user may not be the default user. Best
    # effort, as is chmod +x below: where the default user cannot, test.sh's own failure says so.
    reset = (f"rm -f {REWARD_TXT} {REWARD_JSON} && mkdir -p {VERIFIER_DIR} && "
             f"{{ chmod 777 {VERIFIER_DIR} 2>/dev/null || true; }}")
    prep = await sandbox.exec(f"rm -rf {TESTS_DIR} && {reset}" if upload_tests else reset,
                              cwd="/", timeout_s=60)
    if not prep.ok:
        return VerifierResult("error", None, exit_code=prep.exit_code, output=prep.stderr,
                              detail="could not reset /tests and /logs/verifier")
    if upload_tests:
        await sandbox.upload_dir(TESTS_DIR, task.test_files())
    script = f"{TESTS_DIR}/test.sh"
    await sandbox.exec(f"chmod +x {script}", cwd="/", timeout_s=60)
    stdout_file = f"{VERIFIER_DIR}/test-stdout.txt"
    cmd = f"{shlex.quote(script)} > {stdout_file} 2>&1; rc=$?; cat {stdout_file}; exit $rc"
    r = await sandbox.exec(cmd, env=task.verifier_env, timeout_s=timeout_s,
                           user=task.verifier_user)
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
