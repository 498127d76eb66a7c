"""OpenAI chat completions: decode a request into a `ChatRequest`, encode a turn as a reply.

Design decisions:
- Non-streaming is the primary path. `stream: true` is served by emitting the finished turn as
  a short sequence of `chat.completion.chunk` events (role, reasoning, content, tool calls,
  finish, optional usage, `[DONE]`): agents that insist on streaming work, and the tokens we
  record are the same either way.
- `reasoning_content` carries the parsed reasoning (SGLang's and vLLM's field name);
  `content` is null when a turn is only tool calls, as OpenAI does.
- `logprobs` / `top_logprobs` are the engine's (top-k per position, asked of the engine only
  when wanted); when streaming they ride on the chunk that carries the content (or the finish
  chunk of a reply that is only tool calls). `token` is the token's decoded text and `bytes`
  its UTF-8 bytes.
- The extension block `miles` in each reply names the session and tree node and says how many
  tokens this turn appended, which is what the tests and debugging need.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from miles.tito.families.base import Reply
from miles.tito.history import openai_sources
from miles.tito.messages import RequestError, _short, parse_openai_messages, parse_openai_tools
from miles.tito.request import (ChatRequest, boolean, max_tokens, number, response_format, sampling_params,
                                tool_choice, top_logprobs)

# (token text, logprob, [(alternative text, logprob), ...]) per output position
TokenLogprobs = list[tuple[str, float, list[tuple[str, float]]]]


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {_short(body)}", "body")
    if number(body, "n", integer=True) not in (None, 1):
        raise RequestError(f"n: only 1 choice per request is supported, got {_short(body['n'])}; "
                           f"send one request per sample", "n")
    stream_options = body.get("stream_options")
    stream_options = {} if stream_options is None else stream_options
    if not isinstance(stream_options, dict):
        raise RequestError(f"stream_options: expected an object, got {_short(stream_options)}", "stream_options")
    if stream_options.get("include_usage") is not None and not isinstance(stream_options["include_usage"], bool):
        raise RequestError(f"stream_options.include_usage: expected a boolean, got "
                           f"{_short(stream_options['include_usage'])}", "stream_options.include_usage")
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs: expected an object, got {_short(kwargs)}", "chat_template_kwargs")
    options = {}
    if "enable_thinking" in kwargs:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise RequestError(f"chat_template_kwargs.enable_thinking: expected a boolean, got "
                               f"{_short(kwargs['enable_thinking'])}", "chat_template_kwargs.enable_thinking")
        options["enable_thinking"] = kwargs["enable_thinking"]
    logprobs, top = boolean(body, "logprobs"), top_logprobs(body)
    if top and not logprobs:
        raise RequestError(f"top_logprobs: {top} needs \"logprobs\": true", "top_logprobs")
    response_format(body.get("response_format"), "response_format")
    tools = parse_openai_tools(body.get("tools"))
    messages = parse_openai_messages(body.get("messages"))
    return ChatRequest(messages=messages, sources=openai_sources(len(messages)), tools=tools,
                       tool_choice=tool_choice(body.get("tool_choice"), "tool_choice"),
                       top_logprobs=top,
                       sampling=sampling_params(body, "stop"),
                       max_tokens=max_tokens(body, "max_completion_tokens", "max_tokens"),
                       stream=boolean(body, "stream"), options=options,
                       return_routed_experts=boolean(body, "return_routed_experts"),
                       model=str(body.get("model") or ""), logprobs=logprobs,
                       include_usage=bool(stream_options.get("include_usage")))


def finish_reason(engine_finish: dict, reply: Reply) -> str:
    kind = (engine_finish or {}).get("type")
    if kind == "length":
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def reply_message(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant",
                           "content": reply.content if (reply.content or not reply.tool_calls) else None}
    if reply.reasoning is not None:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_json()}}
                             for c in reply.tool_calls]
    return msg


def logprob_entries(token_logprobs: TokenLogprobs) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()),
             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in tops]}
            for t, lp, tops in token_logprobs]


def chat_response(req: ChatRequest, reply: Reply, turn: dict[str, Any],
                  token_logprobs: TokenLogprobs | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": reply_message(reply),
                              "finish_reason": finish_reason(turn["finish_reason"], reply), "logprobs": None}
    if token_logprobs is not None:
        choice["logprobs"] = {"content": logprob_entries(token_logprobs), "refusal": None}
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": req.model or "miles", "choices": [choice],
            "usage": {"prompt_tokens": turn["prompt_tokens"], "completion_tokens": turn["completion_tokens"],
                      "total_tokens": turn["prompt_tokens"] + turn["completion_tokens"]},
            "miles": turn}


def stream_chunks(response: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """The finished reply as chat.completion.chunk objects (send each as one SSE `data:` line)."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    choice = response["choices"][0]
    msg = choice["message"]

    logprobs = choice.get("logprobs")

    def chunk(delta: dict, finish: str | None = None, with_logprobs: bool = False) -> dict:
        c = {"index": 0, "delta": delta, "finish_reason": finish}
        if with_logprobs and logprobs is not None:
            c["logprobs"] = logprobs
        return {**base, "choices": [c]}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("reasoning_content"):
        out.append(chunk({"reasoning_content": msg["reasoning_content"]}))
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}, with_logprobs=True))
    for i, call in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, choice["finish_reason"], with_logprobs=not msg.get("content")))
    if include_usage:
        out.append({**base, "choices": [], "usage": response["usage"]})
    return out
