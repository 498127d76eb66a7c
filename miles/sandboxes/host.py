"""What the two host backends (subprocess, bwrap) share: sandbox directories, a private uid per
sandbox, the TTL reaper, safe file transfer, destroy and sweep.

Layout on the host (base_dir: see default_base_dir; mode 0711, owned by us):

    base_dir/<backend>-<uid>/        the sandbox root R; the command sees R/x at /x
    base_dir/<backend>-<uid>.json    its record (labels, uid, TTL deadline, reaper pid)
    base_dir/templates/<key>/        rootfs templates built from Dockerfiles (read-only to sandboxes)

Design decisions:
- As root, every sandbox gets its own unprivileged uid (claimed atomically by creating its
  directory, which is named after it). That one choice gives three properties at once: R is 0700 so
  no other episode can read it; RLIMIT_NPROC counts only this sandbox's processes, so a fork bomb
  stops at `max_processes`; and `kill(-1)` sent *as that uid* kills every process of the sandbox
  however it daemonised, which is how destroy, sweep and the reaper clean up. Without root, the
  sandbox runs as our own uid and these guarantees weaken (see each backend's docstring).
- The TTL is a detached `sh` per sandbox (`sleep ttl; kill; rm`), in its own session so it outlives
  a crashed controller; destroy kills its process group. Every exec's timeout is also clipped to
  the remaining TTL, so no command outlives the sandbox even without the reaper.
- Records live beside R, not inside it, so a sandbox cannot forge its own labels or deadline.
- Files move in and out of R without ever following a symlink the sandbox planted, and R is never
  deleted across a mount point (hostfs.py).
"""

from __future__ import annotations

import asyncio
import errno
import glob
import os
import random
import shlex
import shutil
import subprocess
import time
from typing import Mapping

import msgspec

from miles.sandboxes.base import (Backend, BackendUnavailableError, ExecResult, Sandbox,
                                  SandboxCreateError, SandboxError, SandboxSpec, SandboxSpecError,
                                  check, labels_match, timed_out_from, DEFAULT_WORKDIR)
from miles.sandboxes import hostfs, procs
from miles.sandboxes.hostfs import (RESERVED_DIRS, SYSTEM_DIRS, RootTemplate,
                                    default_base_dir, is_full_root, remove_tree)
from miles.sandboxes.spawner import SETUP_FAILED, Limits, SpawnerClient

DEFAULT_UID_RANGE = (2_000_000_000, 2_100_000_000)
ORPHAN_GRACE_S = 120.0
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HostRecord(msgspec.Struct):
    """What sweep needs to find and kill a sandbox without its controller."""

    id: str
    backend: str
    uid: int
    root: str
    labels: dict[str, str]
    created_at: float
    deadline: float
    reaper_pid: int = 0
    owner_pid: int = 0
    privileged: bool = True


