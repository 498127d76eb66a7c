"""Sandboxes: one fresh, isolated, self-expiring sandbox per episode, on any backend.

    base.py        the contract: SandboxSpec, ExecResult, Sandbox, Backend, errors
    registry.py    get_backend(name, **opts) / register_backend(name, "pkg.mod:Class")
    pool.py        SandboxPool: concurrency and creation-rate limits, retries, sweep by label
    harbor.py      Harbor-layout tasks: load, SandboxSpec, run_verifier -> VerifierResult
    local.py       backend "subprocess": chroot + own uid + namespaces + rlimits, per command
    bwrap.py       backend "bwrap": bubblewrap with every namespace unshared
    host.py        what those two share: records, uids, TTL reaper, destroy, sweep
    hostfs.py      their files: roots on tmpfs, symlink-safe transfer, templates, deletion
    spawner.py     the small fork server that starts their commands
    linux.py       the syscalls (unshare, mount, rlimits, setuid) via ctypes
    procs.py       capped output and the backstop kill for one command
    rootfs.py      Dockerfile -> cached root template for the host backends
    dockerfile.py  Dockerfile parser
    docker.py      backend "docker" over docker_api.py (Engine API); baseimage.py: offline base
    cloud.py       shared by daytona.py, e2b.py (backends "e2b" and "agentenv"), modal.py

Nothing heavy is imported here: backends and SDKs load when `get_backend` asks for them.
"""

from miles.sandboxes.base import (Backend, BackendUnavailableError, ExecResult, Sandbox,
                                  SandboxClosedError, SandboxCreateError, SandboxError,
                                  SandboxSpec, SandboxSpecError)
from miles.sandboxes.pool import SandboxPool
from miles.sandboxes.registry import backend_names, get_backend, register_backend

__all__ = [
    "Backend", "BackendUnavailableError", "ExecResult", "Sandbox", "SandboxClosedError",
    "SandboxCreateError", "SandboxError", "SandboxPool", "SandboxSpec", "SandboxSpecError",
    "backend_names", "get_backend", "register_backend",
]
