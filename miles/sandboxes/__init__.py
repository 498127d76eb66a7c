"""Sandboxes: one contract (`base.py`), local backends that isolate for real (`local.py` =
subprocess, `bwrap.py`, `docker.py`), cloud backends (`daytona.py`, `e2b.py` incl. AgentENV,
`modal.py`), a pool with concurrency/rate limits and sweeping (`pool.py`), and Harbor-layout tasks
(`harbor.py`). Backends are picked by name with `get_backend`; nothing heavy is imported here.
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
