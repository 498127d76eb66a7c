"""EngineClient against in-process fake servers: exact bodies, parsing, errors and retries."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from aiohttp import web

from miles.engines.client import (EngineClient, EngineRequestError, EngineUnavailable, SamplingParams,
                                  decode_routed_experts, parse_weight_version)
from miles.engines.procs import free_port
from miles.wire.messages import VersionSpan

SGLANG_RESPONSE = {
    "text": "ab", "output_ids": [11, 18],
    "meta_info": {
        "id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
        "completion_tokens": 2, "cached_tokens": 1, "weight_version": "7",
        "weight_versions": [{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 2}],
        "num_retractions": 1, "e2e_latency": 0.12,
        "output_token_logprobs": [[-0.51, 11, None], [-0.03, 18, None]],
        "input_token_logprobs": [[None, 1, None], [-3.2, 2, None]],
        "routed_experts": base64.b64encode(np.arange(4 * 2 * 2, dtype="<i4").tobytes()).decode(),
        "dp_rank": 0,
    },
}


class Fake:
    """An aiohttp app whose handler per path is set by the test; records every request."""

    def __init__(self):
        self.calls: list[tuple[str, dict | None, dict]] = []
        self.handlers = {}

    async def handle(self, request: web.Request):
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path, body, dict(request.headers)))
        handler = self.handlers.get(request.path)
        if handler is None:
            return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)
        return await handler(request, body, len([c for c in self.calls if c[0] == request.path]))


@pytest.fixture
async def fake():
    f = Fake()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", f.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    f.url = f"http://127.0.0.1:{port}"
    yield f
    await runner.cleanup()


def reply(obj, status=200):
    async def h(_req, _body, _n):
        return web.json_response(obj, status=status)
    return h


async def test_generate_body_and_parse(fake):
    fake.handlers["/generate"] = reply(SGLANG_RESPONSE)
    async with EngineClient(fake.url, routed_experts_layout=(2, 2)) as c:
        res = await c.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0),
                               return_logprob=True, logprob_start_len=0, return_routed_experts=True,
                               rid="r1", routing_key="session-9")
    path, body, headers = fake.calls[0]
    assert body == {"sampling_params": {"max_new_tokens": 2, "temperature": 0.0}, "input_ids": [1, 2, 3],
                    "rid": "r1", "return_logprob": True, "logprob_start_len": 0,
                    "return_routed_experts": True}
    assert headers["X-SMG-Routing-Key"] == "session-9"
    assert res.output_ids == [11, 18] and res.output_logprobs == [-0.51, -0.03]
    assert res.input_logprobs == [None, -3.2]
    assert res.finish_reason.type == "length" and res.finish_reason.length == 2
    assert res.weight_version == "7" and res.num_retractions == 1 and res.cached_tokens == 1
    assert res.version_spans() == [VersionSpan(6, 0, 1), VersionSpan(7, 1, 2)]
    assert res.routed_experts.shape == (4, 2, 2) and res.routed_experts.dtype == np.int32
    assert res.meta_info["dp_rank"] == 0


async def test_missing_spans_cover_the_whole_output(fake):
    resp = {"text": "", "output_ids": [5, 6, 7], "meta_info": {
        "id": "x", "finish_reason": {"type": "stop", "matched": 7}, "weight_version": "default"}}
    fake.handlers["/generate"] = reply(resp)
    async with EngineClient(fake.url) as c:
        res = await c.generate([1], {"max_new_tokens": 3})
    assert res.version_spans() == [VersionSpan(0, 0, 3)]
    assert res.finish_reason.matched == 7 and res.output_logprobs is None


async def test_sampling_params_are_sglang_names():
    c = EngineClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="sampling_params.max_tokens.*max_new_tokens"):
        c._generate_body([1], None, {"max_tokens": 3}, False, None, 0, False, False, 0, None, None, None)
    with pytest.raises(ValueError, match="exactly one of input_ids / text"):
        c._generate_body(None, None, {}, False, None, 0, False, False, 0, None, None, None)


async def test_4xx_raises_request_error_with_server_message(fake):
    fake.handlers["/generate"] = reply({"error": {"message": "input_ids: token id 999 is out"}}, 400)
    fake.handlers["/update_weights_from_disk"] = reply({"success": False, "message": "no such dir"}, 400)
    fake.handlers["/pause_generation"] = reply({"error": "unknown variant `later`"}, 400)
    async with EngineClient(fake.url) as c:
        with pytest.raises(EngineRequestError) as e:
            await c.generate([999], {"max_new_tokens": 1})
        assert e.value.status == 400 and "token id 999" in e.value.server_message
        with pytest.raises(EngineRequestError, match="no such dir"):
            await c.update_weights_from_disk("/nowhere")
        with pytest.raises(EngineRequestError, match="unknown variant"):
            await c.pause_generation("abort")
    assert len([p for p, *_ in fake.calls if p == "/generate"]) == 1


async def test_5xx_retries_idempotent_calls_but_never_generate(fake):
    async def flaky(_req, _body, n):
        if n < 3:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response({"message": "ok", "status": "ok"})
    fake.handlers["/continue_generation"] = flaky
    fake.handlers["/generate"] = reply({"error": {"message": "overloaded"}}, 503)
    async with EngineClient(fake.url, backoff_s=0.01) as c:
        assert (await c.continue_generation())["status"] == "ok"
        with pytest.raises(EngineUnavailable, match="overloaded"):
            await c.generate([1], {"max_new_tokens": 1})
    assert len([p for p, *_ in fake.calls if p == "/continue_generation"]) == 3
    assert len([p for p, *_ in fake.calls if p == "/generate"]) == 1
    assert fake.calls[0][1] == {}  # SGLang needs a JSON object even when empty


async def test_connection_refused_is_unavailable_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with EngineClient(url, max_retries=2, backoff_s=0.01) as c:
        with pytest.raises(EngineUnavailable, match="after 3 attempt"):
            await c.flush_cache()
        with pytest.raises(EngineUnavailable, match="after 1 attempt"):
            await c.generate([1], {"max_new_tokens": 1})
        assert await c.health() is False


async def test_timeout_is_unavailable(fake):
    import asyncio

    async def slow(_req, _body, _n):
        await asyncio.sleep(2)
        return web.json_response({})
    fake.handlers["/generate"] = slow
    async with EngineClient(fake.url) as c:
        with pytest.raises(EngineUnavailable, match="no answer within 0.2 s"):
            await c.generate([1], {"max_new_tokens": 1}, timeout_s=0.2)


async def test_control_bodies_match_sglang(fake):
    ok = reply({"success": True, "message": "ok", "status": "ok", "new_version": "3"})
    for p in ("/pause_generation", "/update_weight_version", "/update_weights_from_distributed",
              "/init_weights_update_group", "/abort_request", "/update_weights_from_disk"):
        fake.handlers[p] = ok
    async with EngineClient(fake.url) as c:
        await c.pause_generation("retract")
        await c.update_weight_version(3)
        await c.update_weights_from_distributed(["a.weight"], ["torch.bfloat16"], [(2, 3)], weight_version=3)
        await c.init_weights_update_group("127.0.0.1", 29500, 1, 2, backend="gloo")
        await c.abort_request("r9")
        await c.update_weights_from_disk("/ckpt/step3", weight_version=3)
    bodies = {p: b for p, b, _ in fake.calls}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert bodies["/update_weight_version"] == {"new_version": "3", "abort_all_requests": False}
    assert bodies["/update_weights_from_distributed"] == {
        "names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
        "group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
        "weight_version": "3"}
    assert bodies["/init_weights_update_group"] == {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "group_name": "weight_update_group", "backend": "gloo"}
    assert bodies["/abort_request"] == {"rid": "r9"}
    assert bodies["/update_weights_from_disk"]["weight_version"] == "3"
    with pytest.raises(ValueError, match="mode: 'later'"):
        await EngineClient(fake.url).pause_generation("later")


def test_routed_experts_and_versions_helpers():
    arr = np.arange(24, dtype=np.int32)
    out = decode_routed_experts(base64.b64encode(arr.astype("<i4").tobytes()).decode(), (3, 2))
    assert out.shape == (4, 3, 2) and (out.reshape(-1) == arr).all()
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(base64.b64encode(arr[:5].tobytes()).decode(), (3, 2))
    assert parse_weight_version("default") == 0 and parse_weight_version("12") == 12
    with pytest.raises(ValueError, match="weight_version: 'v1-rc'"):
        parse_weight_version("v1-rc")
