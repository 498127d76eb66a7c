"""Shared fixtures for engine tests: free ports, an in-process fake engine, tiny models.

Kept small and stable on purpose: several test files import these names.

- `sglang_wheel` is the released sglang wheel (downloaded once with `pip download --no-deps`
  into the Miles cache, skipped when offline); `.read(member)` returns one of its files. Tests read SGLang's own schema and CLI from it; nothing of it is committed.
- `embedded_engines(n)` starts n real embedded engines (tiny Qwen3, one torch thread each) as
  `ServerProcess`es on free loopback ports; module-scoped, they stop after the module.
- `fake_engine(name, dp_size=1)` starts an aiohttp app on 127.0.0.1 that answers the routes smg
  needs to register a worker (`/health`, `/server_info`, `/model_info`, `/v1/models`) plus
  `/generate` and the control routes, and records every request it receives. It is for testing
  the gateway's own behaviour (routing, registration, fan-out, body forwarding) in
  milliseconds; tests about generation use real embedded engines.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from miles.engines.procs import ServerProcess
from miles.engines.procs import free_port as _free_port
from miles.tiny import build_tiny_model, default_cache_dir

SGLANG_WHEEL_VERSION = "0.5.23"


@pytest.fixture
def free_port():
    """Call to get a free loopback port (distinct within one test)."""
    taken: set[int] = set()

    def pick() -> int:
        while (port := _free_port()) in taken:
            pass
        taken.add(port)
        return port

    return pick


@dataclass
class FakeEngine:
    name: str
    url: str
    requests: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    generate_delay_s: float = 0.0
    failing_paths: set[str] = field(default_factory=set)  # control paths that answer 500

    def calls(self, path: str) -> list[Any]:
        """Bodies of the requests received on `path`."""
        return [body for _, p, _, body in self.requests if p == path]


def _fake_app(engine: FakeEngine, dp_size: int) -> web.Application:
    async def record(request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else None
        engine.requests.append((request.method, request.path, dict(request.headers), body))
        return body

    async def health(_):
        return web.Response(text="ok")

    async def server_info(_):
        return web.json_response({"dp_size": dp_size, "tp_size": 1, "model_path": "fake",
                                  "version": "0.5.23"})

    async def model_info(_):
        return web.json_response({"model_path": "fake", "is_generation": True,
                                  "weight_version": "default"})

    async def models(_):
        return web.json_response({"object": "list", "data": [
            {"id": "fake", "object": "model", "owned_by": "sglang"}]})

    async def generate(request):
        body = await record(request)
        await asyncio.sleep(engine.generate_delay_s)
        return web.json_response({"text": engine.name, "output_ids": [1], "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": 1,
            "weight_version": "default"}})

    async def control(request):
        await record(request)
        if request.path in engine.failing_paths:
            return web.json_response({"success": False, "message": f"{engine.name} failed"},
                                     status=500)
        return web.json_response({"success": True, "status": "ok", "message": engine.name})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/server_info", server_info),
                    web.get("/model_info", model_info), web.get("/v1/models", models),
                    web.post("/generate", generate), web.post("/{path}", control)])
    return app


@pytest.fixture
async def fake_engine():
    """Call `await fake_engine(name, dp_size=1)` to start one; all are stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def start(name: str, dp_size: int = 1) -> FakeEngine:
        port = _free_port()
        engine = FakeEngine(name=name, url=f"http://127.0.0.1:{port}")
        runner = web.AppRunner(_fake_app(engine, dp_size))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return engine

    yield start
    for runner in runners:
        await runner.cleanup()


@dataclass(frozen=True)
class SGLangWheel:
    path: Path
    version: str = SGLANG_WHEEL_VERSION

    def members(self) -> list[str]:
        with zipfile.ZipFile(self.path) as zf:
            return zf.namelist()

    def read(self, member: str) -> str:
        """One file of the wheel, e.g. 'sglang/api/v1/api_types.py'."""
        with zipfile.ZipFile(self.path) as zf:
            return zf.read(member).decode()


@pytest.fixture(scope="session")
def sglang_wheel() -> SGLangWheel:
    cache = default_cache_dir() / "sglang-wheel"
    pattern = f"sglang-{SGLANG_WHEEL_VERSION}-*.whl"
    if not list(cache.glob(pattern)):
        # One fixed platform, so every machine reads the same files (only .py files are used).
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "30",
               "--retries", "2", "--only-binary",
               ":all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
               f"sglang=={SGLANG_WHEEL_VERSION}", "-d", str(cache)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            error = done.stderr.strip().splitlines()[-1:] if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as e:
            error = [repr(e)]
        if error or not list(cache.glob(pattern)):
            pytest.skip(f"sglang=={SGLANG_WHEEL_VERSION} wheel not in {cache} and pip download "
                        f"failed (offline?): {error}")
    return SGLangWheel(sorted(cache.glob(pattern))[-1])


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return build_tiny_model(arch="qwen3")


@dataclass
class Engine:
    url: str
    process: ServerProcess


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded_engines(tiny_qwen3, tmp_path_factory):
    """Call `await embedded_engines(n)` to start n engines in parallel; all stop when the
    module's tests are done (module-scoped: engines take seconds to start on a busy CPU, so a
    test file shares them; tests that need the module's event loop mark themselves with
    `pytest.mark.asyncio(loop_scope="module")`)."""
    started: list[Engine] = []
    log_dir = tmp_path_factory.mktemp("engines")

    async def start(n: int, *extra: str) -> list[Engine]:
        engines = []
        for _ in range(n):
            port = _free_port()
            cmd = [sys.executable, "-m", "miles.engines.embedded", "--model-path", str(tiny_qwen3),
                   "--host", "127.0.0.1", "--port", str(port), "--torch-threads", "1",
                   "--random-seed", "0", "--log-level", "warning", *extra]
            proc = ServerProcess(f"embedded-{port}", cmd, log_path=log_dir / f"engine-{port}.log",
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            engines.append(Engine(f"http://127.0.0.1:{port}", proc.start()))
        started.extend(engines)
        await asyncio.gather(*[e.process.wait_healthy(e.url, timeout_s=120) for e in engines])
        return engines

    yield start
    await asyncio.gather(*[e.process.stop_async(grace_s=5) for e in started])
