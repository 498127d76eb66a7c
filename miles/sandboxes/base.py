"""The sandbox contract: one spec, one result type, two small abstract classes.

Every backend (subprocess, bwrap, docker, daytona, e2b/agentenv, modal) implements exactly this,
so a recipe switches backends by one key and an environment never knows which one it got.

Design decisions:
- `SandboxSpec` is data (a frozen msgspec Struct), validated once in `__post_init__`; every error
  names the field and the bad value. Backends never re-validate, they only map fields.
- Paths handed to `exec(cwd=)`, `upload`, `download` are *sandbox* paths: absolute, as the command
  inside sees them. A relative path is taken relative to the sandbox's workdir. How a backend makes
  `/logs` or `/tests` exist is its own business (a chroot, a bind mount, a container layer).
- The per-command timeout is enforced inside the sandbox (a `timeout` wrapper running next to the
  command), so a lost controller never leaves a command running past its deadline; the controller
  adds only a short grace on top as a backstop. `ExecResult.timed_out` reports it; the exit code
  is kept as the sandbox saw it (124 or 137).
- Every sandbox has a wall-clock TTL enforced by the backend or the provider (reaper process,
  container main process, provider-side timeout): a sandbox nobody destroys still dies.
- `exec(user=)` runs a command as another user of the sandbox (a name or a numeric uid, as
  `docker exec --user`; Harbor's `[agent] user` / `[verifier] user`). None is the sandbox's default
  user, and the only value every backend takes: one that cannot switch to `user` raises
  SandboxError naming the user and the backend (the `_exec_as` default), never runs it as someone
  else.
- `destroy()` is idempotent and shielded from cancellation in `__aexit__`: an episode that is
  cancelled mid-flight must not leak its sandbox.
- Labels are the ownership record: `Backend.sweep(labels)` destroys everything carrying them, which
  is how a restarted run removes what a crashed one left behind.
"""

from __future__ import annotations

import abc
import asyncio
import math
import posixpath
import re
import time
from typing import Any, ClassVar, Mapping, Sequence

import msgspec

_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"[^\s\x00]+")
DEFAULT_WORKDIR = "/workspace"


class SandboxError(Exception):
    """Base of every error raised by miles.sandboxes."""


class SandboxSpecError(SandboxError, ValueError):
    """A SandboxSpec (or an argument at the sandbox boundary) has a bad field."""


