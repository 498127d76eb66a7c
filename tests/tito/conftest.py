"""Fixtures for the TITO tests: tokenizers built offline, a scripted SGLang-shaped engine, a server.

- `scripted_engine` answers SGLang's `/generate` with replies the test queues (text tokenized with
  the model's tokenizer, plus the end-of-turn token), deterministic logprobs, weight-version spans
  and routed experts; it records every request. It exists to drive exact tool-call and reasoning
  paths, which a random tiny model never produces; generation itself is tested against real
  embedded engines in test_e2e.py.
- `tito_server(engine_url, **config)` starts a `SessionServer` in this process on a free port.
"""

from __future__ import annotations

import asyncio
import base64
import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from miles.engines.procs import free_port
from miles.tito.families.llama3 import LLAMA3_SPECIAL_TOKENS
from miles.tito.tokenizer import ChatTokenizer, load_tokenizer

ROUTED_LAYOUT = (2, 2)   # layers, top_k of the scripted engine's routed experts


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    from miles.tiny import build_tokenizer
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir) -> ChatTokenizer:
    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def qwen_tokenizer() -> ChatTokenizer:
    return load_tokenizer("qwen")


@pytest.fixture(scope="session")
def llama_tokenizer_path(tmp_path_factory) -> Path:
    """A small byte-level BPE with the Llama 3 header tokens (Meta's vocabulary is not offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from miles.tiny import _corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=LLAMA3_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(2000, 1), trainer=trainer)
    path = tmp_path_factory.mktemp("llama3-tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def llama_model_dir(llama_tokenizer_path, tmp_path_factory) -> Path:
    """A tiny random model whose vocabulary has the Llama 3 header tokens (for a llama3 engine session)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from miles.tiny import build_tiny_model
    tok_dir = tmp_path_factory.mktemp("llama3-tok-dir")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(llama_tokenizer_path)), eos_token="<|eot_id|>",
                            pad_token="<|end_of_text|>", bos_token="<|begin_of_text|>").save_pretrained(tok_dir)
    return build_tiny_model(tmp_path_factory.mktemp("llama3-model") / "model", arch="qwen3", tokenizer_dir=tok_dir)


@dataclass
class ScriptedEngine:
    tokenizer: ChatTokenizer
    end_token: str = "<|im_end|>"
    url: str = ""
    replies: collections.deque = field(default_factory=collections.deque)
    default_reply: str = "ok"
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    weight_version: str = "3"
    delay_s: float = 0.0
    fail_status: int | None = None

    def reply(self, *texts: str) -> None:
        self.replies.extend(texts)


def _scripted_app(engine: ScriptedEngine) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        engine.requests.append(body)
        engine.headers.append(dict(request.headers))
        if engine.delay_s:
            await asyncio.sleep(engine.delay_s)
        if engine.fail_status:
            return web.json_response({"error": {"message": "scripted failure"}}, status=engine.fail_status)
        text = engine.replies.popleft() if engine.replies else engine.default_reply
        params = body.get("sampling_params", {})
        ids = engine.tokenizer.encode(text) + [engine.tokenizer.token_id(engine.end_token)]
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1]}
        limit = params.get("max_new_tokens", 128)
        if len(ids) > limit:
            ids, finish = ids[:limit], {"type": "length", "length": limit}
        meta: dict[str, Any] = {
            "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "weight_version": engine.weight_version,
            "output_token_logprobs": [[-0.001 * (len(engine.requests) * 100 + i), t, None] for i, t in enumerate(ids)]}
        if body.get("return_routed_experts"):
            start = body.get("routed_experts_start_len", 0)
            rows = len(body["input_ids"]) + len(ids) - 1 - start
            positions = np.arange(start, start + rows, dtype=np.int32)
            arr = np.stack([positions * 10 + j for j in range(ROUTED_LAYOUT[0] * ROUTED_LAYOUT[1])], axis=1)
            meta["routed_experts"] = base64.b64encode(arr.astype("<i4").tobytes()).decode()
        out = {"text": engine.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}
        engine.responses.append(out)
        return web.json_response(out)

    async def model_info(_):
        return web.json_response({"model_path": "scripted", "weight_version": engine.weight_version,
                                  "num_hidden_layers": ROUTED_LAYOUT[0], "num_experts_per_tok": ROUTED_LAYOUT[1]})

    async def health(_):
        return web.Response(text="ok")

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.add_routes([web.post("/generate", generate), web.get("/model_info", model_info),
                    web.get("/health", health)])
    return app


