"""Launch a server subprocess, wait until it is healthy, stop it cleanly, leave no orphans.

Shared by the SGLang launcher, the gateway launcher, the embedded engine launcher and the node
daemon: every long-lived HTTP child of Miles goes through `ServerProcess`.

Design decisions:
- Each server runs in its own session (`start_new_session=True`), so it is the leader of a
  process group; `stop()` signals every member of that group. SGLang forks schedulers and a
  detokenizer; signalling only the top pid would orphan them.
- Descendants are also collected with psutil *before* signalling: a child that called setsid()
  itself has left our group, and after its parent dies it can no longer be found from our pid.
  Members are signalled one by one (no killpg): once the group is empty its id could belong to
  someone else.
- A SIGKILLed parent cannot run cleanup, so on Linux the child is started through a tiny exec
  shim that sets PR_SET_PDEATHSIG=SIGKILL before exec'ing the real command (no `preexec_fn`,
  which can deadlock in a threaded parent). The kernel ties that signal to the *thread* that
  forked, so the shim is used only when starting from the main thread; an `atexit` hook stops
  whatever is still running at a normal interpreter exit.
- Output goes to a log file, never to a pipe: a chatty server blocked on a full pipe looks like a
  hung server. Errors quote the tail of that log, which is where the real reason is.
- Recipe passthrough tables become command-line flags by one rule set (`table_to_flags`),
  shared by the SGLang and smg launchers: both CLIs are argparse with `--dashed-names`.
- Health waiting is async (the node daemon and the rollout side run on asyncio) and fails
  early, with the exit code and the log tail, when the process dies before it becomes healthy.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import psutil

LOG_TAIL_LINES = 40

# prctl(PR_SET_PDEATHSIG=1, SIGKILL), then make sure the parent did not die before that call
# (its pid is argv[1]), then become the real command. The pid is kept, so stop() still works.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL);"
    "os.getppid()==int(sys.argv[1]) or os._exit(70);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)

_live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
# OS entropy, not the `random` module: tests seed that, and two seeded processes would pick
# the same ports.
_port_rng = random.SystemRandom()
_recent_ports: collections.deque[int] = collections.deque(maxlen=256)


_FLAG_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ServerStartError(RuntimeError):
    """The server exited, or never became healthy, before the deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, below the kernel's ephemeral range.

    A server binds its port seconds after we pick it (an engine loads its model first). A port
    from the ephemeral range can meanwhile become the source port of some outgoing connection,
    and on a busy test machine that happens; ports below the range are never handed out that
    way (SGLang picks its internal ports the same way).
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = _port_rng.randrange(max(1024, low - 12000), low)
        if port in _recent_ports:  # handed out moments ago, probably not bound yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _recent_ports.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def table_to_flags(table: Mapping[str, Any], *, section: str,
                   owned: Mapping[str, str] | None = None) -> list[str]:
    """Turn a recipe table into argparse flags.

    `foo_bar = v` -> `--foo-bar v`; `true` -> bare `--foo-bar` (store_true); `false` or null ->
    omitted (the tool's default); a list -> `--foo-bar v1 v2` (nargs="+"); a table -> one JSON
    string. `owned` maps keys the launcher sets itself to the config field to use instead:
    two sources for one value is how a run silently uses the wrong port.
    """
    flags: list[str] = []
    for key, value in table.items():
        where = f"{section}.{key}"
        if not isinstance(key, str) or not _FLAG_NAME.match(key):
            raise ValueError(f"{where}: not a flag name (expected lower-case letters, digits, "
                             f"'_' or '-')")
        norm = key.replace("-", "_")
        if owned and norm in owned:
            raise ValueError(f"{where}: Miles sets this flag itself; use the field "
                             f"'{owned[norm]}' instead of passing it through")
        flag = "--" + norm.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{where}: empty list; omit the key to keep the default")
            if not all(_is_scalar(v) for v in value):
                raise ValueError(f"{where}: list items must be strings or numbers, got {value!r}")
            flags += [flag, *(_scalar(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        elif _is_scalar(value):
            flags += [flag, _scalar(value)]
        else:
            raise ValueError(f"{where}: unsupported value {value!r} (expected a string, number, "
                             f"bool, list or table)")
    return flags


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def _scalar(v: Any) -> str:
    return v if isinstance(v, str) else repr(v)


def read_log_tail(path: Path | None, n_lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        lines = _ANSI_ESCAPE.sub("", f.read().decode("utf-8", "replace")).splitlines()
    return "\n".join(lines[-n_lines:]) or "(log is empty)"


class ServerProcess:
    """One server child process: `start()`, `await wait_healthy(url)`, `stop()`."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None, cwd: str | Path | None = None):
        if not argv:
            raise ValueError(f"{name}: argv is empty")
        self.name = name
        self.argv = [str(a) for a in argv]
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"miles-{name}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> ServerProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: already started (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
            argv = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        _live.add(self)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_lines: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.log_path, n_lines)

    def exit_error(self, what: str) -> ServerStartError:
        return ServerStartError(
            f"{self.name} (pid {self.pid}) exited with code {self.returncode} {what}; "
            f"command: {' '.join(self.argv)}\nlast lines of {self.log_path}:\n{self.log_tail()}")

    async def wait_healthy(self, url: str, *, timeout_s: float, path: str = "/health",
                           interval_s: float = 0.2) -> None:
        """Poll `GET url+path` until it answers 200; fail at once if the process exits."""
        if self.proc is None:
            raise RuntimeError(f"{self.name}: wait_healthy() before start()")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        probe_timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, timeout_s)))
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while True:
                if not self.alive:
                    raise self.exit_error(f"before {url}{path} became healthy")
                try:
                    async with session.get(url + path) as resp:
                        if resp.status == 200:
                            return
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    last = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} (pid {self.pid}) not healthy at {url}{path} after "
                        f"timeout_s={timeout_s} (last probe: {last})\nlast lines of "
                        f"{self.log_path}:\n{self.log_tail()}")
                await asyncio.sleep(interval_s)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL whatever is left after `grace_s`. Idempotent.

        Returns the server's exit code (negative: killed by that signal), None if it would not
        die (uninterruptible sleep): stop() reports that rather than hang.
        """
        if self.proc is None:
            return None
        _live.discard(self)
        deadline = time.monotonic() + grace_s
        # Our own child is waited for through Popen (psutil would reap it and lose the code).
        others = [p for p in _members(self.proc.pid) if p.pid != self.proc.pid]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        for p in others:
            _signal(p, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        _, alive = psutil.wait_procs(others, timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5.0)
        try:
            return self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    async def stop_async(self, grace_s: float = 10.0) -> int | None:
        return await asyncio.to_thread(self.stop, grace_s)

    def kill(self) -> None:
        """SIGKILL the top process only (fault-injection in tests; the group is left alone)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _members(pid: int) -> list[psutil.Process]:
    """The process, its descendants, and everything still in its process group.

    The group scan finds children orphaned by an earlier kill of the leader (re-parented, so
    no longer descendants); the descendant walk finds children that left the group by setsid().
    """
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        for p in (root, *root.children(recursive=True)):
            found[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if p.pid not in found and os.getpgid(p.pid) == pid:
                found[p.pid] = p
        except (ProcessLookupError, psutil.Error):
            pass
    return list(found.values())


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


@atexit.register
def _stop_all_live() -> None:
    for server in list(_live):
        server.stop(grace_s=2.0)
