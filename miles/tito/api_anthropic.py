"""Anthropic Messages API (`/v1/messages`): the door Claude-Code-style harnesses knock on.

Design decisions:
- Requests decode into the same `ChatMessage` list as OpenAI ones: `system` (a string or text
  blocks, joined with "\n") becomes the first message; `tool_result` blocks in a user turn become
  `tool` messages (in block order, text between them becomes user messages); an assistant turn's
  `thinking` blocks become reasoning, its `text` blocks content and its `tool_use` blocks tool
  calls. Since the reply we send is converted back the same way when the harness echoes it, the
  prefix lookup matches it like an OpenAI turn.
- Tools `{name, description, input_schema}` are handed to the template in OpenAI's function form
  (what chat templates expect). Server-side tool types (web search, computer use) are refused.
- Streaming (`stream: true`, which Claude Code always uses) replays the finished turn as the
  standard event sequence: message_start, one start/delta/stop triple per content block,
  message_delta with the stop reason, message_stop.
- `tool_choice` `auto` and `none` are honoured (`none`: tools rendered, the reply not parsed for
  calls); `any` and a named `tool` are refused, as the engine cannot force a call. Each
  ChatMessage keeps its `Source` (`messages[2].content[1]` for a tool_result block) so a
  malformed history is refused at the request's own index. `count_tokens` decodes the same body
  without `max_tokens` and answers the prompt length the turn would have.
- Errors use Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`. As in
  Anthropic's API, `max_tokens` is required; a text block's `text` must be a string, `system`
  holds text blocks only, a tool's `input_schema` is an object, `thinking.type` is `enabled` or
  `disabled`, and flags are booleans.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles.tito.families.base import Reply
from miles.tito.history import Source
from miles.tito.messages import ChatMessage, RequestError, ToolCall, _short, check_tool_schema, text_of
from miles.tito.request import ChatRequest, boolean, max_tokens, sampling_params, tool_choice

_NON_TEXT = ("image", "document", "search_result")


def _blocks(content: Any, field: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{field}: expected a string or a list of content blocks, got {_short(content)}", field)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{field}[{j}]: expected a content block object, got {_short(block)}", f"{field}[{j}]")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise RequestError(f"{field}[{j}].text: expected a string, got {_short(block.get('text'))}",
                               f"{field}[{j}].text")
    return content


def _user_messages(content: Any, field: str, path: str) -> tuple[list[ChatMessage], list[Source]]:
    out: list[ChatMessage] = []
    sources: list[Source] = []
    text: list[str] = []

    def flush():
        if text:
            out.append(ChatMessage(role="user", content="".join(text)))
            sources.append(Source(path))
            text.clear()

    for j, block in enumerate(_blocks(content, field)):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "tool_result":
            flush()
            out.append(ChatMessage(role="tool", content=text_of(block.get("content"), f"{field}[{j}].content"),
                                   tool_call_id=str(block.get("tool_use_id") or "")))
            sources.append(Source(f"{field}[{j}]", f"{field}[{j}].tool_use_id"))
        else:
            raise RequestError(f"{field}[{j}].type: {kind!r} is not supported in a user turn "
                               f"(expected text or tool_result)", f"{field}[{j}].type")
    flush()
    return out, sources


def _assistant_message(content: Any, field: str, path: str) -> tuple[ChatMessage, Source]:
    text, reasoning, calls, call_paths = [], None, [], []
    for j, block in enumerate(_blocks(content, field)):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "thinking":
            reasoning = (reasoning or "") + str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            args = block.get("input", {})
            if not isinstance(args, dict) or not isinstance(block.get("name"), str):
                raise RequestError(f"{field}[{j}]: tool_use needs a string name and an object input, got "
                                   f"{_short(block)}", f"{field}[{j}]")
            calls.append(ToolCall(name=block["name"], arguments=args, id=str(block.get("id") or "")))
            call_paths.append(f"{field}[{j}]")
        else:
            raise RequestError(f"{field}[{j}].type: {kind!r} is not supported in an assistant turn",
                               f"{field}[{j}].type")
    return (ChatMessage(role="assistant", content="".join(text), reasoning=reasoning, tool_calls=calls),
            Source(path, call_paths=tuple(call_paths)))


def _tools(raw: Any) -> list[dict] | None:
    if not raw:
        return None
    if not isinstance(raw, list):
        raise RequestError(f"tools: expected a list, got {_short(raw)}", "tools")
    out = []
    for k, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{k}].name: expected a string, got {_short(tool)}", f"tools[{k}].name")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(f"tools[{k}].type: server tool {tool['type']!r} is not supported; "
                               f"declare it as a custom tool", f"tools[{k}].type")
        check_tool_schema(tool.get("input_schema"), tool.get("description"), f"tools[{k}]", "input_schema")
        fn = {"name": tool["name"], "description": tool.get("description", ""),
              "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
        out.append({"type": "function", "function": fn})
    return out


def parse_messages_request(body: Any, count_only: bool = False) -> ChatRequest:
    """A `/v1/messages` body (or, `count_only`, a `count_tokens` one: no max_tokens)."""
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {_short(body)}", "body")
    messages: list[ChatMessage] = []
    sources: list[Source] = []
    system = body.get("system")
    if system:
        blocks = _blocks(system, "system")
        for j, b in enumerate(blocks):
            if b["type"] != "text":
                raise RequestError(f"system[{j}].type: {b['type']!r} is not supported (expected text)",
                                   f"system[{j}].type")
        messages.append(ChatMessage(role="system", content="\n".join(b["text"] for b in blocks)))
        sources.append(Source("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"messages: expected a non-empty list, got {_short(raw)}", "messages")
    for i, m in enumerate(raw):
        field = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            more, where = _user_messages(m.get("content"), f"{field}.content", field)
            messages += more
            sources += where
        elif role == "assistant":
            message, where = _assistant_message(m.get("content"), f"{field}.content", field)
            messages.append(message)
            sources.append(where)
        else:
            raise RequestError(f"{field}.role: {_short(role)} is not one of ['user', 'assistant']", f"{field}.role")
    options = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise RequestError(f"thinking: expected {{\"type\": \"enabled\" | \"disabled\", ...}}, got "
                               f"{_short(thinking)}", "thinking")
        if thinking["type"] == "disabled":
            options["enable_thinking"] = False
    return ChatRequest(messages=messages, sources=sources, tools=_tools(body.get("tools")),
                       tool_choice=tool_choice(body.get("tool_choice"), "tool_choice"),
                       sampling=sampling_params(body, "stop_sequences"),
                       max_tokens=max_tokens(body, "max_tokens", required=not count_only),
                       stream=boolean(body, "stream"),
                       options=options, return_routed_experts=boolean(body, "return_routed_experts"),
                       model=str(body.get("model") or ""))


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
                       "name": call.name, "input": call.arguments})
    return blocks


def message_response(req: ChatRequest, reply: Reply, turn: dict[str, Any]) -> dict[str, Any]:
    finish = turn["finish_reason"] or {}
    matched = finish.get("matched")
    if finish.get("type") == "length":
        stop_reason, stop_sequence = "max_tokens", None
    elif reply.tool_calls:
        stop_reason, stop_sequence = "tool_use", None
    elif isinstance(matched, str) and matched in (req.sampling.get("stop") or []):
        stop_reason, stop_sequence = "stop_sequence", matched
    else:
        stop_reason, stop_sequence = "end_turn", None
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
            "model": req.model or "miles", "content": content_blocks(reply),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": turn["prompt_tokens"], "output_tokens": turn["completion_tokens"]},
            "miles": turn}


def stream_events(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs replaying a finished message as Anthropic's SSE stream."""
    head = {**response, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": response["usage"]["input_tokens"], "output_tokens": 0}}
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": head})]
    for i, block in enumerate(response["content"]):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif block["type"] == "thinking":
            start, delta = {"type": "thinking", "thinking": ""}, {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": response["stop_reason"],
                                               "stop_sequence": response["stop_sequence"]},
                                     "usage": {"output_tokens": response["usage"]["output_tokens"]}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
