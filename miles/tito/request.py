"""One chat turn as both APIs ask for it, and its sampling parameters in SGLang's names.

Design decisions:
- OpenAI and Anthropic requests decode into one `ChatRequest`; the turn logic never sees either
  wire format.
- Sampling parameters are validated here and renamed to SGLang's `sampling_params` keys
  (`max_tokens` -> `max_new_tokens`, `seed` -> `sampling_seed`, and the common extensions
  `min_tokens` -> `min_new_tokens`, `ignore_eos`, `top_k`, `min_p`): SGLang's contract gate rejects
  unknown keys, so only keys it knows are ever sent. Fields that only label a request (`model`,
  `user`, `metadata`, `store`, `parallel_tool_calls`) are ignored, as OpenAI-compatible servers do.
- Fields that would change what the model may say are honoured or refused, never ignored:
  `logprobs` / `top_logprobs` are honoured (the engine returns a top-k per position);
  `response_format` other than `text` and `tool_choice` `required` / a named function are refused
  (the engine has no constrained decoding, and a prefilled tool-call opener would hide the
  model's own choice from the trajectory). `tool_choice: none` is honoured without changing the
  prompt: tools are still rendered (the prompt, and so the session's prefix, stays the one every
  other turn extends) and the reply is not parsed for tool calls, so any call markup the model
  writes anyway stays in `content`, exactly as it was generated.
- `n` must be 1: each sample of a task is its own session (or its own request), which is what
  keeps every branch of the trajectory tree addressable.
- Flags are JSON booleans, numbers JSON numbers: `"stream": "yes"` or `"n": true` is refused with
  the field and value, never read by Python truthiness.
"""

from __future__ import annotations

from typing import Any

import msgspec

from miles.tito.messages import ChatMessage, RequestError, _short


class ChatRequest(msgspec.Struct, kw_only=True):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = {}          # SGLang sampling_params, without max_new_tokens
    max_tokens: int | None = None
    stream: bool = False
    options: dict[str, Any] = {}           # template options (enable_thinking)
    return_routed_experts: bool = False
    model: str = ""
    logprobs: bool = False                 # OpenAI: token logprobs in the reply
    include_usage: bool = False            # OpenAI: stream_options.include_usage
    top_logprobs: int = 0                  # alternatives per position in the reply's logprobs
    tool_choice: str = "auto"              # "auto" | "none" (others are refused at decode)
    sources: list[Any] = []                # history.Source per message: where it sat in the request
    echo: dict[str, Any] = {}              # request fields an API repeats in its reply (Responses)


def number(body: dict, name: str, lo: float | None = None, hi: float | None = None,
           integer: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{name}: expected {kind}, got {_short(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name}: {value!r} is outside [{lo}, {hi}]", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected a boolean, got {_short(value)}", name)
    return value


def stop_strings(value: Any, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return value
    raise RequestError(f"{name}: expected a string or a list of non-empty strings, got {_short(value)}", name)


def sampling_params(body: dict, stop_field: str = "stop") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                         ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                         ("repetition_penalty", 0.0, None)):
        v = number(body, name, lo, hi)
        if v is not None:
            out[name] = float(v)
    if out.get("top_p") == 0.0:
        raise RequestError("top_p: 0 would sample from an empty set; expected (0, 1]", "top_p")
    top_k = number(body, "top_k", -1, None, integer=True)
    if top_k is not None:
        out["top_k"] = top_k
    seed = number(body, "seed", None, None, integer=True)
    if seed is not None:
        out["sampling_seed"] = seed
    min_tokens = number(body, "min_tokens", 0, None, integer=True)
    if min_tokens:
        out["min_new_tokens"] = min_tokens
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = boolean(body, "ignore_eos")
    stop = stop_strings(body.get(stop_field), stop_field)
    if stop:
        out["stop"] = stop
    return out


MAX_TOP_LOGPROBS = 20   # OpenAI's limit; the engine allows more


def top_logprobs(body: dict, name: str = "top_logprobs") -> int:
    n = number(body, name, 0, MAX_TOP_LOGPROBS, integer=True)
    return int(n or 0)


def tool_choice(value, field: str) -> str:
    """`auto` or `none`; `required` / `any` / a named tool are refused with the field."""
    kind = value.get("type") if isinstance(value, dict) else value
    if value is None or kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind in ("required", "any", "function", "tool"):
        raise RequestError(f"{field}: {_short(value)} is not supported: the engine cannot force a tool call "
                           f"(no constrained decoding); use \"auto\" and check the reply, or \"none\"", field)
    raise RequestError(f"{field}: {_short(value)} is not one of ['auto', 'none']", field)


def response_format(value, field: str) -> None:
    """Only plain text: JSON modes need constrained decoding, which the engine lacks."""
    kind = value.get("type") if isinstance(value, dict) else value
    if value is None or kind == "text":
        return
    if kind in ("json_schema", "json_object"):
        raise RequestError(f"{field}.type: {kind!r} is not supported (the engine has no constrained "
                           f"decoding); ask for JSON in the prompt and parse the text", f"{field}.type")
    raise RequestError(f"{field}: {_short(value)} is not one of [{{'type': 'text'}}]", field)


def max_tokens(body: dict, *names: str, required: bool = False) -> int | None:
    for name in names:
        v = number(body, name, 1, None, integer=True)
        if v is not None:
            return int(v)
    if required:
        raise RequestError(f"{names[0]}: required, got missing", names[0])
    return None
