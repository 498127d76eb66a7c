"""The TITO session server: its own process, OpenAI/Anthropic-compatible per-session endpoints.

    python -m miles.tito.server --engine-url URL (--model-path DIR | --tokenizer SRC) \
        --family qwen3 [--host 127.0.0.1] [--port N] [--max-context-tokens N] [--token-file PATH]

Routes: `POST /sessions` -> {session_id, base_url, openai_base_url}; `GET /sessions`;
`GET|DELETE /sessions/{id}`; `POST /sessions/{id}/v1/chat/completions` (OpenAI);
`POST /sessions/{id}/v1/messages` (Anthropic); `GET /sessions/{id}/v1/models`;
`POST /sessions/{id}/samples` (collect: {keep, return_routed_experts, close}); `GET /health`;
`GET /stats`.

Design decisions:
- A separate process with its own event loop, never the rollout actor's: tokenization is CPU
  work, and an agent harness may hold hundreds of sessions open. Turns of different sessions
  never wait on each other (no global lock; the engine call is the only await), and renders
  large enough to matter (first turns with long tool outputs) are tokenized in a worker thread.
- Every error is a JSON body with the field and the value at fault (OpenAI's envelope on OpenAI
  routes, Anthropic's on `/v1/messages`); a refused request changes nothing in any session.
- Collected samples are JSON with plain lists (any client can read them); routed experts travel
  as base64 int32 plus a shape, as SGLang sends them. `miles.tito.collect` turns them into wire
  `Sample`s.
- Idle sessions are dropped after `--session-ttl-s` so a crashed harness cannot leak memory.
- A per-job token, when one is configured (`ServerConfig.token`, `--token-file`, else the env var
  `MILES_SESSION_TOKEN`), is required on every route but `/health`: as `Authorization: Bearer
  <token>` (what OpenAI clients send their API key as) or `x-api-key: <token>` (Anthropic
  clients). Without it: 401 in the route's API error shape. The agent endpoints need it because
  they spend the job's GPUs; the management routes because they read and delete trajectories.
  No token configured means open (tests, laptops). The token is never logged, echoed or put on a
  command line (`ps` shows argv to every user): a file or the environment. Comparisons are
  constant-time. Whoever hands an agent its `base_url` hands the token as the API key
  (`SessionServerClient.token`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from miles.tito import api_anthropic, api_openai
from miles.tito.engine import EngineTurnError, TurnEngine
from miles.tito.families import Family, get_family
from miles.tito.messages import RequestError
from miles.tito.request import ChatRequest
from miles.tito.session import Session
from miles.tito.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger("miles.tito.server")
THREAD_TOKENIZE_CHARS = 32_768      # renders at least this long are tokenized off the event loop
MAX_BODY_BYTES = 512 * 1024 * 1024
TOKEN_ENV = "MILES_SESSION_TOKEN"
OPEN_PATHS = frozenset({"/health"})  # probes carry no credentials


class ServerConfig(msgspec.Struct, kw_only=True):
    engine_url: str
    tokenizer: str
    family: str = "qwen3"
    host: str = "127.0.0.1"
    port: int = 0
    max_context_tokens: int = 32768
    message_matcher: str = "default"
    engine_timeout_s: float = 600.0
    session_ttl_s: float = 3600.0
    routed_experts_layout: tuple[int, int] | None = None
    token: str | None = None  # None: MILES_SESSION_TOKEN if set, else open; never logged

    def __repr__(self) -> str:  # a config may be logged whole; the token must not be
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        fields["token"] = "<set>" if self.token else None
        return f"ServerConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def request_token(request: web.Request) -> str | None:
    """The credential a client sent: `Authorization: Bearer <t>` or `x-api-key: <t>`."""
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


class SessionServer:
    def __init__(self, config: ServerConfig, family: Family | None = None, tokenizer: ChatTokenizer | None = None):
        self.config = config
        self.family = family or get_family(config.family)
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self.stop_token_ids = [self.tokenizer.token_id(t) for t in self.family.stop_tokens
                               if t in self.tokenizer.added_ids]
        if self.family.end_of_turn not in self.tokenizer.added_ids:
            raise ValueError(f"family {self.family.name!r}: end-of-turn token {self.family.end_of_turn!r} is "
                             f"not in the vocabulary of {config.tokenizer!r}")
        self._token = (config.token or os.environ.get(TOKEN_ENV) or "").encode() or None
        self.engine: TurnEngine | None = None
        self.sessions: dict[str, Session] = {}
        self.last_used: dict[str, float] = {}
        self.stats = {"turns": 0, "inflight": 0, "inflight_max": 0, "errors": 0, "unauthorized": 0,
                      "prepare_ms_last": 0.0, "prepare_ms_max": 0.0, "appended_tokens_last": 0}

    # -- app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.add_routes([
            web.get("/health", self.health), web.get("/stats", self.get_stats),
            web.post("/sessions", self.create), web.get("/sessions", self.list_sessions),
            web.get("/sessions/{sid}", self.get_session), web.delete("/sessions/{sid}", self.delete),
            web.post("/sessions/{sid}/v1/chat/completions", self.chat),
            web.post("/sessions/{sid}/v1/messages", self.messages),
            web.get("/sessions/{sid}/v1/models", self.models),
            web.post("/sessions/{sid}/samples", self.collect)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self.engine = TurnEngine(self.config.engine_url, timeout_s=self.config.engine_timeout_s,
                                 routed_experts_layout=self.config.routed_experts_layout)
        self._reaper = asyncio.create_task(self._reap())

    async def _stop(self, _app) -> None:
        self._reaper.cancel()
        await self.engine.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.config.session_ttl_s / 10))
            cutoff = time.monotonic() - self.config.session_ttl_s
            for sid in [s for s, t in self.last_used.items() if t < cutoff]:
                self.sessions.pop(sid, None)
                self.last_used.pop(sid, None)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        anthropic = request.path.endswith("/v1/messages")
        try:
            self._authorize(request, anthropic)
            return await handler(request)
        except RequestError as e:
            self.stats["errors"] += 1
            return _error(e.status, e.message, e.kind, e.field, anthropic, code=e.code)
        except EngineTurnError as e:
            self.stats["errors"] += 1
            return _error(e.status, e.message, "engine_error", "", anthropic, retryable=e.retryable)
        except web.HTTPException:
            raise
        except Exception as e:   # a bug of ours: answer 500, keep serving every other session
            self.stats["errors"] += 1
            log.exception("internal error on %s", request.path)
            return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error", "", anthropic)

    def _authorize(self, request: web.Request, anthropic: bool) -> None:
        if self._token is None or request.path in OPEN_PATHS:
            return
        sent = request_token(request)
        if sent is not None and hmac.compare_digest(sent.encode(), self._token):
            return
        self.stats["unauthorized"] += 1
        header = "x-api-key" if anthropic else "Authorization"
        what = "missing API key" if sent is None else "invalid API key"
        raise RequestError(f"{header}: {what}; send the job's session token ({TOKEN_ENV}) as "
                           "`Authorization: Bearer <token>` or `x-api-key: <token>`", header, status=401,
                           kind="authentication_error" if anthropic else "invalid_request_error",
                           code="invalid_api_key")

    # -- sessions ---------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        sid = request.match_info["sid"]
        session = self.sessions.get(sid)
        if session is None:
            raise RequestError(f"session {sid!r} not found (create one with POST /sessions)", "session_id",
                               status=404, kind="not_found_error")
        self.last_used[sid] = time.monotonic()
        return session

    async def health(self, _request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions), "family": self.family.name})

    async def get_stats(self, _request) -> web.Response:
        return web.json_response({**self.stats, "sessions": len(self.sessions)})

    async def create(self, request: web.Request) -> web.Response:
        body = await _json(request, optional=True) or {}
        if not isinstance(body, dict):
            raise RequestError(f"body: expected a JSON object, got {str(body)[:80]!r}", "body")
        sid = body.get("session_id") or uuid.uuid4().hex
        if not isinstance(sid, str) or not sid or len(sid) > 128 or "/" in sid:
            raise RequestError(f"session_id: expected 1-128 characters without '/', got {str(sid)[:80]!r}", "session_id")
        if sid in self.sessions:
            raise RequestError(f"session_id: {sid!r} already exists", "session_id", status=409, kind="conflict")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise RequestError(f"metadata: expected an object, got {str(metadata)[:80]!r}", "metadata")
        self.sessions[sid] = Session(sid, self.family, self.tokenizer, rollout_id=str(body.get("rollout_id") or ""),
                                     matcher=self.config.message_matcher,
                                     max_context_tokens=self.config.max_context_tokens, metadata=metadata)
        self.last_used[sid] = time.monotonic()
        base = f"{request.url.origin()}/sessions/{sid}"
        return web.json_response({"session_id": sid, "rollout_id": self.sessions[sid].rollout_id,
                                  "base_url": base, "openai_base_url": base + "/v1"}, status=201)

    async def list_sessions(self, _request) -> web.Response:
        return web.json_response({"sessions": sorted(self.sessions)})

    async def get_session(self, request: web.Request) -> web.Response:
        return web.json_response(self._session(request).info())

    async def delete(self, request: web.Request) -> web.Response:
        session = self._session(request)
        self.sessions.pop(session.id, None)
        self.last_used.pop(session.id, None)
        return web.json_response({"deleted": session.id})

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [{"id": "miles", "object": "model", "owned_by": "miles"}]})

    # -- a turn -----------------------------------------------------------------------------

    async def run_turn(self, session: Session, req: ChatRequest):
        t0 = time.perf_counter()
        loc = session.locate(req.messages, req.tools, req.options)
        if len(loc.text) >= THREAD_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(session.tokenize, loc)
        else:
            ids = session.tokenize(loc)
        plan = session.commit_prompt(loc, ids, req.max_tokens, req.return_routed_experts, req.options)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        self.stats["prepare_ms_last"] = prepare_ms
        self.stats["prepare_ms_max"] = max(self.stats["prepare_ms_max"], prepare_ms)
        self.stats["appended_tokens_last"] = plan.appended_tokens
        self.stats["inflight"] += 1
        self.stats["inflight_max"] = max(self.stats["inflight_max"], self.stats["inflight"])
        try:
            out = await self.engine.generate(plan, req.sampling, self.stop_token_ids, session.id,
                                             req.return_routed_experts)
        except BaseException:
            session.abandon(plan)
            raise
        finally:
            self.stats["inflight"] -= 1
        node, reply = session.complete(plan, out)
        self.stats["turns"] += 1
        turn = {"session_id": session.id, "node": node.id, "prompt_tokens": len(plan.input_ids),
                "completion_tokens": len(out.output_ids), "appended_tokens": plan.appended_tokens,
                "reused_prompt": plan.reused_prompt, "prepare_ms": round(prepare_ms, 3),
                "finish_reason": node.finish, "weight_version": out.meta.get("weight_version", "")}
        return reply, turn, out

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await _json(request)
        req = api_openai.parse_chat_request(body)
        reply, turn, out = await self.run_turn(session, req)
        token_logprobs = None
        if req.logprobs:
            token_logprobs = [(self.tokenizer.id_to_token(t) or "", lp) for t, lp in zip(out.output_ids, out.logprobs)]
        response = api_openai.chat_response(req, reply, turn, token_logprobs)
        if not req.stream:
            return _json_response(response)
        return await _sse(request, [(None, c) for c in api_openai.stream_chunks(response, req.include_usage)],
                          done=True)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = api_anthropic.parse_messages_request(await _json(request))
        reply, turn, _ = await self.run_turn(session, req)
        response = api_anthropic.message_response(req, reply, turn)
        if not req.stream:
            return _json_response(response)
        return await _sse(request, api_anthropic.stream_events(response), done=False)

    # -- collection -------------------------------------------------------------------------

    async def collect(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await _json(request, optional=True) or {}
        if not isinstance(body, dict):
            raise RequestError(f"body: expected a JSON object, got {str(body)[:80]!r}", "body")
        keep = body.get("keep", "drop_retries")
        if keep not in ("all", "drop_retries"):
            raise RequestError(f"keep: {keep!r} is not one of ['all', 'drop_retries']", "keep")
        samples = [_sample_json(s) for s in session.collect(keep, bool(body.get("return_routed_experts")))]
        if body.get("close"):
            self.sessions.pop(session.id, None)
            self.last_used.pop(session.id, None)
        return _json_response({"session_id": session.id, "rollout_id": session.rollout_id,
                               "metadata": session.metadata, "samples": samples})


def _sample_json(s: dict[str, Any]) -> dict[str, Any]:
    out = {"tokens": s["tokens"].tolist(), "response_length": int(s["response_length"]),
           "loss_mask": s["loss_mask"].tolist(), "rollout_logprobs": s["rollout_logprobs"].tolist(),
           "weight_versions": s["weight_versions"], "status": s["status"], "rollout_id": s["rollout_id"],
           "response": s["response"], "metadata": {"leaf": s["leaf"], "turns": s["turns"],
                                                   "finish_reason": s["finish_reason"]}}
    routed = s.get("routed_experts")
    if routed is not None:
        arr = routed.astype("<i4", copy=False)
        out["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
        out["routed_experts_shape"] = list(arr.shape)
    elif s.get("routed_experts_missing"):
        out["metadata"]["routed_experts_missing"] = s["routed_experts_missing"]
    return out


async def _json(request: web.Request, optional: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return None
        raise RequestError("body: empty; expected a JSON object", "body")
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"body: invalid JSON ({e})", "body") from None


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _error(status: int, message: str, kind: str, field: str, anthropic: bool, retryable: bool = False,
           code: str | None = None) -> web.Response:
    if anthropic:
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": field or None, "code": code or status,
                          "retryable": retryable}}
    resp = _json_response(body, status)
    if status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


async def _sse(request: web.Request, events: list[tuple[str | None, dict]], done: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for name, data in events:
        prefix = f"event: {name}\n" if name else ""
        await resp.write(f"{prefix}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    if done:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _model_defaults(model_path: str | None) -> tuple[int | None, tuple[int, int] | None]:
    """(context length, routed-experts layout) from a model directory's config.json, if any."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return None, None
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    k = cfg.get("num_experts_per_tok")
    layout = (int(cfg["num_hidden_layers"]), int(k)) if k else None
    return cfg.get("max_position_embeddings"), layout


