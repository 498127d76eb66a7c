"""Async client for SGLang's native HTTP API: the only place in Miles that knows its field names.

Works against real SGLang, the embedded engine, and smg in front of either.

Design decisions:
- Bodies are SGLang 0.5.23's exactly (integration.md section 1): `sampling_params` uses SGLang's
  keys only (`max_new_tokens`, never `max_tokens`; unknown keys are refused here, before SGLang's
  contract gate refuses them there); control bodies always carry a JSON object.
- Results are typed (msgspec Structs): `GenerateResult` with output ids, per-token logprobs
  (from `meta_info.output_token_logprobs` `[logprob, token_id, text]` triples), `FinishReason`,
  `weight_version`, per-token weight-version spans and routed experts as a numpy array.
- Weight-version spans: SGLang reports `weight_versions` as `[{"version": str, "start", "end"}]`
  over output positions, and only when the weights changed during the request; we always fill
  `GenerateResult.weight_versions` (one span covering the whole output otherwise).
  `GenerateResult.version_spans()` converts them to the wire `VersionSpan(version: int, start, end)`
  of miles/wire/messages.py: Miles publishes integer policy versions as decimal strings, and
  SGLang's initial `"default"` counts as version 0; any other string raises, naming it.
- Routed experts: base64 little-endian int32 -> array of shape `(tokens - 1 - start, layers, top_k)`;
  (layers, top_k) come from the constructor, or from `/model_info` when the engine reports them
  (the embedded engine does), or `routed_experts_layout_from_config(model_path)`
  (miles/engines/routed_experts.py).
- Errors: HTTP 4xx -> `EngineRequestError(status, message)` (the server's message, both of SGLang's
  error shapes understood); 5xx, timeouts and transport failures -> `EngineUnavailable`.
  Idempotent calls (GETs, pause/continue, flush, version, abort, disk/tensor updates) retry
  transport errors with exponential backoff; `generate`, group init and distributed updates are
  never retried blindly (the caller decides: a generate may have run, a broadcast must match).
- Affinity: `routing_key` becomes the `X-SMG-Routing-Key` header (smg's session stickiness).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any, AsyncIterator, Literal

import aiohttp
import msgspec
import numpy as np

from miles.engines.routed_experts import decode_routed_experts
from miles.engines.sampling_params import SamplingParams
from miles.wire.messages import VersionSpan

log = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

# SGLang's `sampling_params` keys (sglang.api.v1.SamplingParams); anything else is refused up front.
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice"})
_RENAMES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed", "stop_ids": "stop_token_ids",
            "max_completion_tokens": "max_new_tokens"}


# ---- errors ---------------------------------------------------------------------------------

class EngineError(Exception):
    """Base of every client error; carries the engine URL and path."""

    def __init__(self, message: str, *, url: str = "", path: str = ""):
        super().__init__(message)
        self.message, self.url, self.path = message, url, path


class EngineRequestError(EngineError):
    """The engine refused the request (HTTP 4xx): fix the request, retrying won't help."""

    def __init__(self, status: int, message: str, *, url: str = "", path: str = "", body: Any = None):
        super().__init__(f"{path}: HTTP {status}: {message}", url=url, path=path)
        self.status, self.server_message, self.body = status, message, body


class EngineUnavailable(EngineError):
    """The engine failed (5xx), timed out or could not be reached after the allowed retries."""

    def __init__(self, message: str, *, url: str = "", path: str = "", status: int | None = None):
        super().__init__(message, url=url, path=path)
        self.status = status


# ---- typed results --------------------------------------------------------------------------

class FinishReason(msgspec.Struct, omit_defaults=True):
    type: Literal["stop", "length", "abort"]
    length: int | None = None             # "length"
    matched: int | str | None = None      # "stop": the token id or stop string
    message: str | None = None            # "abort"
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(msgspec.Struct, omit_defaults=True):
    """SGLang's span: output positions [start, end) came from weights `version` (a string)."""
    version: str
    start: int
    end: int


