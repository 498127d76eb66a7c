"""Run one host process to completion with capped output and a backstop kill.

Shared by the host backends (subprocess, bwrap) and the docker CLI-free paths that still spawn
helpers. The in-sandbox `timeout` wrapper is the real deadline; the backstop here fires only when
that wrapper itself is stuck or killed (timeout_s + kill_after + grace), and kills the whole
process group the child leads.

Design decisions:
- Output is read concurrently from both pipes into buffers capped at `max_output_bytes`; the rest is
  drained and dropped so a chatty command (`yes`) cannot fill the controller's memory or block.
- When the main process exits, a background child may still hold the pipes open (`server &`); we
  wait only `pipe_grace_s` for EOF, then return with what we have, so `exec` returns when the
  command does, as `docker exec` does.
- A cancelled caller kills the process group before re-raising: an abandoned exec leaves nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Callable

PIPE_GRACE_S = 0.2
BACKSTOP_GRACE_S = 3.0


class CappedBuffer:
    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    async def fill(self, stream: asyncio.StreamReader) -> None:
        while True:
            chunk = await stream.read(1 << 16)
            if not chunk:
                return
            room = self.cap - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ProcResult:
    __slots__ = ("exit_code", "stdout", "stderr", "duration_s", "truncated", "backstop")

    def __init__(self, exit_code: int, stdout: str, stderr: str, duration_s: float,
                 truncated: bool, backstop: bool):
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.duration_s = duration_s
        self.truncated = truncated
        self.backstop = backstop


async def run_capped(argv: list[str], *, env: dict[str, str], deadline_s: float,
                     max_output_bytes: int, preexec_fn: Callable[[], Any] | None = None,
                     cwd: str | None = None) -> ProcResult:
    """Spawn argv in a new session, wait up to `deadline_s` (the backstop), return its output.

    The child is a session leader, so its pid is the process-group id we kill on backstop or
    cancellation.
    """
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, preexec_fn=preexec_fn,
        start_new_session=True)
    out, err = CappedBuffer(max_output_bytes), CappedBuffer(max_output_bytes)
    readers = [asyncio.create_task(out.fill(proc.stdout)),
               asyncio.create_task(err.fill(proc.stderr))]
    backstop = False
    try:
        try:
            exit_code = await asyncio.wait_for(proc.wait(), deadline_s)
        except asyncio.TimeoutError:
            backstop = True
            kill_group(proc.pid)
            exit_code = await proc.wait()
        _, pending = await asyncio.wait(readers, timeout=PIPE_GRACE_S)
        for task in pending:
            task.cancel()
    except BaseException:
        kill_group(proc.pid)
        for task in readers:
            task.cancel()
        raise
    return ProcResult(exit_code, out.text(), err.text(), time.monotonic() - started,
                      out.truncated or err.truncated, backstop)