def main(argv: list[str] | None = None) -> None:
    # No abbreviations: `--token SECRET` must fail, not be read as `--token-file SECRET`.
    ap = argparse.ArgumentParser(prog="python -m miles.tito.server", description="Miles TITO session server",
                                 allow_abbrev=False)
    ap.add_argument("--engine-url", required=True, help="SGLang engine or smg gateway base URL")
    ap.add_argument("--model-path", default=None, help="model directory (tokenizer.json, config.json)")
    ap.add_argument("--tokenizer", default=None, help="qwen | directory | tokenizer.json (default: --model-path)")
    ap.add_argument("--family", default="qwen3", help="qwen3 | llama3 | module:Class")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--max-context-tokens", type=int, default=None,
                    help="default: the model's max_position_embeddings, else 32768")
    ap.add_argument("--message-matcher", default="default", help="default | strict | role_content | module:function")
    ap.add_argument("--engine-timeout-s", type=float, default=600.0)
    ap.add_argument("--session-ttl-s", type=float, default=3600.0)
    ap.add_argument("--token-file", default=None,
                    help=f"a file holding the per-job token the endpoints require (default: ${TOKEN_ENV}; "
                         "neither: open). Not a flag value: argv is visible to every user")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            ap.error(f"--token-file {args.token_file}: {e.strerror}")
        if not token:
            ap.error(f"--token-file {args.token_file}: the file is empty")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tokenizer = args.tokenizer or args.model_path
    if tokenizer is None:
        ap.error("--tokenizer or --model-path is required")
    context, layout = _model_defaults(args.model_path)
    config = ServerConfig(engine_url=args.engine_url, tokenizer=tokenizer, family=args.family, host=args.host,
                          port=args.port, max_context_tokens=args.max_context_tokens or context or 32768,
                          message_matcher=args.message_matcher, engine_timeout_s=args.engine_timeout_s,
                          session_ttl_s=args.session_ttl_s, routed_experts_layout=layout, token=token)
    server = SessionServer(config)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
