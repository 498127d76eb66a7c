"""The few Linux syscalls the host backends need, through ctypes (Python 3.11 has no os.unshare).

Everything here runs in a child forked by the spawner between fork and exec, so it
allocates little, raises OSError with the failing call named, and never returns half-done: if a
step fails the child dies before exec and the parent sees the error.

Design decisions:
- Mount propagation is made private (MS_REC|MS_PRIVATE on /) before any bind mount; without it a
  bind into the sandbox root could propagate back to the host's mount table. A failure there
  aborts the child.
- Read-only bind mounts need a second remount call (the kernel ignores MS_RDONLY on the first).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

# Loaded at import time: dlopen after fork in a threaded parent can deadlock.
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _fail(call: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{call}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        _fail(f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        _fail(f"mount({source!r}, {target!r}, {fstype!r})")


def make_mounts_private() -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def bind(source: str, target: str, *, readonly: bool, recursive: bool = False) -> None:
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if readonly:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """The kernel sends `sig` to this process when the thread that forked it exits."""
    if _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_PDEATHSIG)")


def no_new_privs() -> None:
    """setuid binaries and file capabilities stop granting anything to this process tree."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_NO_NEW_PRIVS)")


def set_limits(*, memory_bytes: int | None, cpu_s: int | None, nproc: int | None,
               fsize_bytes: int | None, nofile: int = 4096) -> None:
    """Hard and soft limits alike, so the sandbox cannot raise them back."""
    pairs = [(resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_s),
             (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize_bytes),
             (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)]
    for which, value in pairs:
        if value is not None:
            resource.setrlimit(which, (value, value))


def drop_to(uid: int, gid: int) -> None:
    """Become an unprivileged uid for good (real, effective and saved ids)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


# The three set-up sequences a spawned command goes through (see spawner.py), as plain functions
# of plain data so the fork server can run them between fork and exec.

SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def enter_jail(root: str, sys_root: str, cwd: str, uid: int, network: bool,
               limits: dict) -> None:
    """subprocess backend as root: namespaces, read-only system binds, chroot(R), limits, uid."""
    die_with_parent()
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    unshare(flags if network else flags | CLONE_NEWNET)
    make_mounts_private()
    for name in SYSTEM_DIRS:
        src, dst = os.path.join(sys_root, name), os.path.join(root, name)
        if os.path.isdir(dst) and not os.path.islink(dst) and os.path.isdir(src):
            bind(src, dst, readonly=True, recursive=(name == "etc"))
    for node in DEV_NODES:
        bind(f"/dev/{node}", os.path.join(root, "dev", node), readonly=False)
    mount("tmpfs", os.path.join(root, "dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV,
          "mode=1777,size=64m")
    mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chroot(root)
    os.chdir(cwd)
    set_limits(**limits)
    no_new_privs()
    drop_to(uid, uid)


def enter_as(uid: int | None, limits: dict, cwd: str | None = None,
             network: bool = True) -> None:
    """bwrap backend, and the subprocess backend without root: limits, then (as root) the
    sandbox uid; without root and network=False, a user+network namespace of our own."""
    die_with_parent()
    if not network:
        unshare(CLONE_NEWUSER | CLONE_NEWNET)
    if cwd is not None:
        os.chdir(cwd)
    set_limits(**limits)
    no_new_privs()
    if uid is not None:
        drop_to(uid, uid)
