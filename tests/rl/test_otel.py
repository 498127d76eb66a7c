"""OpenTelemetry export (issue 40, item 2): spans arrive on a real OTLP/HTTP endpoint on loopback
(an aiohttp server of the test's), decoded with opentelemetry-proto; off means not imported."""

import asyncio
import subprocess
import sys

import pytest
from aiohttp import web

from miles.config import load_recipe
from miles.rl.otel import NOOP, telemetry
from tests.rl.test_buffer_journal import ROOT
from tests.rl.test_provenance import stamped

# the otel extra is part of dev: CI has it (no skip when it is missing: an ImportError)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402


@pytest.fixture
async def collector():
    """A minimal OTLP/HTTP trace receiver: protobuf ExportTraceServiceRequest on /v1/traces."""
    spans, resources = [], []

    async def traces(request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", spans, resources
    await runner.cleanup()


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def agent_sample():
    s = stamped(reward={"correct": 1.0, "format": 0.5}, sandbox_id="sb-1", session_id="sess-1")
    s.metadata["agent"] = {"messages": [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "assistant", "content": "a.txt"}]}
    return s


async def test_spans_reach_a_loopback_otlp_endpoint_with_miles_attributes(collector):
    url, spans, resources = collector
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", overrides=[f'logging.otel="{url}"'])
    t = telemetry(recipe, "rollout")
    s = agent_sample()
    t.episode(s)
    step = t.span("miles.step", 10.0, 12.0, {"miles.step": 3, "miles.step.sample_ids": [f"{s.rollout_id}/{s.index}"]})
    t.span("miles.weights.publish", 11.5, 11.9, {"miles.policy_version": 4}, parent=step)
    await asyncio.to_thread(t.close)                # flushes the batch processor
    by_name: dict[str, list] = {}
    for sp in spans:
        by_name.setdefault(sp.name, []).append(sp)
    assert sorted(by_name) == ["miles.episode", "miles.step", "miles.tool_call", "miles.turn",
                               "miles.weights.publish"]
    [episode] = by_name["miles.episode"]
    a = attrs(episode)
    assert a["miles.sample.id"] == f"{s.rollout_id}/{s.index}"
    assert (a["miles.policy_version"], a["miles.engine.id"], a["miles.engine.incarnation"]) == \
        (3, "127.0.0.1:30001", 4242)
    assert (a["miles.sandbox.id"], a["miles.session.id"], a["miles.verifier.name"]) == \
        ("sb-1", "sess-1", "first_answer")
    assert a["miles.reward.correct"] == 1.0 and a["miles.sampling.temperature"] == 1.0
    assert all(k.startswith("miles.") for sp in spans for k in attrs(sp))
    assert episode.start_time_unix_nano == int(100.0 * 1e9)   # the provenance's queued time
    turns = by_name["miles.turn"]
    assert [attrs(x)["miles.turn.role"] for x in turns] == ["user", "assistant", "tool", "assistant"]
    assert all(x.parent_span_id == episode.span_id and x.trace_id == episode.trace_id for x in turns)
    [call] = by_name["miles.tool_call"]
    assert attrs(call)["miles.tool.name"] == "bash" and call.parent_span_id == turns[1].span_id
    [publish] = by_name["miles.weights.publish"]
    assert publish.parent_span_id == by_name["miles.step"][0].span_id
    assert attrs(by_name["miles.step"][0])["miles.step.sample_ids"] == [a["miles.sample.id"]]
    assert resources[0]["service.name"] == "miles.rollout"


async def test_a_sample_rate_of_zero_exports_nothing(collector):
    url, spans, _ = collector
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml",
                         overrides=[f'logging.otel="{url}"', "logging.otel_sample_rate=0.0"])
    t = telemetry(recipe, "rollout")
    for _ in range(20):
        t.episode(agent_sample())
    await asyncio.to_thread(t.close)
    assert spans == []


def test_off_returns_the_noop_and_never_imports_opentelemetry():
    assert telemetry(load_recipe(ROOT / "recipes" / "quickstart.toml"), "driver") is NOOP
    code = ("import sys; from miles.config import load_recipe; import miles.loop, miles.actors.rollout; "
            "from miles.rl.otel import telemetry; from miles.rl.provenance import Stamper; "
            f"telemetry(load_recipe({str(ROOT / 'recipes' / 'quickstart.toml')!r}), 'driver'); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