class SandboxCreateError(SandboxError):
    """Creating a sandbox failed. `retryable` tells the pool whether backing off may help
    (throttling, a busy daemon) or not (a bad image, a missing binary)."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class SandboxClosedError(SandboxError):
    """The sandbox was already destroyed (or expired) when it was used."""


class BackendUnavailableError(SandboxError):
    """The backend cannot run here: a missing binary, daemon, SDK or privilege."""


def check(ok: bool, field: str, value: Any, expected: str) -> None:
    """Raise SandboxSpecError naming the field, the value and what was expected."""
    if not ok:
        raise SandboxSpecError(f"{field}={value!r} is invalid: expected {expected}")


def sandbox_path(path: str, workdir: str, field: str = "path") -> str:
    """Normalise a path given at the boundary into an absolute sandbox path.

    Relative paths are relative to `workdir`; `..` may not climb above `/`.
    """
    check(isinstance(path, str) and path != "" and "\x00" not in path, field, path,
          "a non-empty path string")
    joined = path if path.startswith("/") else posixpath.join(workdir, path)
    parts: list[str] = []
    for part in joined.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            check(bool(parts), field, path, "a path that stays inside the sandbox root")
            parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a sandbox should be. Unset resources take the defaults below.

    image:      container image (docker, cloud backends).
    rootfs:     host directory used as the initial root tree (subprocess, bwrap): its files appear at
                the same absolute paths inside.
    dockerfile: path of a Dockerfile; its directory is the build context. Container backends build
                it, the host backends replay its WORKDIR/ENV/COPY/RUN steps once into a cached rootfs.
    workdir:    initial working directory; None means the image's (Dockerfile WORKDIR) or /workspace.
    ttl_s:      wall-clock lifetime; the sandbox is killed by its backend/provider after it.
    """

    image: str | None = None
    rootfs: str | None = None
    dockerfile: str | None = None
    cpu: float = 1.0
    memory_mb: int = 1024
    disk_mb: int = 4096
    max_processes: int = 256
    network: bool = False
    ttl_s: float = 3600.0
    labels: dict[str, str] = {}
    workdir: str | None = None
    env: dict[str, str] = {}

    def __post_init__(self) -> None:
        sources = [n for n in ("image", "rootfs", "dockerfile") if getattr(self, n) is not None]
        check(len(sources) <= 1, "SandboxSpec." + "/".join(sources), sources,
              "at most one of image, rootfs, dockerfile")
        for name in sources:
            value = getattr(self, name)
            check(isinstance(value, str) and value.strip() != "", f"SandboxSpec.{name}", value,
                  "a non-empty string")
        check(math.isfinite(self.cpu) and 0 < self.cpu <= 512, "SandboxSpec.cpu", self.cpu,
              "a number of cores in (0, 512]")
        check(16 <= self.memory_mb <= 4 << 20, "SandboxSpec.memory_mb", self.memory_mb,
              "an integer in [16, 4194304] (MiB)")
        check(1 <= self.disk_mb <= 64 << 20, "SandboxSpec.disk_mb", self.disk_mb,
              "an integer in [1, 67108864] (MiB)")
        check(4 <= self.max_processes <= 1 << 20, "SandboxSpec.max_processes",
              self.max_processes, "an integer in [4, 1048576]")
        check(math.isfinite(self.ttl_s) and 1 <= self.ttl_s <= 7 * 86400, "SandboxSpec.ttl_s",
              self.ttl_s, "seconds in [1, 604800]")
        if self.workdir is not None:
            check(self.workdir.startswith("/") and sandbox_path(self.workdir, "/") == self.workdir
                  and self.workdir != "/", "SandboxSpec.workdir", self.workdir,
                  "a normalised absolute path other than /")
        for key, value in self.labels.items():
            check(bool(_LABEL_KEY.match(key)), f"SandboxSpec.labels[{key!r}]", key,
                  "a key of lowercase letters, digits, '_', '.', '-' (at most 63 chars)")
            check(isinstance(value, str) and len(value) <= 256 and "\n" not in value
                  and "," not in value and "=" not in value,
                  f"SandboxSpec.labels[{key!r}]", value,
                  "a value of at most 256 chars without newline, ',' or '='")
        for key, value in self.env.items():
            check(bool(_ENV_KEY.match(key)), f"SandboxSpec.env[{key!r}]", key,
                  "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            check(isinstance(value, str) and "\x00" not in value, f"SandboxSpec.env[{key!r}]",
                  value, "a string without NUL bytes")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SandboxSpec":
        """Decode from plain data (a recipe table), with the field path in any error."""
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as exc:
            raise SandboxSpecError(f"SandboxSpec: {exc}") from None

    def replace(self, **changes: Any) -> "SandboxSpec":
        return msgspec.structs.replace(self, **changes)

    def with_labels(self, labels: Mapping[str, str]) -> "SandboxSpec":
        return self.replace(labels={**self.labels, **labels})


class ExecResult(msgspec.Struct, frozen=True):
    """The outcome of one command. `timed_out` means the in-sandbox timeout fired; output past the
    backend's cap is dropped and `truncated` is set."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def timed_out_from(exit_code: int, elapsed_s: float, timeout_s: float) -> bool:
    """GNU/busybox `timeout` exits 124 (TERM worked) or 137 (it had to KILL); an exit code alone
    could be the command's own, so the wall clock must agree."""
    return exit_code in (124, 137, -9) and elapsed_s >= timeout_s * 0.95


def timeout_argv(timeout_s: float, argv: Sequence[str], kill_after_s: float = 2.0) -> list[str]:
    """The in-sandbox timeout wrapper: TERM at the deadline, KILL `kill_after_s` later. Without
    --foreground, GNU timeout signals its whole process group, so children die too."""
    return ["timeout", "-k", f"{kill_after_s:g}", f"{timeout_s:.3f}", *argv]


def shell_argv(cmd: str | Sequence[str]) -> list[str]:
    if isinstance(cmd, str):
        check(cmd.strip() != "", "cmd", cmd, "a non-empty command")
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    check(bool(argv) and all(isinstance(a, str) for a in argv), "cmd", cmd,
          "a non-empty list of strings")
    return argv


