"""End to end on CPU: session server process -> smg -> two embedded engines (tiny Qwen3-MoE, R3 on).

A recording proxy sits between smg and each engine, so the tests can compare what the engines
received and produced with what the session server collected, and see which engine served each
turn. The stack is started once per module (engines take a few seconds to load).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import sys
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from miles.engines.gateway import GatewayConfig, launch_gateway
from miles.engines.procs import ServerProcess, free_port
from miles.envs.agent import run_agent_group
from miles.tito.client import SessionServerClient

pytestmark = pytest.mark.asyncio(loop_scope="module")


class RecordingProxy:
    """Forwards everything to one engine; records each /generate body, answer and routing header."""

    def __init__(self, name: str, engine_url: str):
        self.name, self.engine_url = name, engine_url
        self.generates: list[tuple[dict, dict]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        async with self.http.request(request.method, self.engine_url + request.path_qs, data=body or None,
                                     headers={"Content-Type": "application/json"} if body else None) as r:
            raw = await r.read()
            if request.path == "/generate" and r.status == 200:
                import json
                self.generates.append((json.loads(body), json.loads(raw)))
            return web.Response(body=raw, status=r.status, content_type=r.content_type)

    async def start(self) -> None:
        self.http = aiohttp.ClientSession()
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.http.close()

    def for_session(self, session_id: str) -> list[tuple[dict, dict]]:
        return [g for g in self.generates if g[0]["rid"].startswith(f"tito-{session_id}-")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    from miles.engines.embedded import launch_embedded_engine
    from miles.tiny import build_tiny_model
    model = build_tiny_model(arch="qwen3_moe")
    logs = tmp_path_factory.mktemp("e2e-logs")
    engines = await asyncio.gather(*(launch_embedded_engine(
        model, extra_args=["--enable-return-routed-experts", "--torch-threads", "1", "--random-seed", str(i)],
        log_path=logs / f"engine{i}.log") for i in range(2)))
    proxies = [RecordingProxy(f"engine{i}", e.url) for i, e in enumerate(engines)]
    for p in proxies:
        await p.start()
    gateway = await launch_gateway(GatewayConfig(port=free_port(), prometheus_port=free_port()),
                                   [p.url for p in proxies], log_path=logs / "smg.log")
    port = free_port()
    server = ServerProcess("tito", [sys.executable, "-m", "miles.tito.server", "--engine-url", gateway.url,
                                    "--model-path", str(model), "--family", "qwen3", "--port", str(port)],
                           log_path=logs / "tito.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        await server.wait_healthy(url, timeout_s=60)
        async with aiohttp.ClientSession() as http:
            yield url, proxies, http
    finally:
        await asyncio.gather(server.stop_async(grace_s=5), gateway.stop_async(grace_s=5),
                             *(e.stop_async(grace_s=5) for e in engines))
        for p in proxies:
            await p.stop()


TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a command.",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def results_for(message: dict, text: str) -> list[dict]:
    """A tool result per call of `message`, or a user turn when it made none: the server refuses tool
    results that answer nothing (issue 16 item 8), and a random tiny model rarely calls a tool."""
    calls = message.get("tool_calls") or []
    if not calls:
        return [{"role": "user", "content": text}]
    return [{"role": "tool", "tool_call_id": c["id"], "content": text} for c in calls]


def routed(answer: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), "<i4").reshape(-1, 2, 2)


async def test_twenty_tool_turns_are_exactly_what_the_engine_saw_and_made(stack):
    url, proxies, http = stack
    async with http.post(f"{url}/sessions", json={"rollout_id": "task-20"}) as r:
        s = await r.json()
    msgs = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "List the files."}]
    for t in range(20):
        async with http.post(s["openai_base_url"] + "/chat/completions",
                             json={"messages": msgs, "tools": TOOLS, "max_tokens": 10, "temperature": 1.0,
                                   "return_routed_experts": True}) as r:
            answer = await r.json()
            assert r.status == 200, answer
        msgs.append(answer["choices"][0]["message"])
        msgs += results_for(msgs[-1], f"file_{t}.txt")
        if t % 3 == 2:   # appended role sets {tool} and {tool, user}
            msgs.append({"role": "user", "content": "Continue."})

    served = [p for p in proxies if p.for_session(s["session_id"])]
    assert len(served) == 1, "all turns of a session must hit one engine"
    turns = served[0].for_session(s["session_id"])
    assert len(turns) == 20
    for (req, ans), (nxt, _) in zip(turns, turns[1:]):
        prefix = req["input_ids"] + ans["output_ids"]
        assert nxt["input_ids"][:len(prefix)] == prefix

    async with SessionServerClient(url) as client:
        [sample] = await client.collect(s["session_id"], return_routed_experts=True)
    last_req, last_ans = turns[-1]
    assert sample.tokens.tolist() == last_req["input_ids"] + last_ans["output_ids"]
    mask = np.zeros(len(sample.tokens), np.uint8)
    logprobs = np.zeros(len(sample.tokens), np.float32)
    for req, ans in turns:
        n, out = len(req["input_ids"]), ans["output_ids"]
        mask[n:n + len(out)] = 1
        logprobs[n:n + len(out)] = [e[0] for e in ans["meta_info"]["output_token_logprobs"]]
        start = req.get("routed_experts_start_len", 0)
        rows = routed(ans)
        assert np.array_equal(sample.routed_experts[start:start + len(rows)], rows)
    assert sample.prompt_length == len(turns[0][0]["input_ids"])
    assert sample.loss_mask.tolist() == mask[sample.prompt_length:].tolist()
    assert np.array_equal(sample.rollout_logprobs, logprobs[sample.prompt_length:])
    assert sample.routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
    assert sample.rollout_id == "task-20" and sample.metadata["turns"] == 20


async def test_64_sessions_progress_without_blocking_each_other(stack):
    url, proxies, http = stack
    chat_body = {"max_tokens": 6, "temperature": 1.0}

    async def run(i: int, max_tokens: int, ignore_eos: bool = False) -> tuple[str, float]:
        async with http.post(f"{url}/sessions", json={}) as r:
            s = await r.json()
        msgs = [{"role": "user", "content": f"session {i}: count"}]
        for _ in range(2):
            async with http.post(s["openai_base_url"] + "/chat/completions",
                                 json={**chat_body, "messages": msgs, "max_tokens": max_tokens,
                                       "ignore_eos": ignore_eos,
                                       # a forced length: the turn's stop token must not end it early
                                       "min_tokens": max_tokens if ignore_eos else 0}) as r:
                assert r.status == 200, await r.text()
                msgs += [(await r.json())["choices"][0]["message"], {"role": "user", "content": "more"}]
        return s["session_id"], time.monotonic()

    t0 = time.monotonic()
    slow = asyncio.create_task(run(-1, 400, ignore_eos=True))          # a long generation must not hold the others up
    await asyncio.sleep(0.2)
    results = await asyncio.gather(*(run(i, 6) for i in range(64)))
    fast_done = max(t for _, t in results)
    slow_id, slow_done = await slow
    assert fast_done < slow_done, (fast_done - t0, slow_done - t0)
    stats = await (await http.get(f"{url}/stats")).json()
    assert stats["inflight_max"] >= 16
    engines_used = collections.Counter()
    for sid, _ in results:
        owners = [p.name for p in proxies if p.for_session(sid)]
        assert len(owners) == 1                       # sticky
        engines_used[owners[0]] += 1
    assert len(engines_used) == 2                     # new sessions spread over both engines
    print(f"64 sessions x 2 turns in {fast_done - t0:.1f} s; per engine {dict(engines_used)}")


async def test_agent_group_runs_a_user_agent_loaded_by_import_path(stack):
    url, _, _ = stack
    task = {"id": "add-40-2", "question": "What is 40 + 2?", "answer": "42", "turns": 3, "subagent": True}
    samples = await run_agent_group("user_agent:agent", task, 3, url)
    # per run: the retried first turn is dropped, the main trajectory and the subagent are kept
    assert len(samples) == 6
    assert [s.index for s in samples] == list(range(6))
    assert {s.group_id for s in samples} == {"add-40-2"}
    by_run = collections.defaultdict(list)
    for s in samples:
        by_run[s.rollout_id].append(s)
    assert sorted(by_run) == ["add-40-2/0", "add-40-2/1", "add-40-2/2"]
    for run in by_run.values():
        assert sorted(s.metadata["turns"] for s in run) == [1, 3]
        assert len({s.metadata["session_id"] for s in run}) == 1
    for s in samples:
        s.validate()
        assert s.reward in (0.0, 1.0) and "final_answer" in s.metadata["agent"]
        assert s.status in ("completed", "truncated") and s.loss_mask.sum() > 0
        assert np.all(s.rollout_logprobs[s.loss_mask == 0] == 0)
    # an agent that fails is recorded, never lost: here its first request is refused (bad max_tokens)
    [failed] = await run_agent_group("user_agent:agent", {"question": "x", "answer": "1", "max_tokens": "bad"},
                                     1, url, group_id="broken")
    assert failed.status == "failed" and len(failed.tokens) == 0 and failed.rollout_id == "broken/0"
    assert "max_tokens: expected an integer" in failed.metadata["agent_error"]


async def test_llama3_family_session_against_a_real_engine(llama_model_dir, tmp_path):
    """A second family end to end: Llama 3 headers, empty bridge after <|eot_id|>, token-exact."""
    from miles.engines.embedded import launch_embedded_engine
    engine = await launch_embedded_engine(llama_model_dir, extra_args=["--torch-threads", "1"],
                                          log_path=tmp_path / "engine.log")
    proxy = RecordingProxy("llama", engine.url)
    await proxy.start()
    port = free_port()
    server = ServerProcess("tito-llama", [sys.executable, "-m", "miles.tito.server", "--engine-url", proxy.url,
                                          "--model-path", str(llama_model_dir), "--family", "llama3",
                                          "--port", str(port)], log_path=tmp_path / "tito.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        await server.wait_healthy(url, timeout_s=60)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/sessions", json={}) as r:
                s = await r.json()
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
            headers = []   # the role header each appended turn starts with
            for t in range(5):
                async with http.post(s["openai_base_url"] + "/chat/completions",
                                     json={"messages": msgs, "tools": TOOLS, "max_tokens": 8}) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                msgs.append(answer["choices"][0]["message"])
                msgs += results_for(msgs[-1], f"out {t}")
                headers.append("ipython" if msgs[-1]["role"] == "tool" else "user")
        from miles.tito.tokenizer import load_tokenizer
        tok = load_tokenizer(str(llama_model_dir))
        turns = proxy.for_session(s["session_id"])
        assert tok.decode(turns[0][0]["input_ids"][:1]) == "<|begin_of_text|>"
        for (req, ans), (nxt, _), role in zip(turns, turns[1:], headers):
            prefix = req["input_ids"] + ans["output_ids"]
            assert nxt["input_ids"][:len(prefix)] == prefix
            appended = tok.decode(nxt["input_ids"][len(prefix):])
            # A turn that ended on <|eot_id|> or <|eom_id|> needs no bridge; any other ending (a
            # length cut, <|end_of_text|>) is closed by the bridge's <|eot_id|> first.
            if tok.decode(ans["output_ids"][-1:]) in ("<|eot_id|>", "<|eom_id|>"):
                assert appended.startswith(f"<|start_header_id|>{role}<|end_header_id|>")
            else:
                assert appended.startswith(f"<|eot_id|><|start_header_id|>{role}")
        async with SessionServerClient(url) as client:
            [sample] = await client.collect(s["session_id"])
        assert sample.tokens.tolist() == turns[-1][0]["input_ids"] + turns[-1][1]["output_ids"]
        assert int(sample.loss_mask.sum()) == sum(len(a["output_ids"]) for _, a in turns)
    finally:
        await asyncio.gather(server.stop_async(grace_s=5), engine.stop_async(grace_s=5))
        await proxy.stop()