class HostSandbox(Sandbox):
    """A sandbox whose root R is a host directory. Subclasses implement `_exec`."""

    def __init__(self, backend: "HostBackend", record: HostRecord, spec: SandboxSpec, *,
                 workdir: str, env: dict[str, str], sys_root: str,
                 reaper: subprocess.Popen | None):
        super().__init__(record.id, spec, workdir=workdir,
                         default_timeout_s=backend.default_timeout_s)
        self.backend = backend
        self.record = record
        self.root = record.root
        self.uid = record.uid
        self.image_env = env
        self.sys_root = sys_root
        self._reaper = reaper
        self.created_at = record.created_at

    # Paths -----------------------------------------------------------------------------------

    def host_path(self, path: str) -> str:
        """Where sandbox path `path` lives on the host (for inspection; transfer uses fds)."""
        return os.path.join(self.root, path.lstrip("/"))

    def _parts(self, path: str, field: str) -> list[str]:
        parts = [p for p in path.split("/") if p]
        check(bool(parts), field, path, "a path below /")
        check(parts[0] not in RESERVED_DIRS, field, path,
              f"a path outside the read-only system directories {RESERVED_DIRS} "
              f"(backend {self.backend.name})")
        return parts

    def ensure_dir(self, path: str) -> None:
        """mkdir -p of a sandbox path (a working directory), owned by the sandbox."""
        parts = [p for p in path.split("/") if p]
        if parts and parts[0] not in RESERVED_DIRS:
            os.close(hostfs.open_dir(self.root, parts, path, create=True, owner=self._owner))

    @property
    def _owner(self) -> int | None:
        return self.uid if self.backend.privileged else None

    async def _upload(self, path: str, data: bytes, mode: int) -> None:
        hostfs.write_file(self.root, self._parts(path, "path"), path, data, mode, self._owner)

    async def _download(self, path: str) -> bytes:
        parts = [p for p in path.split("/") if p]
        check(bool(parts), "path", path, "a file path below /")
        return hostfs.read_file(self.root, parts, path)

    # Exec ------------------------------------------------------------------------------------

    def exec_env(self, env: dict[str, str], *, home: str = "/root", tmp: str = "/tmp"
                 ) -> dict[str, str]:
        base = {"PATH": BASE_PATH, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
                "USER": "root", "LOGNAME": "root", "HOSTNAME": "sandbox"}
        return {**base, **self.image_env, **self.spec.env, **env}

    async def run_host(self, argv: list[str], env: dict[str, str], timeout_s: float,
                       setup) -> ExecResult:
        kill_after = self.backend.kill_after_s
        result = await procs.run_capped(
            self.backend.spawner, argv, env=env, setup=setup,
            deadline_s=timeout_s + kill_after + procs.BACKSTOP_GRACE_S,
            max_output_bytes=self.backend.max_output_bytes)
        if result.exit_code == 125 and SETUP_FAILED in result.stderr:
            raise SandboxError(f"{self.backend.name} sandbox {self.id}: set-up before exec "
                               f"failed: {result.stderr.split(SETUP_FAILED, 1)[1].strip()}")
        timed_out = result.backstop or timed_out_from(result.exit_code, result.duration_s,
                                                      timeout_s)
        return ExecResult(exit_code=result.exit_code, stdout=result.stdout,
                          stderr=result.stderr, timed_out=timed_out,
                          duration_s=result.duration_s, truncated=result.truncated)

    def limits(self, timeout_s: float) -> Limits:
        spec = self.spec
        # RLIMIT_CPU is a second guard behind the wall-clock timeout: a process may burn at most
        # the cores it was given for the time it was given (+1 s).
        return Limits(memory_bytes=spec.memory_mb << 20,
                      cpu_s=int(timeout_s * max(spec.cpu, 1.0)) + 1,
                      nproc=spec.max_processes if self.backend.privileged else None,
                      fsize_bytes=spec.disk_mb << 20)

    async def _destroy(self) -> None:
        await self.backend.destroy_record(self.record, self._reaper)


