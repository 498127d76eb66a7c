"""The TITO session server: its own process, OpenAI/Anthropic-compatible per-session endpoints.

    python -m miles.tito.server --engine-url URL (--model-path DIR | --tokenizer SRC) \
        --family qwen3 [--host 127.0.0.1] [--port N] [--max-context-tokens N] [--token-file PATH] \
        [--max-body-bytes N] [--tokenize-workers N]

Routes: `POST /sessions` ({rollout_id, metadata, return_routed_experts: every turn records R3 routing})
-> {session_id, base_url, openai_base_url}; `GET /sessions`;
`GET|DELETE /sessions/{id}`; `POST /sessions/{id}/samples` (collect: {keep, return_routed_experts,
close}); `GET /health`; `GET /stats`. Per session, under `/sessions/{id}/v1`: `POST
chat/completions` (OpenAI), `POST responses` (OpenAI Responses, `api_responses.py`), `POST
messages` and `POST messages/count_tokens` (Anthropic), `GET models` and `GET models/{model_id}`
(both APIs). Any other route is a JSON 404 listing these.

Design decisions:
- A separate process with its own event loop, never the rollout actor's: tokenization is CPU
  work, and an agent harness may hold hundreds of sessions open. Turns of different sessions
  never wait on each other (no global lock; the engine call is the only await). Renders of at
  least `pool_tokenize_chars` characters (long tool outputs) are tokenized in a process pool
  (`tokenize_pool.py`): the tokenizer holds the GIL, so a thread would still stall every session.
- Bodies are refused by size (413, `max_body_bytes`, default 4 MiB) before they are read whole,
  decoded or tokenized: from `Content-Length` when sent, else while reading.
- Histories are checked before anything is rendered (`history.py`): a tool result that answers
  no call, a call never answered, an assistant turn with neither content nor tool calls is a 400
  naming the request's own index and field.
- Every error is a JSON body with the field and the value at fault (Anthropic's envelope on the
  Anthropic routes or when the client sends `anthropic-version`, OpenAI's otherwise); a refused
  request changes nothing in any session. Every error carries `x-should-retry` (true only for a
  retryable 5xx: engine unavailable, timed out or aborted), which the `openai` and `anthropic`
  SDKs obey before their own status rules: without it they resend a failed turn twice.
- `models/{model_id}` answers for any id: a session serves one policy under whatever name the
  harness configured (the `model` field of a turn is echoed and otherwise ignored). The body
  has both APIs' fields (`object`/`owned_by`/`created` and `type`/`display_name`/`created_at`).
- Cost accounting per session (`Session.stats`: turns, engine seconds, server seconds outside
  the engine call, prompt/output/cached tokens) for completed turns only, so a refused request
  leaves a session's info unchanged; `GET /stats` adds the totals over all sessions and
  `open_sessions`.
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

from miles.tito import api_anthropic, api_openai, api_responses
from miles.tito.engine import EngineTurnError, TurnEngine
from miles.tito.families import Family, get_family
from miles.tito.httpio import (decode_body, error_response, json_response, model_object, sample_json,
                               speaks_anthropic, sse)
from miles.tito.history import ANTHROPIC, OPENAI, RESPONSES, Terms, check_history
from miles.tito.messages import RequestError
from miles.tito.request import ChatRequest
from miles.tito.session import Located, Session
from miles.tito.tokenize_pool import TokenizePool
from miles.tito.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger("miles.tito.server")
MAX_BODY_BYTES = 4 * 1024 * 1024
TOKEN_ENV = "MILES_SESSION_TOKEN"
OPEN_PATHS = frozenset({"/health"})  # probes carry no credentials
ROUTES = ["POST /sessions", "GET /sessions", "GET /sessions/{id}", "DELETE /sessions/{id}",
          "POST /sessions/{id}/samples", "POST /sessions/{id}/v1/chat/completions",
          "POST /sessions/{id}/v1/responses", "POST /sessions/{id}/v1/messages",
          "POST /sessions/{id}/v1/messages/count_tokens", "GET /sessions/{id}/v1/models",
          "GET /sessions/{id}/v1/models/{model_id}", "GET /health", "GET /stats"]
STAT_KEYS = ("turns", "engine_s", "server_s", "prompt_tokens", "output_tokens", "cached_tokens")


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
    max_body_bytes: int = MAX_BODY_BYTES   # larger request bodies get a 413 before they are read
    tokenize_workers: int = 1              # processes tokenizing large renders
    pool_tokenize_chars: int = 32_768      # renders at least this long go to those processes

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
                      "prepare_ms_last": 0.0, "prepare_ms_max": 0.0, "appended_tokens_last": 0,
                      "pool_tokenized": 0}
        self.totals = {k: 0.0 if k.endswith("_s") else 0 for k in STAT_KEYS}
        if config.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected at least 1, got {config.max_body_bytes}")
        self.pool = TokenizePool(self.tokenizer.source or config.tokenizer, config.tokenize_workers)

    # -- app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.add_routes([
            web.get("/health", self.health), web.get("/stats", self.get_stats),
            web.post("/sessions", self.create), web.get("/sessions", self.list_sessions),
            web.get("/sessions/{sid}", self.get_session), web.delete("/sessions/{sid}", self.delete),
            web.post("/sessions/{sid}/v1/chat/completions", self.chat),
            web.post("/sessions/{sid}/v1/responses", self.responses),
            web.post("/sessions/{sid}/v1/messages", self.messages),
            web.post("/sessions/{sid}/v1/messages/count_tokens", self.count_tokens),
            web.get("/sessions/{sid}/v1/models", self.models),
            web.get("/sessions/{sid}/v1/models/{model_id}", self.model),
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
        self.pool.close()
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
        anthropic = speaks_anthropic(request)
        try:
            self._authorize(request, anthropic)
            return await handler(request)
        except RequestError as e:
            self.stats["errors"] += 1
            return error_response(e.status, e.message, e.kind, e.field, anthropic, code=e.code)
        except EngineTurnError as e:
            self.stats["errors"] += 1
            return error_response(e.status, e.message, "engine_error" if not anthropic else "api_error", "", anthropic,
                          retryable=e.retryable)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:   # the router found no route
            self.stats["errors"] += 1
            what = "route" if e.status == 404 else "method"
            return error_response(e.status, f"{request.method} {request.path}: unsupported {what}; this server "
                          f"supports {ROUTES}", "not_found_error" if e.status == 404 else "invalid_request_error",
                          "", anthropic)
        except web.HTTPRequestEntityTooLarge:
            self.stats["errors"] += 1
            return error_response(413, self._too_large(None), "request_too_large", "body", anthropic)
        except web.HTTPException:
            raise
        except Exception as e:   # a bug of ours: answer 500, keep serving every other session
            self.stats["errors"] += 1
            log.exception("internal error on %s", request.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error", "", anthropic)

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
        totals = {k: round(v, 6) if isinstance(v, float) else v for k, v in self.totals.items()}
        return web.json_response({**self.stats, "sessions": len(self.sessions),
                                  "open_sessions": len(self.sessions), "totals": totals})

    async def create(self, request: web.Request) -> web.Response:
        body = await self._json(request, optional=True) or {}
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
        # R3: the trainer side asks for routing when it creates the session; the agent's own
        # OpenAI requests know nothing of it, yet every turn must record its routing.
        self.sessions[sid].record_routing = body.get("return_routed_experts") is True
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
        model = model_object("miles")
        return web.json_response({"object": "list", "data": [model], "has_more": False,
                                  "first_id": model["id"], "last_id": model["id"]})

    async def model(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response(model_object(request.match_info["model_id"]))

    # -- a turn -----------------------------------------------------------------------------

    async def _locate(self, session: Session, req: ChatRequest, terms: Terms) -> tuple[Located, Any]:
        """Find the recorded prefix, check the history, render and tokenize what is new."""
        loc = session.locate(req.messages, req.tools, req.options,
                             check=lambda known: check_history(req.messages, req.sources, terms, known))
        if loc.existing is None and len(loc.text) >= self.config.pool_tokenize_chars:
            self.stats["pool_tokenized"] += 1
            return loc, await self.pool.encode(loc.text)
        return loc, session.tokenize(loc)

    async def run_turn(self, session: Session, req: ChatRequest, terms: Terms = OPENAI):
        t0 = time.perf_counter()
        loc, ids = await self._locate(session, req, terms)
        want_routing = req.return_routed_experts or session.record_routing
        plan = session.commit_prompt(loc, ids, req.max_tokens, want_routing, req.options)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        self.stats["prepare_ms_last"] = prepare_ms
        self.stats["prepare_ms_max"] = max(self.stats["prepare_ms_max"], prepare_ms)
        self.stats["appended_tokens_last"] = plan.appended_tokens
        self.stats["inflight"] += 1
        self.stats["inflight_max"] = max(self.stats["inflight_max"], self.stats["inflight"])
        t_engine = time.perf_counter()
        try:
            out = await self.engine.generate(plan, req.sampling, self.stop_token_ids, session.id,
                                             want_routing, top_logprobs=req.top_logprobs)
        except BaseException:
            session.abandon(plan)
            raise
        finally:
            self.stats["inflight"] -= 1
        engine_s = time.perf_counter() - t_engine
        node, reply = session.complete(plan, out, parse_tools=req.tool_choice != "none")
        session.stats["engine_s"] += engine_s
        self.stats["turns"] += 1
        self.totals["turns"] += 1
        for k in ("prompt_tokens", "output_tokens", "cached_tokens"):
            self.totals[k] += {"prompt_tokens": len(plan.input_ids), "output_tokens": len(out.output_ids),
                               "cached_tokens": int(out.meta.get("cached_tokens") or 0)}[k]
        self.totals["engine_s"] += engine_s
        turn = {"session_id": session.id, "node": node.id, "prompt_tokens": len(plan.input_ids),
                "completion_tokens": len(out.output_ids), "appended_tokens": plan.appended_tokens,
                "reused_prompt": plan.reused_prompt, "prepare_ms": round(prepare_ms, 3),
                "finish_reason": node.finish, "weight_version": out.meta.get("weight_version", ""),
                "cached_tokens": int(out.meta.get("cached_tokens") or 0), "engine_s": engine_s}
        return reply, turn, out

    def _account(self, session: Session, t0: float, turn: dict[str, Any]) -> None:
        """Server time of a completed turn: the handler's wall time outside the engine call."""
        server_s = max(0.0, time.perf_counter() - t0 - turn["engine_s"])
        session.stats["server_s"] += server_s
        self.totals["server_s"] += server_s

    def _token_logprobs(self, out) -> list[tuple[str, float, list[tuple[str, float]]]]:
        text = self.tokenizer.decode
        tops = out.top_logprobs or [[] for _ in out.output_ids]
        return [(text([t]), lp, [(text([i]), a) for a, i in alts])
                for t, lp, alts in zip(out.output_ids, out.logprobs, tops)]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        session = self._session(request)
        req = api_openai.parse_chat_request(await self._json(request))
        reply, turn, out = await self.run_turn(session, req, OPENAI)
        token_logprobs = self._token_logprobs(out) if req.logprobs else None
        response = api_openai.chat_response(req, reply, turn, token_logprobs)
        if not req.stream:
            resp = json_response(response)
        else:
            resp = await sse(request, [(None, c) for c in api_openai.stream_chunks(response, req.include_usage)],
                              done=True)
        self._account(session, t0, turn)
        return resp

    async def responses(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        session = self._session(request)
        req = api_responses.parse_request(await self._json(request))
        reply, turn, out = await self.run_turn(session, req, RESPONSES)
        logprobs = api_openai.logprob_entries(self._token_logprobs(out)) if req.logprobs else None
        response = api_responses.response_object(req, reply, turn, logprobs)
        resp = (await sse(request, api_responses.stream_events(response), done=False) if req.stream
                else json_response(response))
        self._account(session, t0, turn)
        return resp

    async def messages(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        session = self._session(request)
        req = api_anthropic.parse_messages_request(await self._json(request))
        reply, turn, _ = await self.run_turn(session, req, ANTHROPIC)
        response = api_anthropic.message_response(req, reply, turn)
        resp = (await sse(request, api_anthropic.stream_events(response), done=False) if req.stream
                else json_response(response))
        self._account(session, t0, turn)
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens: the prompt length this turn would have, nothing committed."""
        session = self._session(request)
        req = api_anthropic.parse_messages_request(await self._json(request), count_only=True)
        loc, ids = await self._locate(session, req, ANTHROPIC)
        return web.json_response({"input_tokens": session.prompt_tokens(loc, ids)})

    # -- collection -------------------------------------------------------------------------

    async def collect(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._json(request, optional=True) or {}
        if not isinstance(body, dict):
            raise RequestError(f"body: expected a JSON object, got {str(body)[:80]!r}", "body")
        keep = body.get("keep", "drop_retries")
        if keep not in ("all", "drop_retries"):
            raise RequestError(f"keep: {keep!r} is not one of ['all', 'drop_retries']", "keep")
        samples = [sample_json(s) for s in session.collect(keep, bool(body.get("return_routed_experts")))]
        if body.get("close"):
            self.sessions.pop(session.id, None)
            self.last_used.pop(session.id, None)
        return json_response({"session_id": session.id, "rollout_id": session.rollout_id,
                               "metadata": session.metadata, "samples": samples})

    # -- bodies ---------------------------------------------------------------------------------

    def _too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "the body"
        return (f"body: {got} is over the limit of {self.config.max_body_bytes} bytes (--max-body-bytes); "
                f"shorten the history or the tool output")

    async def _json(self, request: web.Request, optional: bool = False) -> Any:
        """The body decoded, refused by size first (`Content-Length`, else while reading)."""
        size = request.content_length
        if size is not None and size > self.config.max_body_bytes:
            raise RequestError(self._too_large(size), "body", status=413, kind="request_too_large")
        return decode_body(await request.read(), optional)


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
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help="larger request bodies are refused with 413 before they are read (default 4 MiB)")
    ap.add_argument("--tokenize-workers", type=int, default=1,
                    help="processes that tokenize large renders, off the event loop")
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
                          session_ttl_s=args.session_ttl_s, routed_experts_layout=layout, token=token,
                          max_body_bytes=args.max_body_bytes, tokenize_workers=args.tokenize_workers)
    server = SessionServer(config)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
