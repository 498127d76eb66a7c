"""What the cloud backends (daytona, e2b/agentenv, modal) share: lazy SDK import, the in-sandbox
timeout wrapper as a shell string, result mapping, and the labels every cloud sandbox carries.

Design decisions:
- SDKs are optional (`pip install 'miles[cloud]'`) and imported on first use, with an error
  naming the package and the extra. Each backend also accepts `sdk=` (a module or an object with
  the same attributes) so tests can hand it a patched SDK.
- Every command is wrapped in `timeout -k 2 T /bin/sh -c CMD` inside the sandbox, even where the
  SDK has its own timeout: E2B's is a client connection timeout that leaves the process running,
  and uniform wrapping makes `timed_out` mean the same thing on every backend. The SDK timeout is
  set a few seconds later, as the backstop.
- Users (`exec(user=)`): the command runs under `su USER -s /bin/sh -c CMD` (a numeric uid is
  looked up with getent first), as Harbor's own Daytona and Modal environments do; it needs the
  sandbox's default user to be root. E2B has a user per command and overrides this.
- Labels: `miles.sandbox=1` plus the spec's labels go into the provider's labels/metadata/tags,
  and the provider's own TTL is set from `ttl_s` (E2B timeout, Daytona ttl_minutes, Modal timeout),
  so a lost sandbox dies at the provider even if sweep never runs.
"""

from __future__ import annotations

import importlib
import math
import shlex
import time
from typing import Any

from miles.sandboxes.base import (BackendUnavailableError, ExecResult, Sandbox, SandboxSpec,
                                  timed_out_from, timeout_argv)

SANDBOX_LABEL = "miles.sandbox"
BACKSTOP_GRACE_S = 10.0


def require_sdk(module: str, backend: str, sdk: Any = None) -> Any:
    if sdk is not None:
        return sdk
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {backend} needs the `{module}` package: pip install 'miles[cloud]' "
            f"({exc})") from exc


def remote_command(argv: list[str], timeout_s: float, kill_after_s: float) -> str:
    return shlex.join(timeout_argv(timeout_s, argv, kill_after_s))


def su_argv(user: str, argv: list[str]) -> list[str]:
    """`argv` as `user` through su, which takes names only: a uid is resolved inside."""
    if not user.isdigit():
        return ["su", user, "-s", "/bin/sh", "-c", shlex.join(argv)]
    return ["/bin/sh", "-c", 'exec su "$(getent passwd "$1" | cut -d: -f1)" -s /bin/sh -c "$2"',
            "sh", user, shlex.join(argv)]


def sdk_timeout_s(timeout_s: float, kill_after_s: float) -> int:
    return int(math.ceil(timeout_s + kill_after_s + BACKSTOP_GRACE_S))


def provider_labels(labels: dict[str, str]) -> dict[str, str]:
    return {SANDBOX_LABEL: "1", **labels}


def result(exit_code: int | None, stdout: str | bytes | None, stderr: str | bytes | None,
           started: float, timeout_s: float, max_output_bytes: int,
           timed_out: bool = False) -> ExecResult:
    def text(value: str | bytes | None) -> tuple[str, bool]:
        if value is None:
            return "", False
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", errors="replace")
        return value[:max_output_bytes], len(value) > max_output_bytes

    out, t1 = text(stdout)
    err, t2 = text(stderr)
    elapsed = time.monotonic() - started
    code = 137 if exit_code is None else int(exit_code)
    return ExecResult(code, out, err,
                      timed_out=timed_out or timed_out_from(code, elapsed, timeout_s),
                      duration_s=elapsed, truncated=t1 or t2)


class CloudSandbox(Sandbox):
    """A provider's sandbox object (`handle`) behind our contract; subclasses map `_exec` & co."""

    def __init__(self, backend: Any, handle: Any, spec: SandboxSpec, workdir: str, sandbox_id: str):
        super().__init__(sandbox_id, spec, workdir=workdir, default_timeout_s=backend.default_timeout_s)
        self.backend = backend
        self.handle = handle

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        return await self._exec(su_argv(user, argv), cwd, env, timeout_s)
