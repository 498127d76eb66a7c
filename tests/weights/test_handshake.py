"""Joining the weight-update group fails fast and says why: an engine that is not there, one that
refuses, one that says yes but never joins (the torch-side timeout, seconds, not a watchdog)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from miles.weights import WeightsConfig, make_transport
from weights_helpers import free_port


@pytest.fixture
async def fake_engine():
    """An HTTP engine whose /init_weights_update_group answers `reply` and never joins the group."""
    runners = []

    async def start(reply: dict, status: int = 200) -> str:
        async def server_info(_):
            return web.json_response({"tp_size": 1})

        async def init(_):
            return web.json_response(reply, status=status)

        async def other(_):
            return web.json_response({"success": True, "message": "ok"})

        app = web.Application()
        app.add_routes([web.get("/server_info", server_info),
                        web.post("/init_weights_update_group", init), web.post("/{p}", other)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for r in runners:
        await r.cleanup()


def transport(timeout_s: float = 2.0):
    return make_transport(WeightsConfig(connect_timeout_s=timeout_s, control_timeout_s=2.0,
                                        group_backend="gloo"), rank=0)


async def test_an_engine_that_is_not_there_fails_at_once():
    url = f"http://127.0.0.1:{free_port()}"
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"server_info .*engine {url} failed"):
        await asyncio.to_thread(transport().connect, [url])
    assert time.perf_counter() - t < 5


async def test_an_engine_that_refuses_is_named_with_its_reason(fake_engine):
    url = await fake_engine({"success": False, "message": "backend: 'nccl' needs an engine on CUDA"})
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"engine {url} refused to join: backend: 'nccl' needs"):
        await asyncio.to_thread(transport(timeout_s=20).connect, [url])
    assert time.perf_counter() - t < 5  # not the 20 s rendezvous timeout


async def test_an_engine_that_never_joins_times_out_in_seconds(fake_engine):
    url = await fake_engine({"success": True, "message": "ok"})
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"not every engine joined within 2.0 s"):
        await asyncio.to_thread(transport(timeout_s=2.0).connect, [url])
    assert time.perf_counter() - t < 8
