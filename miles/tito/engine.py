"""The session server's side of SGLang's `/generate`: one turn in, an `EngineTurn` out.

Design decisions:
- All HTTP to engines goes through `miles.engines.client.EngineClient` (the one place that knows
  SGLang's field names); this file only decides *what* a TITO turn asks for: token ids in,
  logprobs always on, the family's stop tokens, routed experts from the attach point onward, and
  the session id as `X-SMG-Routing-Key` so every turn of a session lands on one engine (its KV
  prefix is still there), and as SGLang's `session_id`, so an engine started with
  `--enable-session-radix-cache` evicts that session's KV last. (Releasing it with
  `/close_session` when a session is collected is not done yet.)
- Engine failures become `EngineTurnError` with the HTTP status the client should see: the
  engine refused the body -> 502 (our request was wrong or the client's sampling values were);
  unreachable, 5xx or timed out -> 503/504 (retryable); aborted (weight update with abort mode,
  or `/abort_request`) -> 503 retryable. The turn's prompt segment is then discarded.
"""

from __future__ import annotations

import uuid
from typing import Any

from miles.engines.client import EngineClient, EngineRequestError, EngineUnavailable
from miles.tito.session import EngineTurn, TurnPlan


class EngineTurnError(Exception):
    def __init__(self, message: str, status: int, retryable: bool):
        super().__init__(message)
        self.message, self.status, self.retryable = message, status, retryable


class TurnEngine:
    def __init__(self, url: str, *, timeout_s: float = 600.0, routed_experts_layout: tuple[int, int] | None = None):
        self.url = url.rstrip("/")
        self.client = EngineClient(self.url, generate_timeout_s=timeout_s,
                                   routed_experts_layout=routed_experts_layout)

    async def close(self) -> None:
        await self.client.close()

    async def generate(self, plan: TurnPlan, sampling: dict[str, Any], stop_token_ids: list[int],
                       routing_key: str, want_routed_experts: bool, top_logprobs: int = 0) -> EngineTurn:
        params = {**sampling, "max_new_tokens": plan.max_new_tokens, "stop_token_ids": stop_token_ids}
        rid = f"tito-{routing_key}-{uuid.uuid4().hex[:12]}"
        try:
            result = await self.client.generate(
                plan.input_ids, params, return_logprob=True, top_logprobs_num=top_logprobs, rid=rid,
                routing_key=routing_key,
                session_id=routing_key,
                return_routed_experts=want_routed_experts,
                routed_experts_start_len=plan.routed_experts_start if want_routed_experts else 0)
        except EngineRequestError as e:
            raise EngineTurnError(f"engine refused the turn (HTTP {e.status}): {e.server_message}", 502, False) from e
        except EngineUnavailable as e:
            timeout = "no answer within" in e.message
            raise EngineTurnError(f"engine unavailable: {e.message}", 504 if timeout else 503, True) from e
        if result.aborted:
            raise EngineTurnError(f"engine aborted the turn: {result.finish_reason.message or 'no reason given'}",
                                  503, True)
        logprobs = result.output_logprobs
        if logprobs is None or len(logprobs) != len(result.output_ids):
            raise EngineTurnError(f"engine returned {0 if logprobs is None else len(logprobs)} logprobs for "
                                  f"{len(result.output_ids)} output ids", 502, False)
        finish = {k: v for k, v in (("type", result.finish_reason.type), ("matched", result.finish_reason.matched),
                                    ("length", result.finish_reason.length)) if v is not None}
        return EngineTurn(output_ids=list(result.output_ids), logprobs=[float(x) for x in logprobs],
                          finish_reason=finish,
                          weight_versions=[(s.version, s.start, s.end) for s in result.weight_versions],
                          routed_experts=result.routed_experts if want_routed_experts else None,
                          top_logprobs=result.output_top_logprobs if top_logprobs else None,
                          meta={"rid": rid, "weight_version": result.weight_version,
                                "cached_tokens": result.cached_tokens})