class GenerateResult(msgspec.Struct, kw_only=True):
    rid: str
    output_ids: list[int]
    text: str = ""
    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[float] | None = None       # one per output token
    input_logprobs: list[float | None] | None = None  # from logprob_start_len; the first may be None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    weight_version: str = ""
    weight_versions: list[WeightVersionSpan] = []
    routed_experts: np.ndarray | None = None         # int32 (tokens-1-start, layers, top_k)
    num_retractions: int = 0
    e2e_latency_s: float = 0.0
    meta_info: dict[str, Any] = {}                    # everything else the engine said

    @property
    def aborted(self) -> bool:
        return self.finish_reason.type == "abort"

    def version_spans(self) -> list[VersionSpan]:
        """The spans as wire `VersionSpan`s (integer versions; "default" == 0)."""
        return [VersionSpan(parse_weight_version(s.version), s.start, s.end) for s in self.weight_versions]


def parse_weight_version(version: str) -> int:
    if version == "default":
        return 0
    try:
        return int(version)
    except ValueError:
        raise ValueError(f"weight_version: {version!r} is not an integer policy version "
                         "(Miles publishes versions as decimal strings)") from None


def encode_tensor_payload(named_tensors) -> str:
    """`serialized_named_tensors` entry for the embedded engine: base64 of safetensors bytes.

    (Real SGLang expects its own MultiprocessingSerializer payload, which is pickle of CUDA IPC
    handles for colocated engines; build that with SGLang's helper and pass it as is.)
    """
    from safetensors.torch import save
    items = dict(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
    return base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in items.items()})).decode()


def _sampling_body(params) -> dict:
    if params is None:
        return {}
    if isinstance(params, SamplingParams):
        return msgspec.to_builtins(params)
    body = {}
    for k, v in dict(params).items():
        if k not in SAMPLING_KEYS:
            hint = f"; SGLang calls it {_RENAMES[k]!r}" if k in _RENAMES else ""
            raise ValueError(f"sampling_params.{k}: not an SGLang sampling parameter{hint}")
        if v is not None:
            body[k] = v
    return body


# ---- the client -----------------------------------------------------------------------------

