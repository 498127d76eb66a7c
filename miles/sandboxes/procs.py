"""Run one sandboxed host process to completion with capped output and a backstop kill.

Used by the host backends (subprocess, bwrap); the process is forked by the spawner (spawner.py).
The in-sandbox `timeout` wrapper is the real deadline; the backstop here fires only when
that wrapper itself is stuck or killed (timeout_s + kill_after + grace), and kills the whole
process group the child leads.

Design decisions:
- Output is read concurrently from both pipes into buffers capped at `max_output_bytes`; the rest is
  drained and dropped so a chatty command (`yes`) cannot fill the controller's memory or block.
- When the main process exits, a background child may still hold the pipes open (`server &`); we
  wait only `pipe_grace_s` for EOF, then return with what we have, so `exec` returns when the
  command does, as `docker exec` does.
- A cancelled caller kills the process group before re-raising: an abandoned exec leaves nothing.
- The pipes are read with `loop.add_reader` on the raw fds, and this function closes each fd exactly
  once. `loop.connect_read_pipe` is not used: under uvloop it closes the fd in libuv *and* through
  the file object it was given (uvloop issue #763), and between the two closes another thread can
  be handed the same number: seen here as `shutil.rmtree` in a destroy failing with EBADF/ENOTEMPTY
  when its directory fd was closed under it (the agentic fault test, several destroys at once).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

PIPE_GRACE_S = 0.2
BACKSTOP_GRACE_S = 3.0


class CappedBuffer:
    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    async def fill(self, fd: int) -> None:
        """Read the non-blocking pipe `fd` to EOF (the caller owns and closes the fd)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                readable = loop.create_future()
                loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
                try:
                    await readable
                finally:
                    loop.remove_reader(fd)
                continue
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


async def run_capped(spawner, argv: list[str], *, env: dict[str, str], setup,
                     deadline_s: float, max_output_bytes: int) -> ProcResult:
    """Start argv through the fork server with `setup`, wait up to `deadline_s` (the backstop),
    return its output. The command is a session leader, so its pid is the process group we kill
    on backstop or cancellation."""
    started = time.monotonic()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = await spawner.spawn(argv, env, setup, out_w, err_w)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    out, err = CappedBuffer(max_output_bytes), CappedBuffer(max_output_bytes)
    readers = []
    backstop = False
    try:
        for fd, buf in ((out_r, out), (err_r, err)):
            os.set_blocking(fd, False)
            readers.append(asyncio.create_task(buf.fill(fd)))
        try:
            exit_code = await asyncio.wait_for(asyncio.shield(spawner.wait(pid)), deadline_s)
        except asyncio.TimeoutError:
            backstop = True
            kill_group(pid)
            exit_code = await spawner.wait(pid)
        _, pending = await asyncio.wait(readers, timeout=PIPE_GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # readers off the fds before close
    except BaseException:
        kill_group(pid)
        spawner.forget(pid)
        for task in readers:
            task.cancel()
        raise
    finally:
        for task in readers:
            if not task.done():
                task.cancel()
        loop = asyncio.get_running_loop()
        for fd in (out_r, err_r):
            loop.remove_reader(fd)   # a cancelled reader's finally may not have run yet
            os.close(fd)
    return ProcResult(exit_code, out.text(), err.text(), time.monotonic() - started,
                      out.truncated or err.truncated, backstop)
