"""Async client of the session server: create a session, collect its samples as wire `Sample`s.

Design decisions:
- The rollout side only ever creates, collects and deletes sessions; the agent talks to the
  session's own OpenAI/Anthropic URL. So this client is small and has no chat methods.
- The session token (the server's `MILES_SESSION_TOKEN`) is `token=`, else that env var, else
  none; it goes out as `Authorization: Bearer`, and `client.token` is what an agent is handed as
  its API key. It is never part of an error message or a repr.
- Collected JSON becomes `miles.wire.messages.Sample`: int32 tokens, uint8 loss mask, float32
  logprobs, integer weight versions (SGLang's `"default"` is version 0) and routed experts decoded
  from base64 int32 with the shape the server sent. Every sample is validated before it is returned.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import aiohttp
import msgspec
import numpy as np

from miles.engines.client import parse_weight_version
from miles.wire.messages import Sample, VersionSpan


class SessionServerError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"session server: HTTP {status}: {message}")
        self.status, self.server_message = status, message


def sample_from_json(d: dict[str, Any], *, group_id: str = "", index: int = 0) -> Sample:
    routed = None
    if d.get("routed_experts"):
        routed = np.frombuffer(base64.b64decode(d["routed_experts"]), "<i4").astype(np.int32)
        routed = routed.reshape(d["routed_experts_shape"])
    sample = Sample(tokens=np.asarray(d["tokens"], np.int32), response_length=int(d["response_length"]),
                    loss_mask=np.asarray(d["loss_mask"], np.uint8),
                    rollout_logprobs=np.asarray(d["rollout_logprobs"], np.float32),
                    weight_versions=[VersionSpan(parse_weight_version(v), int(s), int(e))
                                     for v, s, e in d.get("weight_versions", [])],
                    status=d.get("status", "completed"), routed_experts=routed, group_id=group_id,
                    rollout_id=d.get("rollout_id", ""), index=index, response=d.get("response", ""),
                    metadata=dict(d.get("metadata") or {}))
    sample.validate()
    return sample


class SessionServerClient:
    def __init__(self, url: str, *, timeout_s: float = 60.0, session: aiohttp.ClientSession | None = None,
                 token: str | None = None):
        self.url = url.rstrip("/")
        self.token = token or os.environ.get("MILES_SESSION_TOKEN") or None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own = session is None

    async def __aenter__(self) -> "SessionServerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own and self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        async with self._session.request(method, self.url + path, data=data, timeout=self.timeout,
                                         headers=headers) as r:
            raw = await r.read()
            obj = msgspec.json.decode(raw) if raw else None
            if r.status >= 400:
                err = obj.get("error", obj) if isinstance(obj, dict) else raw[:200]
                raise SessionServerError(r.status, err.get("message", str(err)) if isinstance(err, dict) else str(err))
            return obj

    async def create_session(self, *, rollout_id: str = "", metadata: dict | None = None,
                             session_id: str | None = None, return_routed_experts: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"rollout_id": rollout_id, "metadata": metadata or {}}
        if return_routed_experts:   # every turn of the session records routing (R3)
            body["return_routed_experts"] = True
        if session_id:
            body["session_id"] = session_id
        return await self._call("POST", "/sessions", body)

    async def list_sessions(self) -> list[str]:
        """The ids of the server's open sessions."""
        return list((await self._call("GET", "/sessions")).get("sessions", []))

    async def info(self, session_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/sessions/{session_id}")

    async def delete(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}")

    async def collect(self, session_id: str, *, keep: str = "drop_retries", return_routed_experts: bool = False,
                      close: bool = True, group_id: str = "", first_index: int = 0) -> list[Sample]:
        out = await self._call("POST", f"/sessions/{session_id}/samples",
                               {"keep": keep, "return_routed_experts": return_routed_experts, "close": close})
        return [sample_from_json(d, group_id=group_id, index=first_index + i) for i, d in enumerate(out["samples"])]