class EngineClient:
    """One engine (or smg gateway) base URL. Use as `async with EngineClient(url) as c:`."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, generate_timeout_s: float | None = None,
                 weight_update_timeout_s: float = 1800.0, connect_timeout_s: float = 10.0,
                 max_retries: int = 3, backoff_s: float = 0.2, headers: dict[str, str] | None = None,
                 routed_experts_layout: tuple[int, int] | None = None,
                 session: aiohttp.ClientSession | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.generate_timeout_s = timeout_s, generate_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.headers = dict(headers or {})
        self.routed_experts_layout = routed_experts_layout
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No pool limit: a rollout worker keeps hundreds of generates in flight per engine.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    # ---- transport ---------------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, body: Any = None, timeout_s: float | None,
                       retry: bool, headers: dict[str, str] | None = None, expect: str = "json"):
        url = self.base_url + path
        data = None if body is None else msgspec.json.encode(body)
        hdrs = {**self.headers, **(headers or {})}
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        attempts = 1 + (self.max_retries if retry else 0)
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._sess().request(method, url, data=data, headers=hdrs, timeout=timeout) as r:
                    raw = await r.read()
                    if r.status >= 500:
                        last = EngineUnavailable(f"{path}: HTTP {r.status}: {_server_message(raw)}",
                                                 url=self.base_url, path=path, status=r.status)
                        if retry and r.status in (502, 503, 504):
                            continue
                        raise last
                    if r.status >= 400:
                        raise EngineRequestError(r.status, _server_message(raw), url=self.base_url,
                                                 path=path, body=_try_json(raw))
                    if expect == "json":
                        return _try_json(raw) if raw else None
                    return raw.decode(errors="replace")
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = e
                if not retry:
                    break
            except asyncio.TimeoutError:
                raise EngineUnavailable(f"{path}: no answer within {timeout_s} s", url=self.base_url,
                                        path=path) from None
        if isinstance(last, EngineUnavailable):
            raise last
        raise EngineUnavailable(f"{path}: {type(last).__name__}: {last} (after {attempts} attempt(s))",
                                url=self.base_url, path=path) from last

    # ---- generate ----------------------------------------------------------------------------

    def _generate_body(self, input_ids, text, sampling_params, return_logprob, logprob_start_len,
                       top_logprobs_num, return_text_in_logprobs, return_routed_experts,
                       routed_experts_start_len, rid, session_id, extra) -> dict:
        if (input_ids is None) == (text is None):
            raise ValueError("generate: pass exactly one of input_ids / text")
        body: dict[str, Any] = {"sampling_params": _sampling_body(sampling_params)}
        if input_ids is not None:
            body["input_ids"] = np.asarray(input_ids, dtype=np.int64).tolist()  # C loop, not per element
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        if return_logprob:
            body["return_logprob"] = True
            if logprob_start_len is not None:
                body["logprob_start_len"] = logprob_start_len
            if top_logprobs_num:
                body["top_logprobs_num"] = top_logprobs_num
            if return_text_in_logprobs:
                body["return_text_in_logprobs"] = True
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = routed_experts_start_len
        if session_id is not None:
            body["session_id"] = session_id
        body.update(extra or {})
        return body

    async def generate(self, input_ids: list[int] | np.ndarray | None = None, sampling_params=None, *,
                       text: str | None = None, return_logprob: bool = False,
                       logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                       return_text_in_logprobs: bool = False, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0, rid: str | None = None,
                       routing_key: str | None = None, session_id: str | None = None,
                       headers: dict[str, str] | None = None, timeout_s: float | None = None,
                       extra: dict[str, Any] | None = None) -> GenerateResult:
        """One `/generate` call (never retried: it may have run). Token in, token out."""
        body = self._generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len,
                                   top_logprobs_num, return_text_in_logprobs, return_routed_experts,
                                   routed_experts_start_len, rid, session_id, extra)
        hdrs = dict(headers or {})
        if routing_key is not None:
            hdrs[ROUTING_KEY_HEADER] = routing_key
        raw = await self._request("POST", "/generate", body=body, headers=hdrs, retry=False,
                                  timeout_s=timeout_s if timeout_s is not None else self.generate_timeout_s)
        if isinstance(raw, list):
            raise EngineError("/generate: got a list for one prompt (sampling_params.n > 1); call "
                              "generate once per sample, with distinct sampling_seed values",
                              url=self.base_url, path="/generate")
        layout = await self._layout() if return_routed_experts else None
        return self.parse_generate(raw, layout)

    async def generate_stream(self, input_ids=None, sampling_params=None, *, text=None,
                              return_logprob: bool = False, rid: str | None = None,
                              routing_key: str | None = None,
                              timeout_s: float | None = None) -> AsyncIterator[GenerateResult]:
        """`stream: true`: yields cumulative partial results, the last one has a finish_reason."""
        body = self._generate_body(input_ids, text, sampling_params, return_logprob, None, 0, False,
                                   False, 0, rid, None, {"stream": True})
        hdrs = {**self.headers, "Content-Type": "application/json"}
        if routing_key is not None:
            hdrs[ROUTING_KEY_HEADER] = routing_key
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.generate_timeout_s,
                                        sock_connect=self.connect_timeout_s)
        try:
            async with self._sess().post(self.base_url + "/generate", data=msgspec.json.encode(body),
                                         headers=hdrs, timeout=timeout) as r:
                if r.status >= 400:
                    raw = await r.read()
                    cls = EngineRequestError if r.status < 500 else None
                    if cls:
                        raise EngineRequestError(r.status, _server_message(raw), url=self.base_url,
                                                 path="/generate", body=_try_json(raw))
                    raise EngineUnavailable(f"/generate: HTTP {r.status}: {_server_message(raw)}",
                                            url=self.base_url, path="/generate", status=r.status)
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    obj = json.loads(payload)
                    if "error" in obj:
                        raise EngineUnavailable(f"/generate stream: {_server_message(payload)}",
                                                url=self.base_url, path="/generate")
                    yield self.parse_generate(obj, None, partial=True)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise EngineUnavailable(f"/generate stream: {type(e).__name__}: {e}", url=self.base_url,
                                    path="/generate") from e
        except asyncio.TimeoutError:
            raise EngineUnavailable("/generate stream: timed out", url=self.base_url,
                                    path="/generate") from None

    async def _layout(self) -> tuple[int, int] | None:
        if self.routed_experts_layout is None:
            info = await self.model_info()
            if info.get("num_hidden_layers") and info.get("num_experts_per_tok"):
                self.routed_experts_layout = (int(info["num_hidden_layers"]), int(info["num_experts_per_tok"]))
        return self.routed_experts_layout

    @staticmethod
    def parse_generate(obj: dict, layout: tuple[int, int] | None = None,
                       partial: bool = False) -> GenerateResult:
        """SGLang's /generate JSON -> GenerateResult (the only parser of that shape)."""
        meta = dict(obj.get("meta_info") or {})
        out_ids = list(obj.get("output_ids") or [])
        fr = meta.pop("finish_reason", None)
        if fr is None and not partial:
            raise EngineError(f"/generate: response without meta_info.finish_reason: {str(obj)[:200]}")
        finish = msgspec.convert(fr, FinishReason) if fr else FinishReason(type="length", length=len(out_ids))
        olp = meta.pop("output_token_logprobs", None)
        ilp = meta.pop("input_token_logprobs", None)
        top = meta.pop("output_top_logprobs", None)
        version = str(meta.pop("weight_version", "") or "")
        spans_raw = meta.pop("weight_versions", None)
        spans = ([WeightVersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans_raw]
                 if spans_raw else ([WeightVersionSpan(version, 0, len(out_ids))] if out_ids else []))
        routed = meta.pop("routed_experts", None)
        routed_arr = None
        if routed is not None:
            if layout is None:
                raise EngineError("meta_info.routed_experts: unknown (layers, top_k); pass "
                                  "routed_experts_layout=(num_hidden_layers, num_experts_per_tok) to "
                                  "EngineClient (see routed_experts_layout_from_config)")
            routed_arr = decode_routed_experts(routed, layout)
        return GenerateResult(
            rid=str(meta.pop("id", "")), output_ids=out_ids, text=obj.get("text") or "",
            finish_reason=finish, prompt_tokens=int(meta.pop("prompt_tokens", 0) or 0),
            completion_tokens=int(meta.pop("completion_tokens", len(out_ids)) or 0),
            cached_tokens=int(meta.pop("cached_tokens", 0) or 0),
            output_logprobs=[float(e[0]) for e in olp] if olp is not None else None,
            input_logprobs=[None if e[0] is None else float(e[0]) for e in ilp] if ilp is not None else None,
            output_top_logprobs=[[(float(e[0]), int(e[1])) for e in pos] for pos in top] if top else None,
            weight_version=version, weight_versions=spans, routed_experts=routed_arr,
            num_retractions=int(meta.pop("num_retractions", 0) or 0),
            e2e_latency_s=float(meta.pop("e2e_latency", 0.0) or 0.0), meta_info=meta)

    # ---- control -----------------------------------------------------------------------------

    async def _post(self, path: str, body: dict, *, retry: bool = True, timeout_s: float | None = None,
                    expect: str = "json"):
        return await self._request("POST", path, body=body, retry=retry, expect=expect,
                                   timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    async def _get(self, path: str, expect: str = "json"):
        return await self._request("GET", path, timeout_s=self.timeout_s, retry=True, expect=expect)

    async def health(self) -> bool:
        """True when `/health` answers 200; False on 5xx or no answer (never raises for those)."""
        try:
            await self._request("GET", "/health", timeout_s=self.timeout_s, retry=False, expect="text")
            return True
        except EngineUnavailable:
            return False

    async def health_generate(self) -> bool:
        try:
            await self._request("GET", "/health_generate", timeout_s=self.timeout_s, retry=False,
                                expect="text")
            return True
        except EngineUnavailable:
            return False

    async def model_info(self) -> dict:
        return await self._get("/model_info")

    async def server_info(self) -> dict:
        return await self._get("/server_info")

    async def get_load(self):
        return await self._get("/get_load")

    async def pause_generation(self, mode: Literal["in_place", "retract", "abort"] = "in_place") -> dict:
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"mode: {mode!r} is not one of 'in_place', 'retract', 'abort'")
        return await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._post("/continue_generation", {})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request: pass a rid or abort_all=True")
        await self._post("/abort_request", {"abort_all": True} if abort_all else {"rid": rid},
                         expect="text")

    async def flush_cache(self) -> str:
        return await self._post("/flush_cache", {}, expect="text")

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | int | None = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       load_format: str | None = None) -> dict:
        body = {"model_path": str(model_path), "abort_all_requests": abort_all_requests,
                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._post("/update_weights_from_disk", body, timeout_s=self.weight_update_timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        return await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend},
            retry=False, timeout_s=self.weight_update_timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group",
                                              weight_version: str | int | None = None,
                                              flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              load_format: str | None = None,
                                              bucket_seq: int | None = None,
                                              flat_count: int | None = None) -> dict:
        """Tell the engine to receive these tensors; the trainer broadcasts them (src 0) meanwhile.

        `load_format="flattened_bucket"`: the trainer broadcasts ONE flat tensor (all of one dtype,
        the tensors back to back in `names` order) instead of one broadcast per tensor.
        `bucket_seq` (embedded engines only): the engine posts this receive only after the one
        numbered `bucket_seq - 1` (0 starts a sequence), so several calls may be in flight.
        `load_format="miles_direct"` (embedded engines only): the first `flat_count` tensors come
        as one flat broadcast, then each of the others as its own broadcast, all in one group;
        the engine receives those straight into its parameters.
        """
        body = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        if bucket_seq is not None:
            body["bucket_seq"] = int(bucket_seq)
        if flat_count is not None:
            body["flat_count"] = int(flat_count)
        return await self._post("/update_weights_from_distributed", body, retry=False,
                                timeout_s=self.weight_update_timeout_s)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *,
                                         load_format: str | None = None,
                                         weight_version: str | int | None = None,
                                         flush_cache: bool = True,
                                         abort_all_requests: bool = False) -> dict:
        """`serialized_named_tensors`: one payload per TP rank (`encode_tensor_payload` for ours)."""
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_tensor", body, timeout_s=self.weight_update_timeout_s)

    async def ipc_weight_targets(self, token: str = "") -> dict:
        """Miles' embedded engine: its weight storages by CUDA IPC (miles.weights.cuda_ipc.IpcTargets);
        with the `token` of the mapping the caller holds, only whether it is still this engine's."""
        return await self._get("/ipc_weight_targets" + (f"?token={token}" if token else ""))

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False) -> dict:
        # SGLang defaults abort_all_requests to True; Miles never wants that implicitly.
        return await self._post("/update_weight_version", {"new_version": str(new_version),
                                                           "abort_all_requests": abort_all_requests})

    async def update_weights_from_delta(self, phase: Literal["prepare", "apply", "discard", "rollback"],
                                        path: str = "", *, weight_version: str | int | None = None,
                                        threads: int | None = None, keep_previous: bool = False,
                                        timeout_s: float | None = None) -> dict:
        """Embedded-engine extension (disk-delta updates): `prepare` decodes and verifies the delta
        at `path` while generation continues (on `threads` threads); `apply` swaps it in;
        `discard` drops it."""
        body: dict[str, Any] = {"phase": phase, "path": str(path)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if threads is not None:
            body["threads"] = threads
        if keep_previous:   # the previous version stays for `rollback` (fleet-atomic commits)
            body["keep_previous"] = True
        return await self._post("/update_weights_from_delta", body, retry=False,
                                timeout_s=self.weight_update_timeout_s if timeout_s is None else timeout_s)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return await self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def weights_checksum(self, names: list[str] | None = None,
                               algorithm: str = "sha256") -> dict[str, str]:
        """Embedded-engine extension: {checkpoint name: digest}. "sha256": see `miles.weights.checks.tensor_sha256`;
        "device": miles.weights.checks.device_digest, computed on the engine's device."""
        query = [f"names={','.join(names)}"] if names else []
        if algorithm != "sha256":
            query.append(f"algorithm={algorithm}")
        q = ("?" + "&".join(query)) if query else ""
        return (await self._get("/weights_checksum" + q))["checksums"]


def _try_json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw.decode(errors="replace")


def _server_message(raw: bytes) -> str:
    """The server's own words, from either of SGLang's error shapes or plain text."""
    obj = _try_json(raw)
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(obj)[:2000]
