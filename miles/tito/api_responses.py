"""OpenAI Responses API (`/v1/responses`): what NeMo Gym agents and newer Codex speak.

Design decisions:
- `input` (a string, or a list of items) decodes into the same `ChatMessage` list as chat
  completions: `instructions` becomes the first (system) message; `message` items keep their role
  (`developer` is `system`); a `reasoning` item opens an assistant turn and carries its reasoning,
  an assistant `message` gives that turn its content, and `function_call` items are its tool
  calls, until a non-assistant item closes it; a `function_call_output` is a tool message
  answering `call_id`. The reply is encoded in that same order (reasoning, message, function
  calls), so a harness that appends `response.output` to its input matches the recorded turn.
- Tools are `{"type": "function", name, description, parameters}`; they are handed to the
  template in chat-completions form. Hosted tools (web search, file search, computer use, MCP,
  custom grammars) are refused with the field.
- The session is the conversation state: `previous_response_id`, `conversation`, `background`
  and item references need a response store, and are refused with a 400 saying to send the whole
  input. `store` is accepted and ignored (nothing is stored).
- `reasoning.effort` `none`/`minimal` turns thinking off (`enable_thinking: false`); other
  efforts keep the family's default. `text.format` other than `text` is refused (no constrained
  decoding), as is `truncation: auto`.
- Streaming replays the finished turn with the real event names and order (`response.created`,
  `response.in_progress`, per item `response.output_item.added`, its part/delta/done events and
  `response.output_item.done`, then `response.completed`, or `response.incomplete` after a length
  cut), each with its `sequence_number`; the SDK's stream accumulator checks all of that.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from miles.tito.families.base import Reply
from miles.tito.history import Source
from miles.tito.messages import ROLE_ALIASES, ChatMessage, RequestError, ToolCall, _short, check_tool_schema, \
    parse_arguments
from miles.tito.request import (ChatRequest, boolean, max_tokens, number, response_format, sampling_params,
                                tool_choice, top_logprobs)

_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{field}: expected a string or a list of text parts, got {_short(content)}", field)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{field}[{j}]: only text parts ({list(_TEXT_PARTS)}) are supported, got "
                               f"{_short(kind)}", f"{field}[{j}]")
        out.append(part["text"])
    return "".join(out)


class _Items:
    """Folds input items into messages; an assistant turn stays open while its items arrive."""

    def __init__(self):
        self.messages: list[ChatMessage] = []
        self.sources: list[Source] = []
        self.open: ChatMessage | None = None
        self.call_paths: list[str] = []
        self.path = ""

    def close(self) -> None:
        if self.open is not None:
            self.messages.append(self.open)
            self.sources.append(Source(self.path, call_paths=tuple(self.call_paths)))
        self.open, self.call_paths = None, []

    def assistant(self, path: str, fresh: bool) -> ChatMessage:
        if self.open is None or fresh:
            self.close()
            self.open, self.path = ChatMessage(role="assistant"), path
        return self.open

    def add(self, message: ChatMessage, source: Source) -> None:
        self.close()
        self.messages.append(message)
        self.sources.append(source)


def parse_input(raw: Any, instructions: Any) -> tuple[list[ChatMessage], list[Source]]:
    items = _Items()
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError(f"instructions: expected a string, got {_short(instructions)}", "instructions")
        items.add(ChatMessage(role="system", content=instructions), Source("instructions"))
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"input: expected a string or a non-empty list of items, got {_short(raw)}", "input")
    for i, item in enumerate(raw):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{field}: expected an item object, got {_short(item)}", field)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLE_ALIASES.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise RequestError(f"{field}.role: {_short(item.get('role'))} is not one of "
                                   f"['user', 'assistant', 'system', 'developer']", f"{field}.role")
            text = _text(item.get("content"), f"{field}.content")
            if role == "assistant":
                turn = items.open
                fresh = turn is None or bool(turn.content) or bool(turn.tool_calls)
                items.assistant(field, fresh).content = text
            else:
                items.add(ChatMessage(role=role, content=text), Source(field))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary")
            turn = items.assistant(field, fresh=True)
            if parts:   # an item with only encrypted_content carries no text we could render
                turn.reasoning = _text(parts, f"{field}.content")
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise RequestError(f"{field}.name: expected a non-empty string, got {_short(item.get('name'))}",
                                   f"{field}.name")
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{field}.call_id: expected a string, got {_short(item.get('call_id'))}",
                                   f"{field}.call_id")
            args = parse_arguments(item.get("arguments"), f"{field}.arguments")
            turn = items.assistant(field, fresh=False)
            turn.tool_calls = [*turn.tool_calls, ToolCall(name=item["name"], arguments=args, id=item["call_id"])]
            items.call_paths.append(field)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{field}.call_id: expected a string, got {_short(item.get('call_id'))}",
                                   f"{field}.call_id")
            items.add(ChatMessage(role="tool", content=_text(item.get("output"), f"{field}.output"),
                                  tool_call_id=item["call_id"]), Source(field, f"{field}.call_id"))
        else:
            why = " (item references need a response store; send the item itself)" if kind == "item_reference" else ""
            raise RequestError(f"{field}.type: {_short(kind)} is not supported{why}; expected message, reasoning, "
                               f"function_call or function_call_output", f"{field}.type")
    items.close()
    return items.messages, items.sources


def parse_tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise RequestError(f"tools: expected a list, got {_short(raw)}", "tools")
    out = []
    for k, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise RequestError(f"tools[{k}].type: {_short(kind)} is not supported (only function tools)",
                               f"tools[{k}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{k}].name: expected a non-empty string, got {_short(tool.get('name'))}",
                               f"tools[{k}].name")
        check_tool_schema(tool.get("parameters"), tool.get("description"), f"tools[{k}]", "parameters")
        fn = {"name": tool["name"], "description": tool.get("description") or "",
              "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out


def parse_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {_short(body)}", "body")
    for name in _STATEFUL:
        if body.get(name) not in (None, False):
            raise RequestError(f"{name}: not supported: the session is the conversation state and nothing is "
                               f"stored; send the whole conversation as `input`", name)
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError(f"truncation: {_short(body['truncation'])} is not supported (only 'disabled'); a "
                           f"prompt over the context limit is refused", "truncation")
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise RequestError(f"text: expected an object, got {_short(text)}", "text")
    response_format(text.get("format"), "text.format")
    options: dict[str, Any] = {}
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise RequestError(f"reasoning: expected an object, got {_short(reasoning)}", "reasoning")
    if reasoning.get("effort") in ("none", "minimal"):
        options["enable_thinking"] = False
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise RequestError(f"include: expected a list of strings, got {_short(include)}", "include")
    top = top_logprobs(body)
    messages, sources = parse_input(body.get("input"), body.get("instructions"))
    number(body, "max_output_tokens", 1, None, integer=True)
    return ChatRequest(messages=messages, sources=sources, tools=parse_tools(body.get("tools")),
                       tool_choice=tool_choice(body.get("tool_choice"), "tool_choice"),
                       sampling=sampling_params(body, "stop"), max_tokens=max_tokens(body, "max_output_tokens"),
                       stream=boolean(body, "stream"), options=options,
                       return_routed_experts=boolean(body, "return_routed_experts"),
                       model=str(body.get("model") or ""),
                       logprobs=bool(top) or "message.output_text.logprobs" in include, top_logprobs=top,
                       echo={k: body.get(k) for k in ("instructions", "tools", "tool_choice", "temperature",
                                                       "top_p", "max_output_tokens", "metadata", "user")})


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_items(reply: Reply, logprobs: list[dict] | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        items.append({"type": "reasoning", "id": _id("rs_"), "status": "completed", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reply.reasoning}]})
    if reply.content or not reply.tool_calls:
        items.append({"type": "message", "id": _id("msg_"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content, "annotations": [],
                                   "logprobs": logprobs or []}]})
    for call in reply.tool_calls:
        items.append({"type": "function_call", "id": _id("fc_"), "call_id": call.id, "name": call.name,
                      "arguments": call.arguments_json(), "status": "completed"})
    return items


def response_object(req: ChatRequest, reply: Reply, turn: dict[str, Any],
                    logprobs: list[dict] | None = None) -> dict[str, Any]:
    cut = (turn["finish_reason"] or {}).get("type") == "length"
    echo = req.echo
    return {"id": _id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
            "model": req.model or "miles", "output": output_items(reply, logprobs),
            "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": echo.get("temperature"), "text": {"format": {"type": "text"}},
            "tool_choice": echo.get("tool_choice") or "auto", "tools": echo.get("tools") or [],
            "top_p": echo.get("top_p"), "truncation": "disabled", "user": echo.get("user"),
            "metadata": echo.get("metadata") or {},
            "usage": {"input_tokens": turn["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": turn.get("cached_tokens", 0)},
                      "output_tokens": turn["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": turn["prompt_tokens"] + turn["completion_tokens"]},
            "miles": turn}


def stream_events(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs replaying a finished response as the Responses API streams it."""
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    head = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    for n, item in enumerate(response["output"]):
        at = {"output_index": n, "item_id": item["id"]}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=n, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": "", "logprobs": []})
            emit("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=part["logprobs"])
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"])
            emit("response.content_part.done", **at, content_index=0, part=part)
        elif item["type"] == "reasoning":
            emit("response.output_item.added", output_index=n, item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            emit("response.reasoning_text.delta", **at, content_index=0, delta=text)
            emit("response.reasoning_text.done", **at, content_index=0, text=text)
        else:
            emit("response.output_item.added", output_index=n,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=n, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events
