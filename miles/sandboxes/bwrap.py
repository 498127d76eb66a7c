"""The `bwrap` backend: each command runs under bubblewrap with every namespace unshared.

Per exec: `bwrap --unshare-all --unshare-user --die-with-parent --new-session --uid 0 --gid 0
--bind R / --ro-bind <sys>/usr /usr ... --proc /proc --dev /dev --chdir CWD -- timeout ... sh -c CMD`,
launched (as root) under the sandbox's own uid with the rlimits applied, so bubblewrap itself runs
unprivileged through a user namespace.

Design decisions:
- R is bound at `/`, then the system directories are bound read-only over it. So the sandbox sees
  one root like in a container: `/logs`, `/tests`, `/app` are R's own directories, a new top-level
  directory made by a command persists in R, and nothing outside R is writable.
- Namespaces: user (root inside maps to the sandbox uid outside, no real privilege), pid (the
  command is alone with its children; when the command's bwrap exits every process in the
  namespace dies, so nothing daemonises past an exec), network (loopback only, down), IPC, UTS,
  cgroup. `network=True` adds `--share-net`.
- bubblewrap is a fresh process per exec (about 5 ms); processes do not survive between execs,
  files do. That matches how agent harnesses drive a sandbox (one command per tool call).
- Without root, bubblewrap runs as the caller's uid with the same namespaces; only RLIMIT_NPROC
  is left out (it would count all of the user's processes) and kill-by-uid is not used: the pid
  namespace already ends every process with its exec.
- Users (`exec(user=)`): the user namespace maps one uid, 0 inside, so every command runs as root
  and `user` may only be "root" or "0"; any other raises SandboxError naming the user and the
  backend. Tasks with their own users need docker.
- Availability is checked by actually running bubblewrap once (`bwrap --ro-bind / / true` under
  the sandbox settings); a kernel without unprivileged user namespaces fails there with bwrap's own
  message instead of on the first episode.
"""

from __future__ import annotations

import os
import random
import subprocess

from miles.sandboxes.base import BackendUnavailableError, ExecResult, SandboxError, timeout_argv
from miles.sandboxes.host import HostBackend, HostSandbox, require_binary
from miles.sandboxes.hostfs import SYSTEM_DIRS
from miles.sandboxes.spawner import AsUid

class BwrapSandbox(HostSandbox):
    backend_name = "bwrap"
    isolation = "bwrap: user+pid+net+ipc+uts namespaces, read-only system, private root"

    def bwrap_argv(self, cwd: str) -> list[str]:
        argv = [self.backend.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent",
                "--new-session", "--uid", "0", "--gid", "0", "--hostname", "sandbox",
                "--bind", self.root, "/"]
        if self.spec.network:
            argv.append("--share-net")
        for name in SYSTEM_DIRS:
            src = os.path.join(self.sys_root, name)
            # Symlinks (/bin -> usr/bin) already sit in R (prepare_root); dirs get bound over.
            if os.path.isdir(src) and not os.path.islink(src):
                argv += ["--ro-bind", src, "/" + name]
        argv += ["--proc", "/proc", "--dev", "/dev", "--chdir", cwd]
        return argv

    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult:
        self.ensure_dir(cwd)
        uid = self.uid if self.backend.privileged else None
        full = self.bwrap_argv(cwd) + ["--"] + timeout_argv(timeout_s, argv,
                                                            self.backend.kill_after_s)
        result = await self.run_host(full, self.exec_env(env), timeout_s,
                                     AsUid(uid=uid, limits=self.limits(timeout_s)))
        if result.exit_code == 1 and result.stderr.startswith("bwrap:"):
            # bubblewrap's own failure (a bad mount), not the command's exit code.
            raise SandboxError(f"bwrap sandbox {self.id}: {result.stderr.strip()}")
        return result

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        if user not in ("root", "0"):
            raise SandboxError(f"backend bwrap cannot run commands as user {user!r} (sandbox "
                               f"{self.id}): its user namespace has only root (uid 0); use the "
                               f"docker backend for tasks with their own users")
        return await self._exec(argv, cwd, env, timeout_s)


class BwrapBackend(HostBackend):
    """Options: as HostBackend (base_dir, uid_range, default_timeout_s, max_output_bytes,
    kill_after_s, build_timeout_s)."""

    name = "bwrap"
    sandbox_cls = BwrapSandbox

    def __init__(self, **opts):
        super().__init__(**opts)
        self.bwrap = require_binary("bwrap", self.name, "apt-get install -y bubblewrap")
        require_binary("timeout", self.name, "coreutils")
        self._probe()

    def _probe(self) -> None:
        kwargs = {}
        if self.privileged:
            uid = random.randrange(*self.uid_range)
            kwargs = dict(user=uid, group=uid, extra_groups=[])
        try:
            proc = subprocess.run(
                [self.bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
                 "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
                capture_output=True, text=True, timeout=20, **kwargs)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendUnavailableError(f"backend bwrap: probe run failed: {exc!r}") from exc
        if proc.returncode != 0:
            raise BackendUnavailableError(
                f"backend bwrap cannot run here (bwrap --unshare-all ... true exited "
                f"{proc.returncode}): {proc.stderr.strip()}")