@pytest.fixture
async def scripted_engine():
    runners: list[web.AppRunner] = []

    async def start(tokenizer: ChatTokenizer, end_token: str = "<|im_end|>") -> ScriptedEngine:
        engine = ScriptedEngine(tokenizer=tokenizer, end_token=end_token)
        port = free_port()
        runner = web.AppRunner(_scripted_app(engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        engine.url = f"http://127.0.0.1:{port}"
        return engine

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def tito_server():
    """`await tito_server(engine_url, tokenizer=..., family=..., **config)` -> (server, base url)."""
    from miles.tito.server import ServerConfig, SessionServer
    runners: list[web.AppRunner] = []

    async def start(engine_url: str, tokenizer: str, **config: Any):
        server = SessionServer(ServerConfig(engine_url=engine_url, tokenizer=tokenizer, **config))
        port = free_port()
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return server, f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


# -- a shared stack for the SDK tests (tests/tito/test_sdk_*.py) -------------------------------------

class RecordingEngineProxy:
    """Forwards everything to one real engine and records each `/generate` body and answer."""

    def __init__(self, engine_url: str):
        self.engine_url, self.url = engine_url, ""
        self.generates: list[tuple[dict, dict]] = []

    async def _handle(self, request: web.Request) -> web.Response:
        import json
        body = await request.read()
        async with self.http.request(request.method, self.engine_url + request.path_qs, data=body or None,
                                     headers={"Content-Type": "application/json"} if body else None) as r:
            raw = await r.read()
            if request.path == "/generate" and r.status == 200:
                self.generates.append((json.loads(body), json.loads(raw)))
            return web.Response(body=raw, status=r.status, content_type=r.content_type)

    def for_session(self, session_id: str) -> list[tuple[dict, dict]]:
        return [g for g in self.generates if g[0]["rid"].startswith(f"tito-{session_id}-")]

    async def start(self) -> "RecordingEngineProxy":
        import aiohttp
        self.http = aiohttp.ClientSession()
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.http.close()


@dataclass
class SdkStack:
    """Two in-process session servers: `real` in front of an embedded engine (behind a recording
    proxy), `scripted` in front of the scripted engine (exact tool calls and reasoning)."""
    real_url: str
    real: Any                      # SessionServer
    proxy: RecordingEngineProxy
    scripted_url: str
    scripted: Any                  # SessionServer
    engine: ScriptedEngine
    token: str = "sdk-test-token"

    async def session(self, which: str = "scripted") -> dict[str, Any]:
        import aiohttp
        url = self.scripted_url if which == "scripted" else self.real_url
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"}) as http:
            async with http.post(f"{url}/sessions", json={}) as r:
                assert r.status == 201, await r.text()
                return await r.json()

    async def info(self, which: str, session_id: str) -> dict[str, Any]:
        import aiohttp
        url = self.scripted_url if which == "scripted" else self.real_url
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"}) as http:
            async with http.get(f"{url}/sessions/{session_id}") as r:
                return await r.json()


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def sdk_stack(tiny_tokenizer, tiny_tokenizer_dir, tmp_path_factory):
    """Started once for all SDK test modules (they run on the session-scoped event loop)."""
    from miles.engines.embedded import launch_embedded_engine
    from miles.tiny import build_tiny_model
    from miles.tito.server import ServerConfig, SessionServer
    model = build_tiny_model()
    logs = tmp_path_factory.mktemp("sdk-logs")
    real_engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1"],
                                               log_path=logs / "engine.log")
    proxy = await RecordingEngineProxy(real_engine.url).start()
    engine = ScriptedEngine(tokenizer=tiny_tokenizer)
    runners = []
    try:
        runner, engine.url = await _serve(_scripted_app(engine))
        runners.append(runner)
        token = SdkStack.token
        real = SessionServer(ServerConfig(engine_url=proxy.url, tokenizer=str(model), token=token,
                                          max_context_tokens=4096))
        runner, real_url = await _serve(real.app())
        runners.append(runner)
        scripted = SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(tiny_tokenizer_dir), token=token,
                                              max_context_tokens=1 << 22, pool_tokenize_chars=32_768))
        runner, scripted_url = await _serve(scripted.app())
        runners.append(runner)
        yield SdkStack(real_url=real_url, real=real, proxy=proxy, scripted_url=scripted_url, scripted=scripted,
                       engine=engine)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await proxy.stop()
        await real_engine.stop_async(grace_s=5)