class HostBackend(Backend):
    """Base for subprocess and bwrap. Subclasses set `sandbox_cls` and `prepare_root`."""

    sandbox_cls: type[HostSandbox] = HostSandbox
    # The subprocess backend chroots into R and needs mount points for the system dirs there.
    needs_mountpoints = False

    def __init__(self, *, base_dir: str | None = None,
                 uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
                 default_timeout_s: float = 600.0, max_output_bytes: int = 1 << 20,
                 kill_after_s: float = 2.0, build_timeout_s: float = 600.0):
        lo, hi = uid_range
        check(100_000 <= lo < hi <= 2**31 - 2, f"{self.name}.uid_range", uid_range,
              "(lo, hi) with 100000 <= lo < hi < 2**31 (uids no real user holds)")
        check(max_output_bytes >= 1024, f"{self.name}.max_output_bytes", max_output_bytes,
              ">= 1024")
        self.base_dir = os.path.abspath(base_dir or default_base_dir())
        self.uid_range = (lo, hi)
        self.default_timeout_s = default_timeout_s
        self.max_output_bytes = max_output_bytes
        self.kill_after_s = kill_after_s
        self.build_timeout_s = build_timeout_s
        self.privileged = os.geteuid() == 0
        if self.privileged:
            require_binary("setpriv", self.name, "util-linux; the TTL reaper kills as the "
                                                  "sandbox uid with it")
        self.spawner = SpawnerClient()
        self._templates: dict[str, RootTemplate] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        os.makedirs(self.base_dir, exist_ok=True)
        if self.privileged:
            # Sandbox uids must traverse base_dir to reach their own (0700) root, nothing more.
            os.chmod(self.base_dir, 0o711)
            parent = os.path.dirname(self.base_dir)
            while parent != "/":
                check(os.stat(parent).st_mode & 0o001 != 0, f"{self.name}.base_dir",
                      self.base_dir, f"a directory whose ancestors other users may traverse "
                      f"({parent} is not o+x; sandboxes run under their own uid)")
                parent = os.path.dirname(parent)

    # Create ----------------------------------------------------------------------------------

    def _claim(self) -> tuple[int, str]:
        for _ in range(100):
            uid = random.randrange(*self.uid_range) if self.privileged else os.getuid()
            sid = f"{self.name}-{uid}" if self.privileged else \
                f"{self.name}-u{uid}-{random.getrandbits(40):010x}"
            try:
                os.mkdir(os.path.join(self.base_dir, sid), 0o700)
                return uid, sid
            except FileExistsError:
                continue
        raise SandboxCreateError(f"{self.name}: could not claim a free sandbox uid in "
                                 f"{self.uid_range} after 100 tries", retryable=True)

    def _record_path(self, sid: str) -> str:
        return os.path.join(self.base_dir, sid + ".json")

    def _write_record(self, record: HostRecord) -> None:
        path = self._record_path(record.id)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(record))
        os.replace(tmp, path)

    async def template_for(self, spec: SandboxSpec) -> RootTemplate | None:
        if spec.rootfs is not None:
            path = os.path.abspath(spec.rootfs)
            if not os.path.isdir(path):
                raise SandboxSpecError(f"SandboxSpec.rootfs={spec.rootfs!r} is invalid: "
                                       "expected an existing directory")
            return RootTemplate(path=path, full_root=is_full_root(path))
        if spec.dockerfile is not None:
            from miles.sandboxes import rootfs
            key = rootfs.template_key(self.name, spec.dockerfile)
            lock = self._template_locks.setdefault(key, asyncio.Lock())
            async with lock:
                if key not in self._templates:
                    self._templates[key] = await rootfs.build_template(self, spec, key)
            return self._templates[key]
        return None

    def prepare_root(self, root: str, uid: int, template: RootTemplate | None) -> None:
        """The skeleton of R: an empty mount point for every system directory, and the same
        symlinks the system root has (/bin -> usr/bin on merged-/usr systems)."""
        sys_root = template.path if template is not None and template.full_root else "/"
        for name in SYSTEM_DIRS:
            src, dst = os.path.join(sys_root, name), os.path.join(root, name)
            if os.path.lexists(dst) or not os.path.lexists(src):
                continue
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                os.mkdir(dst, 0o755)

    async def create(self, spec: SandboxSpec) -> HostSandbox:
        if spec.image is not None:
            raise SandboxSpecError(
                f"SandboxSpec.image={spec.image!r} is invalid for backend {self.name}: host "
                "backends take rootfs= (a directory) or dockerfile= instead of an image")
        template = await self.template_for(spec)
        uid, sid = self._claim()
        root = os.path.join(self.base_dir, sid)
        now = time.time()
        record = HostRecord(id=sid, backend=self.name, uid=uid, root=root,
                            labels=dict(spec.labels), created_at=now, deadline=now + spec.ttl_s,
                            owner_pid=os.getpid(), privileged=self.privileged)
        reaper = None
        try:
            workdir = spec.workdir or (template.workdir if template else None) or DEFAULT_WORKDIR
            if template is not None:
                await asyncio.to_thread(hostfs.copy_template, template, root)
            for rel in (workdir.lstrip("/"), "tmp", "root"):
                os.makedirs(os.path.join(root, rel), exist_ok=True)
            self.prepare_root(root, uid, template)
            if self.privileged:
                hostfs.chown_tree(root, uid, skip=RESERVED_DIRS)
            self._write_record(record)
            reaper = self._start_reaper(record)
            record.reaper_pid = reaper.pid
            self._write_record(record)
        except BaseException as exc:
            await self.destroy_record(record, reaper)
            if isinstance(exc, (SandboxError, asyncio.CancelledError)):
                raise
            raise SandboxCreateError(f"{self.name}: creating sandbox {sid} failed: {exc!r}",
                                     retryable=isinstance(exc, OSError)
                                     and exc.errno in (errno.EAGAIN, errno.ENOMEM)) from exc
        sys_root = template.path if template is not None and template.full_root else "/"
        env = dict(template.env) if template is not None else {}
        return self.sandbox_cls(self, record, spec, workdir=workdir, env=env, sys_root=sys_root,
                                reaper=reaper)

    def _start_reaper(self, record: HostRecord) -> subprocess.Popen:
        q = shlex.quote
        steps = [f"sleep {max(1, int(record.deadline - time.time()) + 1)}"]
        if record.privileged:
            kill = (f"setpriv --reuid={record.uid} --regid={record.uid} --clear-groups "
                    "/bin/sh -c 'kill -9 -1' 2>/dev/null")
            steps += [kill, kill]
        steps.append(f"grep -qF -e {q(' ' + record.root + '/')} -e {q(' ' + record.root + ' ')}"
                     f" /proc/self/mountinfo || rm -rf -- {q(record.root)}")
        steps.append(f"rm -f -- {q(self._record_path(record.id))}")
        # $0 carries the sandbox id so sweep can tell this reaper from a recycled pid.
        return subprocess.Popen(["/bin/sh", "-c", "; ".join(steps), f"miles-reaper-{record.id}"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True)

    # Destroy and sweep -----------------------------------------------------------------------

    async def kill_uid(self, uid: int) -> None:
        """kill(-1) sent as `uid`: every process of that uid dies, fork bombs included (kill(-1)
        is atomic against fork: a fork racing it is aborted by the pending SIGKILL)."""
        lo, hi = self.uid_range
        if not (self.privileged and lo <= uid < hi and uid not in (0, os.getuid())):
            raise SandboxError(f"refusing to kill all processes of uid {uid}: outside the "
                               f"sandbox uid range {self.uid_range}")
        await self.spawner.kill_uid(uid)

    async def destroy_record(self, record: HostRecord,
                             reaper: subprocess.Popen | None = None) -> None:
        if record.privileged and self.privileged:
            await self.kill_uid(record.uid)
        if reaper is not None:
            procs.kill_group(reaper.pid)
            reaper.wait()
        elif record.reaper_pid and _is_reaper(record.reaper_pid, record.id):
            procs.kill_group(record.reaper_pid)
        elif not record.reaper_pid:  # its controller died after starting it, before recording it
            for pid in _reapers_of(record.id):
                procs.kill_group(pid)
        await asyncio.to_thread(remove_tree, record.root)
        for path in (self._record_path(record.id), self._record_path(record.id) + ".tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def records(self) -> list[HostRecord]:
        out = []
        for path in glob.glob(os.path.join(self.base_dir, f"{self.name}-*.json")):
            try:
                with open(path, "rb") as f:
                    out.append(msgspec.json.decode(f.read(), type=HostRecord))
            except (OSError, msgspec.DecodeError):
                continue
        return out

    async def sweep(self, labels: Mapping[str, str]) -> int:
        check(bool(labels), f"{self.name}.sweep(labels)", dict(labels),
              "at least one label (an empty filter would match other runs' sandboxes)")
        now = time.time()
        n = 0
        known = set()
        for record in self.records():
            known.add(record.id)
            if labels_match(record.labels, labels) or record.deadline < now:
                await self.destroy_record(record)
                n += 1
        # A controller killed between claiming a directory and writing its record leaves a
        # bare directory; reclaim those once they are clearly not being set up right now.
        for root in glob.glob(os.path.join(self.base_dir, f"{self.name}-*")):
            sid = os.path.basename(root)
            if sid.endswith((".json", ".tmp")) or sid in known or not os.path.isdir(root):
                continue
            if now - os.stat(root).st_mtime < ORPHAN_GRACE_S:
                continue
            uid = _uid_of(sid)
            if uid is not None and self.privileged:
                await self.kill_uid(uid)
            await asyncio.to_thread(remove_tree, root)
            n += 1
        return n

    def live_ids(self) -> list[str]:
        return sorted(r.id for r in self.records())

    async def close(self) -> None:
        self.spawner.close()


def _uid_of(sid: str) -> int | None:
    tail = sid.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _reapers_of(sid: str) -> list[int]:
    """Pids whose $0 is this sandbox's reaper name (an exact argv entry: sid 1 is not sid 12)."""
    mark, out = f"miles-reaper-{sid}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


def _is_reaper(pid: int, sid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"miles-reaper-{sid}".encode() in f.read()
    except OSError:
        return False


def require_binary(name: str, backend: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BackendUnavailableError(f"backend {backend} needs `{name}` on PATH ({hint})")
    return path

