"""Fixtures of the agentic-recipe tests: real host sandboxes, and a session server in front of a
scripted engine.

- `host_sandboxes`: `await host_sandboxes(files)` -> a fresh host sandbox (`host_backend_name`:
  "subprocess" unless a test parametrizes it, e.g. with "bwrap") with the files written; all are
  destroyed at teardown, and the test fails if any outlived it.
- `scripted_session`: (engine, session server url): the real TITO session server (in this
  process) in front of an SGLang-shaped `/generate` that answers with queued texts, so a harness
  test can send exact tool calls (`<tool_call>` blocks parsed by the qwen3 family) that no random
  model produces on cue.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import pytest_asyncio

from tests.scripted_engine import scripted_session_server


@pytest.fixture
def host_backend_name() -> str:
    return "subprocess"


@pytest_asyncio.fixture
async def host_sandboxes(host_backend_name):
    from miles.sandboxes import SandboxSpec, get_backend
    from miles.sandboxes.hostfs import default_base_dir

    # Not pytest's tmp_path: its parents are 0700 and sandboxes run under their own uid.
    base = tempfile.mkdtemp(prefix="miles-agentic-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend(host_backend_name, base_dir=base)
    made = []

    async def make(files: dict[str, str] | None = None):
        sandbox = await backend.create(SandboxSpec(labels={"miles.test": "agentic"}, ttl_s=600))
        made.append(sandbox)
        if files:
            await sandbox.upload_dir(sandbox.workdir, {k: v.encode() for k, v in files.items()})
        return sandbox

    try:
        yield make
    finally:
        for sandbox in made:
            await sandbox.destroy()
        left = await backend.sweep({"miles.test": "agentic"})
        backend.spawner.close()
        shutil.rmtree(base, ignore_errors=True)
        assert left == 0, f"{left} sandboxes outlived their test"


@pytest_asyncio.fixture
async def scripted_session():
    """(scripted engine, session server url), both in this process on real sockets."""
    async with scripted_session_server() as pair:
        yield pair
