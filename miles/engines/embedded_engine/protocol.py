"""SGLang's native HTTP bodies as msgspec Structs (server side), and request validation.

Design decisions:
- Field names and defaults are SGLang's (`sglang.api.v1` / `io_struct.py`, 0.5.23). Like SGLang's
  JSON contract gate, unknown keys inside `sampling_params` are rejected (so an OpenAI-style
  `max_tokens` fails loudly) while unknown top-level keys are ignored (smg adds `"model"` etc.).
- Sampling features SGLang has but this engine does not (penalties, grammars, regex stops, beam
  search) are *known* keys: a non-default value gets a 400 that says so, never a silent no-op.
- Every error names the field and the value; the server turns `BadRequest` into
  `{"error": {"message", "type", "param", "code"}}` with HTTP 400.
- Fields that multiply work or memory are bounded by `RequestLimits` (server arguments, defaults
  below), checked before anything is tokenized, allocated or queued: a 60-byte request must not
  be able to cost seconds or gigabytes. SGLang bounds only the token counts (prompt < context,
  prompt + max_new_tokens against the context, same wording); the fan-out limits are ours.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from miles.engines.embedded_engine.sampling import TOP_K_ALL


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request bounds (the server's `--max-*` arguments; engine docstring in embedded.py)."""
    max_n: int = 64                          # sampling_params.n
    max_batch_size: int = 1024               # requests one call fans out to: prompts x n
    max_top_logprobs_num: int = 64           # top_logprobs_num (a top-k per token and position)
    max_prompt_logprob_tokens: int = 4096    # prompt positions with logprobs ([T, V] fp32 logits)
    max_stop: int = 64                       # entries of stop, of stop_token_ids, of logit_bias

    def over(self, field: str, value: int, limit_name: str, what: str = "") -> BadRequest:
        limit = getattr(self, limit_name)
        return BadRequest(f"{field}: {value}{what} exceeds the server's limit of {limit} "
                          f"(--{limit_name.replace('_', '-')})", field)


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    beam_width: int | None = None
    watermark: Any = None
    choice: Any = None

    def check(self, vocab_size: int, where: str = "sampling_params",
              limits: RequestLimits = RequestLimits()) -> None:
        """Semantic checks SGLang's `SamplingParams.verify` makes, our bounds, and what we don't
        support."""
        def bad(field, value, expected):
            raise BadRequest(f"{where}.{field}: {value!r} is invalid; {expected}", f"{where}.{field}")
        if self.n > limits.max_n:
            raise limits.over(f"{where}.n", self.n, "max_n")
        stops = (self.stop,) if isinstance(self.stop, str) else (self.stop or ())
        for field, entries in (("stop", stops), ("stop_token_ids", self.stop_token_ids or ()),
                               ("logit_bias", self.logit_bias or {})):
            if len(entries) > limits.max_stop:  # matched or applied on every decode step
                raise limits.over(f"{where}.{field}", len(entries), "max_stop", " entries")
        if self.temperature < 0:
            bad("temperature", self.temperature, "expected >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "expected in (0, 1]")
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.top_k < 1:
            bad("top_k", self.top_k, "expected >= 1 or -1 (all)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "expected in [0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad("max_new_tokens", self.max_new_tokens, "expected >= 0")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", self.min_new_tokens, "expected >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", self.min_new_tokens, f"expected <= max_new_tokens ({self.max_new_tokens})")
        if self.n < 1:
            bad("n", self.n, "expected >= 1")
        for t in self.stop_token_ids or ():
            if not 0 <= t < vocab_size:
                bad("stop_token_ids", t, f"token ids must be in [0, {vocab_size})")
        for k, v in (self.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < vocab_size:
                bad("logit_bias", k, f"keys must be token ids in [0, {vocab_size})")
        unsupported = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                       "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                       "stop_regex": None, "beam_width": None, "watermark": None, "choice": None}
        for field, default in unsupported.items():
            value = getattr(self, field)
            if value != default and not (field == "beam_width" and value in (0, 1)):
                raise BadRequest(f"{where}.{field}: {value!r} is not supported by the embedded "
                                 f"engine (only the default {default!r})", f"{where}.{field}")


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    """`POST /generate` (single or batch). Unknown top-level keys are ignored, like SGLang."""
    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    input_embeds: Any = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    return_hidden_states: bool | list[bool] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_prompt_token_ids: bool = False
    session_id: str | None = None
    session_params: Any = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    routing_key: str | None = None
    priority: int | None = None
    model: Any = None


class PauseGenerationReq(msgspec.Struct):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReq(msgspec.Struct):
    torch_empty_cache: bool = True


class AbortReq(msgspec.Struct):
    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None


class UpdateWeightsFromDiskReq(msgspec.Struct):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Any = None


class InitWeightsUpdateGroupReq(msgspec.Struct):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReq(msgspec.Struct):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReq(msgspec.Struct):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False
    bucket_seq: int | None = None  # Miles extension: receive strictly in this order (0 restarts)
    flat_count: int | None = None  # Miles extension, load_format "miles_direct" (weights.py)


class UpdateWeightsFromTensorReq(msgspec.Struct):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class UpdateWeightVersionReq(msgspec.Struct):
    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameReq(msgspec.Struct):
    name: str
    truncate_size: int = 100


def decode_body(raw: bytes, typ, what: str):
    """Decode a JSON body into `typ`; msgspec's message already names the offending path."""
    if not raw.strip():
        raw = b"{}"
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{what}: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"{what}: body is not valid JSON ({e})") from None
