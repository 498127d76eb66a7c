"""The `subprocess` backend: each command is a host process jailed with plain kernel features.

Per exec, in the child the spawner forks (spawner.py), between fork and exec, as root:
1. PR_SET_PDEATHSIG: the command's leader dies with the controller;
2. new mount, IPC, UTS and (unless `network=True`) network namespaces; a fresh network namespace has
   only a downed loopback, so even 127.0.0.1 is unreachable;
3. mount propagation made private, then the system directories (/usr, /etc, ... from the host or
   from a full-root template) bind-mounted read-only and nosuid into R, a minimal /dev, a private
   /dev/shm tmpfs and /proc;
4. chroot(R), chdir(cwd), rlimits (address space = memory_mb, CPU seconds, file size = disk_mb,
   processes = max_processes, no core files), no_new_privs, and the sandbox's own uid;
5. exec `timeout -k 2 T /bin/sh -c CMD` in a new session: the deadline is enforced inside, and it
   kills the command's whole process group.

So `/logs`, `/tests` and the workdir are plain directories of R, at their absolute paths, and the
Harbor layout works unchanged. Another episode's R is both outside this chroot and 0700 under
another uid. The host's pid namespace is shared: a command can list host processes (their command
lines), not signal or inspect them (another uid). The Docker socket, /run and /var are not in R.

Without root (HPC login nodes) the same backend degrades, and says so in `isolation`: no chroot
(paths map to R/<path> and commands get $SANDBOX_ROOT, cwd, HOME and TMPDIR inside R), the network
namespace comes from an unprivileged user namespace, and RLIMIT_NPROC is not applied (it would
count all of the user's processes). Use bwrap for real isolation without root.

Users (`exec(user=)`, Harbor's `[agent] user` / `[verifier] user`): every command of a sandbox runs
as its one identity, the sandbox uid standing in for root (HOME=/root, USER=root, owner of all of
R) as root, the caller's own uid without root. Another user would need a second uid that can reach
R and that kill-by-uid (destroy, sweep, the reaper) would miss, so there is none: `user` may only
name the current user (the controller's name or uid, "root"/"0" when it runs as root); any other
raises SandboxError naming the user and the backend. Tasks with their own users need docker.

Not covered: cgroups. The memory limit is RLIMIT_AS, so a hog fails its allocation (MemoryError,
ENOMEM) rather than being OOM-killed, and `cpu` only scales the CPU-seconds guard.
"""

from __future__ import annotations

import os
import pwd
import sys

from miles.sandboxes.base import BackendUnavailableError, ExecResult, SandboxError, timeout_argv
from miles.sandboxes.host import HostBackend, HostSandbox, require_binary
from miles.sandboxes.hostfs import RootTemplate
from miles.sandboxes.linux import DEV_NODES
from miles.sandboxes.spawner import AsUid, Jail


class SubprocessSandbox(HostSandbox):
    backend_name = "subprocess"

    @property
    def isolation(self) -> str:
        return "chroot+uid+netns" if self.backend.privileged else "directory+netns (no root)"

    @property
    def absolute_paths(self) -> bool:  # type: ignore[override]
        return self.backend.privileged

    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult:
        self.ensure_dir(cwd)
        wrapped = timeout_argv(timeout_s, argv, self.backend.kill_after_s)
        limits = self.limits(timeout_s)
        if self.backend.privileged:
            setup = Jail(root=self.root, sys_root=self.sys_root, cwd=cwd, uid=self.uid,
                         network=self.spec.network, limits=limits)
            return await self.run_host(wrapped, self.exec_env(env), timeout_s, setup)
        full_env = self.exec_env(env, home=self.host_path("/root"), tmp=self.host_path("/tmp"))
        full_env["SANDBOX_ROOT"] = self.root
        setup = AsUid(uid=None, limits=limits, cwd=self.host_path(cwd),
                      network=self.spec.network)
        return await self.run_host(wrapped, full_env, timeout_s, setup)

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        current = current_user()
        if user not in current:
            raise SandboxError(
                f"backend subprocess cannot run commands as user {user!r} (sandbox {self.id}): "
                f"its commands all run as the sandbox's one identity, so it only takes the "
                f"current user ({' or '.join(map(repr, current))}); use the docker backend for "
                f"tasks with their own users")
        return await self._exec(argv, cwd, env, timeout_s)


def current_user() -> tuple[str, ...]:
    """The controller's user: its uid, and its name where the passwd database has one."""
    uid = os.geteuid()
    try:
        return (pwd.getpwuid(uid).pw_name, str(uid))
    except KeyError:
        return (str(uid),)


class SubprocessBackend(HostBackend):
    """Options: base_dir, uid_range, default_timeout_s, max_output_bytes, kill_after_s,
    build_timeout_s (see HostBackend)."""

    name = "subprocess"
    sandbox_cls = SubprocessSandbox

    def __init__(self, **opts):
        if not sys.platform.startswith("linux"):
            raise BackendUnavailableError("backend subprocess needs Linux namespaces")
        super().__init__(**opts)
        require_binary("timeout", self.name, "coreutils")

    def prepare_root(self, root: str, uid: int, template: RootTemplate | None) -> None:
        if not self.privileged:
            return
        super().prepare_root(root, uid, template)
        os.makedirs(os.path.join(root, "proc"), exist_ok=True)
        dev = os.path.join(root, "dev")
        os.makedirs(os.path.join(dev, "shm"), exist_ok=True)
        for node in DEV_NODES:
            open(os.path.join(dev, node), "a").close()
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            if not os.path.lexists(os.path.join(dev, name)):
                os.symlink(target, os.path.join(dev, name))
