"""Helpers shared by the sandbox tests: backend construction with a skip reason, and counters for
what a sandbox could leave behind (directories, processes, reapers)."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from miles.sandboxes.base import BackendUnavailableError
from miles.sandboxes.host import DEFAULT_UID_RANGE

HOST_BACKENDS = ["subprocess", "bwrap"]


def make_host_backend(name: str, base_dir: str, **opts):
    from miles.sandboxes.registry import get_backend
    try:
        return get_backend(name, base_dir=base_dir, **opts)
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} unavailable here: {exc}")


def needs_jail(backend) -> None:
    """Skip where the backend cannot present absolute sandbox paths or separate episodes: the
    subprocess backend without root has no chroot and runs every sandbox as the caller's uid."""
    if backend.name == "subprocess" and not backend.privileged:
        pytest.skip("subprocess backend without root: no chroot, paths map under $SANDBOX_ROOT "
                    "and episodes share the caller's uid (use bwrap for isolation without root)")


def sandbox_processes(base_dir: str | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes running under a sandbox uid, plus reapers of `base_dir`."""
    lo, hi = DEFAULT_UID_RANGE
    found = []
    for proc in psutil.process_iter(["uids", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            in_range = lo <= proc.info["uids"].real < hi
            reaper = base_dir is not None and any(base_dir in part
                                                  for part in proc.info["cmdline"] or [])
            if in_range or reaper:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def processes_of_uid(uid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["uids"].real == uid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def leftover_entries(base_dir: str) -> list[str]:
    return sorted(e for e in os.listdir(base_dir) if e != "templates")


async def wait_until(predicate, timeout_s: float = 5.0, step_s: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return predicate()
