"""A small fork server that starts sandboxed commands for the host backends.

Why: setting up a jailed command needs code between fork and exec (namespaces, mounts, chroot,
rlimits, setuid). In the controller that means `preexec_fn`, which forces a full fork() of the
controller; fork costs grow with its memory (measured here: 1.5 ms at 30 MB, 25-35 ms at 300 MB,
and an RL controller holds GBs). So one small helper process per backend does the forking: it
holds ~20 MB, forks in well under a millisecond, runs the set-up in the child and execs.

Protocol (msgpack over a SOCK_SEQPACKET socketpair, fds passed with SCM_RIGHTS, no pickle):
controller -> spawner  Spawn(req, argv, env, setup) + [stdout_w, stderr_w]   |  KillUid(req, uid)
spawner -> controller  Spawned(req, pid) | Failed(req, error) | Exited(pid, exit_code) | Done(req)

Design decisions:
- The controller keeps the pipes' read ends and the pids; it can killpg() a command directly, the
  spawner only forks and reaps (SIGCHLD through a wakeup fd, single-threaded).
- The spawner dies with the controller (PDEATHSIG, and EOF on its socket), and every command it
  forked dies with the spawner (PDEATHSIG in the set-up), so a SIGKILLed controller leaves no
  running commands; directories and reapers are left for sweep.
- Set-up failures are written to the command's stderr behind a marker and exit 125, and the host
  backends raise them as SandboxError: an infrastructure fault never looks like a task result.
- The spawner ignores SIGTERM/SIGINT (a node daemon's stop reaches the controller's whole process
  group), so the controller's shutdown can still destroy its sandboxes; children get them back.
- If the spawner dies, pending calls fail and the next call starts a fresh one.
"""

from __future__ import annotations

import array
import asyncio
import os
import selectors
import signal
import socket
import subprocess
import sys
from typing import Union

import msgspec

from miles.sandboxes import linux
from miles.sandboxes.base import SandboxError

SETUP_FAILED = "miles-sandbox-setup-failed: "


class Limits(msgspec.Struct):
    memory_bytes: int | None = None
    cpu_s: int | None = None
    nproc: int | None = None
    fsize_bytes: int | None = None


class Jail(msgspec.Struct, tag="jail"):
    root: str
    sys_root: str
    cwd: str
    uid: int
    network: bool
    limits: Limits


class AsUid(msgspec.Struct, tag="as_uid"):
    uid: int | None
    limits: Limits
    cwd: str | None = None
    network: bool = True


Setup = Union[Jail, AsUid]


class Spawn(msgspec.Struct, tag="spawn"):
    req: int
    argv: list[str]
    env: dict[str, str]
    setup: Setup


class KillUid(msgspec.Struct, tag="kill_uid"):
    req: int
    uid: int


class Spawned(msgspec.Struct, tag="spawned"):
    req: int
    pid: int


class Failed(msgspec.Struct, tag="failed"):
    req: int
    error: str


class Exited(msgspec.Struct, tag="exited"):
    pid: int
    exit_code: int


class Done(msgspec.Struct, tag="done"):
    req: int


Request = Union[Spawn, KillUid]
Reply = Union[Spawned, Failed, Exited, Done]
MAX_MSG = 1 << 20
CALL_TIMEOUT_S = 60.0  # a fork + reply takes milliseconds; a spawner that stops answering must not hang an exec


# Spawner side ------------------------------------------------------------------------------------

def _child(msg: Spawn, out_fd: int, err_fd: int) -> None:
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, 1 << 16)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        setup = msg.setup
        limits = msgspec.structs.asdict(setup.limits)
        if isinstance(setup, Jail):
            linux.enter_jail(setup.root, setup.sys_root, setup.cwd, setup.uid, setup.network,
                             limits)
        else:
            linux.enter_as(setup.uid, limits, setup.cwd, setup.network)
        os.execvpe(msg.argv[0], msg.argv, msg.env)
    except BaseException as exc:  # noqa: BLE001 - anything here must become a clean exit
        try:
            os.write(2, f"{SETUP_FAILED}{exc!r}\n".encode())
        finally:
            os._exit(125)


