"""The session server's HTTP pieces: JSON bodies, error envelopes, SSE, sample JSON.

Design decisions:
- Errors come in the envelope of the API the client speaks (`anthropic`: Anthropic's
  `{"type": "error", "error": {...}}`, else OpenAI's `{"error": {message, type, param, code}}`)
  and always carry `x-should-retry`, which both SDKs read before their status rules.
- Collected samples are JSON with plain lists (any client can read them); routed experts travel
  as base64 int32 plus a shape, as SGLang sends them.
- SSE frames are written from a finished turn: `event:` lines only where the API names its
  events (Anthropic, Responses), `data: [DONE]` only where OpenAI chat expects it.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
from aiohttp import web

from miles.tito.messages import RequestError


def speaks_anthropic(request: web.Request) -> bool:
    return "/v1/messages" in request.path or "anthropic-version" in request.headers


def model_object(model_id: str) -> dict[str, Any]:
    """A model as both SDKs read it (OpenAI's `object/created/owned_by`, Anthropic's `type/...`)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "miles", "type": "model",
            "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}


def sample_json(s: dict[str, Any]) -> dict[str, Any]:
    out = {"tokens": s["tokens"].tolist(), "response_length": int(s["response_length"]),
           "loss_mask": s["loss_mask"].tolist(), "rollout_logprobs": s["rollout_logprobs"].tolist(),
           "weight_versions": s["weight_versions"], "status": s["status"], "rollout_id": s["rollout_id"],
           "response": s["response"], "metadata": {"leaf": s["leaf"], "turns": s["turns"],
                                                   "finish_reason": s["finish_reason"],
                                                   "session_stats": s["session_stats"]}}
    routed = s.get("routed_experts")
    if routed is not None:
        arr = routed.astype("<i4", copy=False)
        out["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
        out["routed_experts_shape"] = list(arr.shape)
    elif s.get("routed_experts_missing"):
        out["metadata"]["routed_experts_missing"] = s["routed_experts_missing"]
    return out


def decode_body(raw: bytes, optional: bool) -> Any:
    if not raw.strip():
        if optional:
            return None
        raise RequestError("body: empty; expected a JSON object", "body")
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"body: invalid JSON ({e})", "body") from None


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, kind: str, field: str, anthropic: bool, retryable: bool = False,
           code: str | None = None) -> web.Response:
    if anthropic:
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": field or None, "code": code or status,
                          "retryable": retryable}}
    resp = json_response(body, status)
    # The SDKs read this before their status rules (which retry every 5xx, 408, 409 and 429).
    resp.headers["x-should-retry"] = "true" if retryable else "false"
    if status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


async def sse(request: web.Request, events: list[tuple[str | None, dict]], done: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for name, data in events:
        prefix = f"event: {name}\n" if name else ""
        await resp.write(f"{prefix}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    if done:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
