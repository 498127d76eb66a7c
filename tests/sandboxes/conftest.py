"""Fixtures for the sandbox tests: real host backends in a throw-away base directory and a loopback
server. Helpers shared by the test files live in sandbox_helpers.py (a unique module name: test
directories here have no __init__.py)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading

import pytest

# The helper modules beside this file (sandbox_helpers, the provider stand-ins) are imported by
# plain name, which pytest's importlib import mode does not arrange by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from miles.sandboxes.hostfs import default_base_dir  # noqa: E402
from sandbox_helpers import HOST_BACKENDS, make_host_backend  # noqa: E402


@pytest.fixture
def base_dir():
    # Not pytest's tmp_path: its parents are 0700, and sandboxes run under their own uid. Beside
    # the default base dir, so the tests see the same filesystem (tmpfs where there is one).
    path = tempfile.mkdtemp(prefix="miles-sbx-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=HOST_BACKENDS)
def host_backend(request, base_dir):
    backend = make_host_backend(request.param, base_dir)
    yield backend
    backend.spawner.close()


@pytest.fixture
def loopback_server():
    """A TCP server on 127.0.0.1 that accepts and closes; yields its port."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join(timeout=2)
    srv.close()
