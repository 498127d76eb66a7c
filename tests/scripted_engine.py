"""An SGLang-shaped `/generate` that answers with queued texts, and the real session server in
front of it, both in the test's process on real sockets: for agent tests that need exact model
turns (malformed tool calls, oracle commands, slow tools), which no sampled model gives on cue."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from miles.engines.procs import free_port


class ScriptedEngine:
    """Each `/generate` answers the next queued text (tokenized, plus `<|im_end|>`; "done" when the
    queue is empty), cut at the request's `max_new_tokens` like an engine; records the prompts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.replies, self.prompts, self.url = tokenizer, [], [], ""
        self.prompt_ids: list[list[int]] = []   # each request's input ids, as the engine got them
        self.sampling: list[dict] = []   # each request's sampling_params, in order

    def app(self) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.prompts.append(self.tokenizer.decode(body["input_ids"]))
            self.prompt_ids.append(list(body["input_ids"]))
            self.sampling.append(dict(body.get("sampling_params") or {}))
            text = self.replies.pop(0) if self.replies else "done"
            ids = self.tokenizer.encode(text) + [self.tokenizer.token_id("<|im_end|>")]
            limit = body.get("sampling_params", {}).get("max_new_tokens", 128)
            finish = {"type": "stop", "matched": ids[-1]}
            if len(ids) > limit:
                ids, finish = ids[:limit], {"type": "length", "length": limit}
            meta = {"id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids), "weight_version": "0",
                    "output_token_logprobs": [[-0.5, t, None] for t in ids]}
            return web.json_response({"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta})

        async def model_info(_):
            return web.json_response({"model_path": "scripted", "weight_version": "0"})

        async def health(_):
            return web.Response(text="ok")

        app = web.Application(client_max_size=64 << 20)
        app.add_routes([web.post("/generate", generate), web.get("/model_info", model_info),
                        web.get("/health", health)])
        return app


@contextlib.asynccontextmanager
async def scripted_session_server(family: str | None = "qwen3") -> AsyncIterator[tuple[ScriptedEngine, str]]:
    """(scripted engine, session server URL) with the tiny tokenizer; `family=None`: the server's default."""
    from miles.tiny import build_tokenizer
    from miles.tito.server import ServerConfig, SessionServer
    from miles.tito.tokenizer import load_tokenizer

    tok_dir = build_tokenizer()
    engine = ScriptedEngine(load_tokenizer(str(tok_dir)))
    runners = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    try:
        engine.url = await serve(engine.app())
        extra = {} if family is None else {"family": family}
        yield engine, await serve(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(tok_dir),
                                                             **extra)).app())
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