class Sandbox(abc.ABC):
    """One live sandbox. Subclasses implement the `_exec/_upload/_download/_destroy` hooks; the
    public methods here check arguments and the lifecycle once for all backends."""

    backend_name: ClassVar[str] = "?"
    # False where commands see host paths instead of the sandbox's own root (the subprocess
    # backend without root); tasks that use absolute paths (Harbor's /tests, /logs) refuse it.
    absolute_paths: bool = True

    def __init__(self, sandbox_id: str, spec: SandboxSpec, *, workdir: str,
                 default_timeout_s: float = 600.0):
        self.id = sandbox_id
        self.spec = spec
        self.workdir = workdir
        self.default_timeout_s = default_timeout_s
        self.created_at = time.time()
        self._destroyed = False
        self._destroy_lock = asyncio.Lock()

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def deadline(self) -> float:
        return self.created_at + self.spec.ttl_s

    def _check_live(self) -> None:
        if self._destroyed:
            raise SandboxClosedError(f"{self.backend_name} sandbox {self.id} is destroyed")
        if time.time() >= self.deadline:
            raise SandboxClosedError(
                f"{self.backend_name} sandbox {self.id} passed its ttl_s={self.spec.ttl_s}")

    async def exec(self, cmd: str | Sequence[str], cwd: str | None = None,
                   env: Mapping[str, str] | None = None,
                   timeout_s: float | None = None, user: str | None = None) -> ExecResult:
        """Run `cmd` (a shell string, or an argv list) and wait for it, as `user` (None: the
        sandbox's default user). The timeout is clipped to what is left of the sandbox's TTL."""
        self._check_live()
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        check(isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0,
              "timeout_s", timeout_s, "a positive number of seconds")
        timeout_s = min(float(timeout_s), max(0.1, self.deadline - time.time()))
        cwd = sandbox_path(cwd, self.workdir, "cwd") if cwd is not None else self.workdir
        env = dict(env or {})
        for key, value in env.items():
            check(bool(_ENV_KEY.match(key)) and isinstance(value, str), f"env[{key!r}]", value,
                  "NAME=string pairs")
        if user is None:
            return await self._exec(shell_argv(cmd), cwd, env, timeout_s)
        check(isinstance(user, str) and bool(_USER.fullmatch(user)), "user", user,
              "a user name or numeric uid (a string without whitespace)")
        return await self._exec_as(user, shell_argv(cmd), cwd, env, timeout_s)

    async def upload(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write `data` to `path` inside the sandbox, creating parent directories."""
        self._check_live()
        check(isinstance(data, (bytes, bytearray, memoryview)), "data", type(data).__name__,
              "bytes")
        await self._upload(sandbox_path(path, self.workdir), bytes(data), mode)

    async def download(self, path: str) -> bytes:
        """Read one file from the sandbox. A missing file raises FileNotFoundError."""
        self._check_live()
        return await self._download(sandbox_path(path, self.workdir))

    async def upload_dir(self, path: str, files: Mapping[str, bytes]) -> None:
        """Upload several files under `path` (keys are relative names). Backends with a cheaper
        bulk path (one tar) override this."""
        base = sandbox_path(path, self.workdir)
        for rel, data in files.items():
            await self.upload(posixpath.join(base, rel), data)

    async def destroy(self) -> None:
        """Kill everything in the sandbox and free it. Safe to call twice."""
        async with self._destroy_lock:
            if self._destroyed:
                return
            try:
                await self._destroy()
            finally:
                self._destroyed = True

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Shielded: a cancelled episode still frees its sandbox.
        await asyncio.shield(self.destroy())

    @abc.abstractmethod
    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult: ...

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        """`_exec` as `user`. Backends that can switch users override this; the default refuses."""
        raise SandboxError(f"backend {self.backend_name} cannot run commands as user {user!r} "
                           f"(sandbox {self.id}): it has no way to switch users")

    @abc.abstractmethod
    async def _upload(self, path: str, data: bytes, mode: int) -> None: ...

    @abc.abstractmethod
    async def _download(self, path: str) -> bytes: ...

    @abc.abstractmethod
    async def _destroy(self) -> None: ...

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else "live"
        return f"<{type(self).__name__} {self.id} {state}>"


class Backend(abc.ABC):
    """Creates sandboxes of one kind. `name` is the registry key."""

    name: ClassVar[str] = "?"

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a fresh sandbox for `spec`. Raises SandboxCreateError."""

    @abc.abstractmethod
    async def sweep(self, labels: Mapping[str, str]) -> int:
        """Destroy every sandbox of this backend whose labels include all of `labels`, plus any
        whose TTL has passed. Returns how many were destroyed."""

    def is_retryable(self, exc: BaseException) -> bool:
        """Whether a create failure is worth another attempt after a back-off."""
        return isinstance(exc, SandboxCreateError) and exc.retryable

    async def close(self) -> None:
        """Release client resources (connections). Live sandboxes are not touched."""

    async def __aenter__(self) -> "Backend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def labels_match(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())
