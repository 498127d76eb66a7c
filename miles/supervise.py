"""One way to run a child process: a log file, its own process group, deadlines, no orphans.

Every child Miles starts goes through `SupervisedProcess`: actor processes (the node daemon),
engine and gateway servers (`engines/procs.ServerProcess` adds the health wait), and external
commands run to completion (`run_command`, for `eval.command`).

Design decisions:
- Output goes to a log file, never to a pipe: a chatty child blocked on a full pipe looks like a
  hung child, and a reader with a line limit (asyncio's `readline()` stops at 64 KiB) can die and
  leave it blocked. Whoever wants the output on a console follows the file (`LogFollower`):
  chunks split on newlines, a partial line flushed in `MAX_PIECE_BYTES` pieces, so no line is
  too long and the child never waits for its reader.
- Errors quote the tail of that log, which is where the real reason is.
- Each child runs in its own session (`start_new_session=True`), so it leads a process group;
  `stop()` signals every member. Descendants are also collected with psutil *before* signalling:
  a child that called setsid() itself has left the group, and after its parent dies it can no
  longer be found from our pid. Members are signalled one by one (no killpg): once the group is
  empty its id could belong to someone else.
- A SIGKILLed parent cannot clean up, so on Linux the child is started through a tiny exec shim
  that sets PR_SET_PDEATHSIG=SIGKILL before exec'ing the real command (no `preexec_fn`, which
  can deadlock in a threaded parent). The kernel ties that signal to the *thread* that forked, so
  the shim is used only when starting from the main thread; an `atexit` hook stops whatever is
  still running at a normal interpreter exit.
- Waiting is async without a thread per child: a pidfd becomes readable when the process exits
  (polling where pidfds are missing). Every wait takes a deadline, and its error names the
  process, what was waited for and the log tail.
- One restart rule for everything restarted (`RestartBudget`): at most `max_restarts` restarts in
  any `window_s`, each after an exponential backoff. The node daemon gives an actor up when its
  window is full; the engine fleet waits for room in the window instead (an engine is never
  given up; the fleet's own deadline, `engine.no_engine_timeout_s`, ends a fleet left with none).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

LOG_TAIL_LINES = 40
MAX_PIECE_BYTES = 64 * 1024  # a longer line reaches a followed console in pieces of this size

# prctl(PR_SET_PDEATHSIG=1, SIGKILL), then make sure the parent did not die before that call
# (its pid is argv[1]), then become the real command. The pid is kept, so stop() still works.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL);"
    "os.getppid()==int(sys.argv[1]) or os._exit(70);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_live: weakref.WeakSet[SupervisedProcess] = weakref.WeakSet()


class ProcessFailed(RuntimeError):
    """The process exited, or did not finish or become ready, before its deadline."""


def read_log_tail(path: Path | None, n_lines: int = LOG_TAIL_LINES, since: int = 0) -> str:
    """The last `n_lines` of a log (from byte offset `since` on), escape codes removed."""
    if path is None or not path.exists():
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(since, f.tell() - 64 * 1024))
        lines = _ANSI_ESCAPE.sub("", f.read().decode("utf-8", "replace")).splitlines()
    return "\n".join(lines[-n_lines:]) or "(log is empty)"


class SupervisedProcess:
    """One child: `start()`, `await wait(timeout_s)`, `stop()`; output in `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None, cwd: str | Path | None = None):
        if not argv:
            raise ValueError(f"{name}: argv is empty")
        self.name = name
        self.argv = [str(a) for a in argv]
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"miles-{name.replace('/', '_')}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.log_offset = 0  # where this process's output starts (the log is appended to)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> SupervisedProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: already started (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
            argv = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        self.started_at = time.monotonic()
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
        """The last lines this process wrote (earlier runs appending to the same log excluded)."""
        return read_log_tail(self.log_path, n_lines, since=self.log_offset)

    def describe(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def exit_error(self, what: str) -> ProcessFailed:
        return ProcessFailed(
            f"{self.describe()} exited with code {self.returncode} {what}; "
            f"command: {' '.join(self.argv)}\nlast lines of {self.log_path}:\n{self.log_tail()}")

    async def wait(self, timeout_s: float | None = None, what: str = "to exit") -> int:
        """The exit code; `ProcessFailed` naming `what` if it is still running after timeout_s."""
        if self.proc is None:
            raise RuntimeError(f"{self.name}: wait() before start()")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # no pidfds, or already reaped: poll
            pidfd = None
        if pidfd is not None:
            loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            # poll() is None also while another thread's stop() holds Popen's wait lock
            while (code := self.proc.poll()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ProcessFailed(
                        f"{self.describe()} still running after timeout_s={timeout_s} (waited "
                        f"for it {what}); command: {' '.join(self.argv)}\nlast lines of "
                        f"{self.log_path}:\n{self.log_tail()}")
                if pidfd is not None and not exited.done():
                    try:
                        await asyncio.wait_for(asyncio.shield(exited), left)
                    except asyncio.TimeoutError:
                        pass
                else:
                    step = 0.02 if exited.done() else 0.1
                    await asyncio.sleep(step if left is None else min(step, left))
            return code
        finally:
            if pidfd is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)

    def signal_all(self, sig: int) -> None:
        """Send `sig` to the process and everything it started (its group and descendants)."""
        if self.proc is None:
            return
        for p in _members(self.proc.pid):
            if p.pid == self.proc.pid:
                if self.proc.poll() is None:
                    self.proc.send_signal(sig)
            else:
                _signal(p, sig)

    def stop(self, grace_s: float = 10.0, *, term_descendants: bool = True) -> int | None:
        """SIGTERM the process and its group, SIGKILL whatever is left after `grace_s`. Idempotent.

        `term_descendants=False` leaves children that started sessions of their own to the
        process itself for the grace period (an actor stops its servers in order, and a server
        that vanished under it first would read as a crash); they are SIGKILLed after it.
        Returns the exit code (negative: killed by that signal), None if it would not die
        (uninterruptible sleep): stop() reports that rather than hang.
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
            if term_descendants or _pgid(p.pid) == self.proc.pid:
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

    async def stop_async(self, grace_s: float = 10.0, *, term_descendants: bool = True) -> int | None:
        return await asyncio.to_thread(functools.partial(self.stop, grace_s,
                                                         term_descendants=term_descendants))

    def kill(self) -> None:
        """SIGKILL the top process only (fault-injection in tests; the group is left alone)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> SupervisedProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class CommandResult:
    exit_code: int
    output: str        # the command's output (stdout and stderr), at most max_output_bytes of its end
    log_path: Path
    duration_s: float

    def check(self, what: str) -> CommandResult:
        """Raise `ProcessFailed` naming `what`, the exit code and the output's end unless it is 0."""
        if self.exit_code != 0:
            tail = "\n".join(self.output.splitlines()[-LOG_TAIL_LINES:])
            raise ProcessFailed(f"{what} exited with code {self.exit_code}; last lines of "
                                f"{self.log_path}:\n{tail}")
        return self


async def run_command(name: str, argv: Sequence[str], *, timeout_s: float,
                      env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                      log_path: str | Path | None = None, kill_grace_s: float = 2.0,
                      max_output_bytes: int = 1 << 20) -> CommandResult:
    """Run a command to completion. On timeout (`ProcessFailed` naming `name`, `timeout_s` and the
    log tail) or cancellation its whole group is stopped before the error goes on."""
    proc = SupervisedProcess(name, argv, env=env, log_path=log_path, cwd=cwd).start()
    try:
        code = await proc.wait(timeout_s, what="to finish")
    except BaseException:
        await asyncio.shield(proc.stop_async(kill_grace_s))
        raise
    proc.stop(grace_s=0.0)  # whatever it left running in its group
    with open(proc.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(proc.log_offset, f.tell() - max_output_bytes))
        output = f.read().decode("utf-8", "replace")
    return CommandResult(code, output, proc.log_path, time.monotonic() - proc.started_at)


class LogFollower:
    """Copies what is appended to a log file to `write`, each line behind `prefix`.

    `pump()` reads what is there now; a line without its newline yet waits for it, unless it is
    already `MAX_PIECE_BYTES` long, then that piece goes out on its own line.
    """

    def __init__(self, path: Path, prefix: bytes, write: Callable[[bytes], object],
                 chunk_bytes: int = 1 << 20):
        self.path, self.prefix, self.write = path, prefix, write
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = b""
        self.chunk_bytes = chunk_bytes

    def pump(self, flush_partial: bool = False) -> int:
        """Forward what has been appended since the last call; returns the bytes read."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return 0
        total = 0
        # A child logging faster than the console takes it must not hold the caller's event
        # loop: one call reads a bounded amount, except the final one.
        budget = float("inf") if flush_partial else 8 * self.chunk_bytes
        with f:
            f.seek(self.offset)
            while total < budget and (chunk := f.read(self.chunk_bytes)):
                total += len(chunk)
                self.offset += len(chunk)
                self._lines(self.partial + chunk)
        if flush_partial and self.partial:
            self.write(self.prefix + self.partial + b"\n")
            self.partial = b""
        return total

    def _lines(self, data: bytes) -> None:
        out = []
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            body = data[start:nl]
            pieces = [body[i:i + MAX_PIECE_BYTES] for i in range(0, len(body), MAX_PIECE_BYTES)]
            out += [self.prefix + piece + b"\n" for piece in pieces or [b""]]
            start = nl + 1
        rest = data[start:]
        while len(rest) >= MAX_PIECE_BYTES:
            out.append(self.prefix + rest[:MAX_PIECE_BYTES] + b"\n")
            rest = rest[MAX_PIECE_BYTES:]
        self.partial = rest
        if out:
            self.write(b"".join(out))


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


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds (0: in the whole run); restart n
    of the window waits `backoff_s * 2**n`, at most `backoff_max_s`."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float = 0.5,
                 backoff_max_s: float = 10.0):
        self.max_restarts, self.window_s = max_restarts, window_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.times: list[float] = []  # monotonic times of the restarts still in the window
        self.total = 0

    def recent(self, now: float | None = None) -> int:
        """Restarts in the window that ends now."""
        now = time.monotonic() if now is None else now
        if self.window_s > 0:
            self.times = [t for t in self.times if now - t < self.window_s]
        return len(self.times)

    def exhausted(self, now: float | None = None) -> bool:
        return self.recent(now) >= self.max_restarts

    def delay_s(self, now: float | None = None) -> float:
        """How long to wait before the next restart: its backoff, or, with the window full, until
        the oldest restart in it ages out (inf when every restart of the run counts)."""
        now = time.monotonic() if now is None else now
        n = self.recent(now)
        backoff = min(self.backoff_max_s, self.backoff_s * 2 ** n)
        if n < self.max_restarts:
            return backoff
        if self.window_s <= 0:
            return float("inf")
        room = self.times[n - self.max_restarts] + self.window_s - now
        return max(backoff, room)

    def record(self, now: float | None = None) -> None:
        self.times.append(time.monotonic() if now is None else now)
        self.total += 1


@atexit.register
def _stop_all_live() -> None:
    for child in list(_live):
        child.stop(grace_s=2.0)