def _kill_uid(uid: int) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            linux.drop_to(uid, uid)
            os.kill(-1, signal.SIGKILL)  # as `uid`: every process of that uid, nothing else
        except BaseException:  # noqa: BLE001
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def serve(sock: socket.socket, parent_pid: int) -> None:
    linux.die_with_parent()
    if os.getppid() != parent_pid:
        return
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Request)
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # A stop signal to the controller's process group must not stop the spawner before the
    # controller has destroyed its sandboxes through it: it goes with its controller (EOF, PDEATHSIG).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(rfd, selectors.EVENT_READ)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock.sendall(encoder.encode(Exited(pid, os.waitstatus_to_exitcode(status))))

    while True:
        for key, _ in sel.select():
            if key.fileobj == rfd:
                os.read(rfd, 4096)
                reap()
                continue
            fds = array.array("i")
            data, ancdata, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(8 * fds.itemsize))
            if not data:
                return  # controller gone
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            msg = decoder.decode(data)
            if isinstance(msg, KillUid):
                _kill_uid(msg.uid)
                sock.sendall(encoder.encode(Done(msg.req)))
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                reply: Reply = Failed(msg.req, repr(exc))
            else:
                if pid == 0:
                    _child(msg, fds[0], fds[1])
                reply = Spawned(msg.req, pid)
            for fd in fds:
                os.close(fd)
            sock.sendall(encoder.encode(reply))


# Controller side ---------------------------------------------------------------------------------

class SpawnerClient:
    """One per host backend; started on first use from the event loop's thread."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._next = 0
        self._calls: dict[int, asyncio.Future] = {}
        self._exits: dict[int, asyncio.Future] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # No preexec_fn: this Popen stays a cheap vfork+exec however large we are.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "miles.sandboxes.spawner", str(theirs.fileno()),
             str(os.getpid())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            close_fds=True)
        theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(ours.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        while self._sock is not None:
            try:
                data = self._sock.recv(MAX_MSG)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._broken("the sandbox spawner process exited")
                return
            msg = self._decoder.decode(data)
            if isinstance(msg, Exited):
                # Spawned always precedes Exited; an unknown pid was forgotten by a cancelled
                # caller.
                fut = self._exits.get(msg.pid)
                if fut is not None and not fut.done():
                    fut.set_result(msg.exit_code)
                continue
            fut = self._calls.pop(msg.req, None)
            if fut is None or fut.done():
                continue
            if isinstance(msg, Spawned):
                self._exits[msg.pid] = self._loop.create_future()
                fut.set_result(msg.pid)
            elif isinstance(msg, Failed):
                fut.set_exception(OSError(f"sandbox spawner could not fork: {msg.error}"))
            else:
                fut.set_result(None)

    def _broken(self, why: str) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for fut in [*self._calls.values(), *self._exits.values()]:
            if not fut.done():
                fut.set_exception(SandboxError(why))
        self._calls.clear()
        self._exits.clear()
        if self._proc is not None:
            self._proc.poll()
            self._proc = None

    async def _call(self, msg_factory, fds: list[int] = ()) -> object:
        if self._sock is None or self._loop is not asyncio.get_running_loop():
            if self._sock is not None:
                self.close()
            self._start()
        self._next += 1
        req = self._next
        fut = self._loop.create_future()
        self._calls[req] = fut
        data = self._encoder.encode(msg_factory(req))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self._sock.sendmsg([data], anc)
                break
            except BlockingIOError:
                await asyncio.sleep(0.001)
        try:
            return await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._calls.pop(req, None)
            raise TimeoutError(f"the sandbox spawner (pid {self._proc.pid if self._proc else '?'}) did "
                               f"not answer {type(msg_factory(req)).__name__} within {CALL_TIMEOUT_S:g} s") from None

    async def spawn(self, argv: list[str], env: dict[str, str], setup: Setup,
                    stdout_w: int, stderr_w: int) -> int:
        return await self._call(lambda req: Spawn(req, argv, env, setup), [stdout_w, stderr_w])

    async def wait(self, pid: int) -> int:
        """The exit code of a spawned pid (negative: killed by that signal)."""
        code = await self._exits[pid]
        self._exits.pop(pid, None)
        return code

    def forget(self, pid: int) -> None:
        self._exits.pop(pid, None)

    async def kill_uid(self, uid: int) -> None:
        await self._call(lambda req: KillUid(req, uid))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._loop.remove_reader(self._sock.fileno())
            except Exception:  # noqa: BLE001 - the loop may be closed already
                pass
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            self._proc.wait(timeout=5)  # it exits on EOF
            self._proc = None


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
