"""Two real embedded engines (tiny Qwen3, CPU) behind the real smg gateway, on 127.0.0.1.

Shows: concurrent load completes; a routing key always lands on one engine; a SIGKILLed engine
fails its requests fast and leaves routing while the other keeps serving; a paused engine is
not dropped from routing; control calls reach every engine directly and through the fan-out.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
import pytest_asyncio

from miles.engines.client import EngineClient, EngineUnavailable
from miles.engines.gateway import (ROUTED_WORKER_HEADER, ROUTING_KEY_HEADER, GatewayConfig,
                                   launch_gateway)
from miles.engines.procs import free_port

# One event loop for the module, so the engines started once can serve every test.
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _launch_fleet(embedded_engines):
    engines = await embedded_engines(2)
    config = GatewayConfig(port=free_port(), prometheus_port=free_port())
    return await launch_gateway(config, [e.url for e in engines], timeout_s=60), engines


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(embedded_engines):
    """(gateway, [engine A, engine B]) with smg in front of both, shared by the tests that
    leave both engines running."""
    gateway, engines = await _launch_fleet(embedded_engines)
    yield gateway, engines
    await gateway.stop_async()


async def _owned_by(session, gateway, engine, prefix):
    """A routing key that the gateway pins to `engine`."""
    for i in range(64):
        key = f"{prefix}{i}"
        if (await _generate(session, gateway.url, key=key, max_new_tokens=1))[1] == engine.url:
            return key
    raise AssertionError(f"no key of 64 was assigned to {engine.url}")


async def _generate(session, url, *, key=None, prompt_len=4, max_new_tokens=4, timeout_s=60):
    headers = {ROUTING_KEY_HEADER: key} if key else {}
    body = {"input_ids": [random.randrange(10, 400) for _ in range(prompt_len)],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                "ignore_eos": True},
            "return_logprob": True}
    async with session.post(url + "/generate", json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, resp.headers.get(ROUTED_WORKER_HEADER), await resp.json(
            content_type=None)


async def test_64_concurrent_requests_of_varied_lengths_complete(fleet):
    gateway, engines = fleet
    rng = random.Random(0)
    shapes = [(rng.randint(1, 48), rng.randint(1, 16)) for _ in range(64)]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[
            _generate(session, gateway.url, key=f"session-{i}", prompt_len=p, max_new_tokens=n)
            for i, (p, n) in enumerate(shapes)])
    for (status, _, out), (prompt_len, max_new_tokens) in zip(results, shapes):
        assert status == 200, out
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == max_new_tokens == meta["completion_tokens"]
        assert meta["prompt_tokens"] == prompt_len
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    served = {worker for _, worker, _ in results}
    assert served == {e.url for e in engines}, "new sessions should spread over both engines"


async def test_a_routing_key_always_lands_on_the_same_engine(fleet):
    gateway, engines = fleet
    keys = [f"conversation-{i}" for i in range(16)]
    async with aiohttp.ClientSession() as session:
        first = await asyncio.gather(*[_generate(session, gateway.url, key=k) for k in keys])
        owner = {k: worker for k, (_, worker, _) in zip(keys, first)}
        for turn in range(3):
            # Later turns grow the prompt, as a multi-turn session does; order is shuffled.
            order = random.Random(turn).sample(keys, len(keys))
            again = await asyncio.gather(*[
                _generate(session, gateway.url, key=k, prompt_len=8 * (turn + 2)) for k in order])
            assert {k: worker for k, (_, worker, _) in zip(order, again)} == owner
    assert set(owner.values()) == {e.url for e in engines}


async def test_killed_engine_fails_fast_and_leaves_routing(embedded_engines):
    gateway, (a, b) = await _launch_fleet(embedded_engines)  # its own: this test kills one
    try:
        await _kill_one_of_two(gateway, a, b)
    finally:
        await gateway.stop_async()
        await b.process.stop_async(grace_s=5)


async def _kill_one_of_two(gateway, a, b):
    keys = [f"k{i}" for i in range(12)]
    done_at: dict[str, float] = {}

    async def timed(session, client, key):
        if owner[key] == a.url:  # through the real client: what the rollout worker sees
            try:
                # Far more tokens than fit before the kill, however fast the machine is.
                result = await client.generate([5, 6, 7], {"max_new_tokens": 3000,
                                                           "ignore_eos": True}, routing_key=key)
            except EngineUnavailable as e:
                result = e
        else:
            result = await _generate(session, gateway.url, key=key, max_new_tokens=200,
                                     timeout_s=120)
        done_at[key] = time.monotonic()
        return result

    async with aiohttp.ClientSession() as session, EngineClient(
            gateway.url, generate_timeout_s=120) as client:
        owner = {k: w for k, (_, w, _) in zip(keys, await asyncio.gather(*[
            _generate(session, gateway.url, key=k, max_new_tokens=1) for k in keys]))}
        on_a = [k for k in keys if owner[k] == a.url]
        on_b = [k for k in keys if owner[k] == b.url]
        assert on_a and on_b

        # Generations on both engines, then SIGKILL engine A while its requests run.
        running = {k: asyncio.create_task(timed(session, client, k)) for k in keys}
        await asyncio.sleep(1.0)
        assert not any(running[k].done() for k in on_a), "A's generations should be running"
        a.process.kill()
        killed_at = time.monotonic()
        results = dict(zip(keys, await asyncio.gather(*running.values())))

        for k in on_a:
            error = results[k]
            assert isinstance(error, EngineUnavailable), f"{k} on the dead engine: {error!r}"
            assert a.url in str(error), f"the error should name the dead engine: {error}"
            assert done_at[k] - killed_at < 5, "a request on a dead engine must fail fast"
        for k in on_b:
            status, worker, out = results[k]
            assert status == 200 and worker == b.url, out
            assert len(out["output_ids"]) == 200

        # smg's health check (every 2 s, two failures) drops A without anybody calling it.
        deadline = killed_at + 15
        while any(w["url"] == a.url and w["is_healthy"] for w in await gateway.workers()):
            assert time.monotonic() < deadline, "the gateway still thinks the dead engine is up"
            await asyncio.sleep(0.2)
        # Sessions pinned to A move to B; B keeps serving everything.
        after = await asyncio.gather(*[_generate(session, gateway.url, key=k) for k in keys])
        assert all(status == 200 and worker == b.url for status, worker, _ in after)

        # Removing it explicitly (what the node supervisor does) also works on a dead engine.
        await gateway.remove_worker(a.url)
        assert gateway.engine_urls == [b.url]


async def test_paused_engine_stays_routable_and_resumes(fleet):
    """Control calls go to one engine directly; smg must not drop a paused engine, or every
    weight update would turn into 503s instead of requests that wait."""
    gateway, (a, b) = fleet
    async with aiohttp.ClientSession() as session:
        key = await _owned_by(session, gateway, a, "p")
        async with session.post(a.url + "/pause_generation", json={"mode": "in_place"}) as resp:
            assert resp.status == 200, await resp.text()
        waiting = asyncio.create_task(_generate(session, gateway.url, key=key, max_new_tokens=4))
        await asyncio.sleep(5)  # more than two health-check periods
        assert not waiting.done(), "a request to a paused engine should wait, not fail"
        assert all(w["is_healthy"] for w in await gateway.workers())
        async with session.post(a.url + "/continue_generation", json={}) as resp:
            assert resp.status == 200
        status, worker, out = await asyncio.wait_for(waiting, timeout=30)
        assert status == 200 and worker == a.url and len(out["output_ids"]) == 4


async def test_control_fanout_reaches_every_engine(fleet):
    gateway, engines = fleet
    result = await gateway.fanout("update_weight_version", {"new_version": "7",
                                                            "abort_all_requests": False})
    assert result["succeeded"] == 2
    async with aiohttp.ClientSession() as session:
        for engine in engines:
            async with session.get(engine.url + "/model_info") as resp:
                assert (await resp.json())["weight_version"] == "7"
        _, _, out = await _generate(session, gateway.url, key="v")
        assert out["meta_info"]["weight_version"] == "7"
    await gateway.fanout("pause_generation", {"mode": "retract"})
    await gateway.fanout("continue_generation")
