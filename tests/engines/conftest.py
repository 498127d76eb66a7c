"""Shared fixtures for engine tests: free ports, an in-process fake engine, tiny models.

Kept small and stable on purpose: several test files import these names.

- `fake_engine(name, dp_size=1)` starts an aiohttp app on 127.0.0.1 that answers the routes smg
  needs to register a worker (`/health`, `/server_info`, `/model_info`, `/v1/models`) plus
  `/generate` and the control routes, and records every request it receives. It is for testing
  the gateway's own behaviour (routing, registration, fan-out, body forwarding) in
  milliseconds; tests about generation use real embedded engines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from miles.engines.procs import free_port as _free_port


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
