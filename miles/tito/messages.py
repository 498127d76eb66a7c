"""Chat messages as the session server sees them: one normalized form for every API and family.

Design decisions:
- OpenAI and Anthropic requests are both decoded into `ChatMessage`; families render and parse
  only this form, so a family never knows which API a client spoke.
- Normalization happens once, at the boundary, and is strict: an unknown role, a non-text content
  part, a system/user/tool message without `content` (an assistant one needs content, tool calls
  or reasoning), a non-string `name` / `tool_call_id`, a tool that is not a function or whose
  `parameters` is not an object, or tool-call arguments that are not a JSON object are refused with
  an error naming the field path (`messages[3].tool_calls[0].function.arguments`) and the bad value.
  `tool_call_id` itself stays optional: several harnesses omit it and templates do not need it.
- Text content parts are joined into one string (the templates we ship render strings only);
  `developer` is OpenAI's newer name for `system` and becomes `system`.
- Tool-call arguments are kept parsed (a dict). Templates render them with `json.dumps` (what HF's
  `tojson` does), so a client that re-serializes arguments with other spacing still renders, and
  hashes, the same.
- `reasoning` is `None` when the message carries no reasoning at all and a string (maybe empty)
  when it does: templates distinguish "no think block" from "an empty think block".
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


class RequestError(Exception):
    """A client error at the HTTP boundary: `status`, the offending field path and a message;
    `code` replaces the status in OpenAI's `error.code` (e.g. "invalid_api_key")."""

    def __init__(self, message: str, field: str = "", status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status
        self.kind = kind
        self.code = code


class ToolCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def arguments_json(self) -> str:
        # json.dumps defaults are what HF's `tojson` filter produces (", " and ": ").
        return json.dumps(self.arguments, ensure_ascii=False)


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []
    tool_call_id: str = ""
    name: str = ""

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a Jinja chat template sees (HF conventions)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": tc.id,
                                  "function": {"name": tc.name, "arguments": tc.arguments}}
                                 for tc in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def parse_arguments(raw: Any, field: str) -> dict[str, Any]:
    """Tool-call arguments: a JSON object given as a string or as an object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise RequestError(f"{field}: expected a JSON object encoded as a string, got {_short(raw)}", field)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(f"{field}: invalid JSON ({e.msg} at char {e.pos}): {_short(raw)}", field) from None
    if not isinstance(value, dict):
        raise RequestError(f"{field}: expected a JSON object, got {_short(raw)}", field)
    return value


def text_of(content: Any, field: str) -> str:
    """Content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{field}[{j}]: only text parts are supported, got type {kind!r}",
                                   f"{field}[{j}]")
        return "".join(parts)
    raise RequestError(f"{field}: expected a string or a list of text parts, got {_short(content)}", field)


def parse_openai_message(raw: Any, i: int) -> ChatMessage:
    field = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise RequestError(f"{field}: expected an object, got {_short(raw)}", field)
    role = raw.get("role")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise RequestError(f"{field}.role: {_short(raw.get('role'))} is not one of "
                           f"{list(ROLES) + list(ROLE_ALIASES)}", f"{field}.role")
    content = text_of(raw.get("content"), f"{field}.content")
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise RequestError(f"{field}.reasoning_content: expected a string, got {_short(reasoning)}",
                           f"{field}.reasoning_content")
    raw_calls = raw.get("tool_calls") or []
    if raw.get("content") is None and (role != "assistant" or not (raw_calls or reasoning is not None)):
        needs = "" if role != "assistant" else " (or tool_calls)"
        got = "missing" if "content" not in raw else "null"
        raise RequestError(f"{field}.content: required for a {role} message{needs}, got {got}",
                           f"{field}.content")
    for key in ("name", "tool_call_id"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise RequestError(f"{field}.{key}: expected a string, got {_short(raw[key])}", f"{field}.{key}")
    tool_calls: list[ToolCall] = []
    if raw_calls and role != "assistant":
        raise RequestError(f"{field}.tool_calls: only assistant messages carry tool calls "
                           f"(role is {role!r})", f"{field}.tool_calls")
    if not isinstance(raw_calls, list):
        raise RequestError(f"{field}.tool_calls: expected a list, got {_short(raw_calls)}", f"{field}.tool_calls")
    for j, call in enumerate(raw_calls):
        cfield = f"{field}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{cfield}.function.name: expected a non-empty string, got {_short(call)}",
                               f"{cfield}.function.name")
        if call.get("type", "function") != "function":
            raise RequestError(f"{cfield}.type: {_short(call['type'])} is not 'function'", f"{cfield}.type")
        args = parse_arguments(fn.get("arguments"), f"{cfield}.function.arguments")
        tool_calls.append(ToolCall(name=fn["name"], arguments=args, id=str(call.get("id") or "")))
    return ChatMessage(role=role, content=content, reasoning=reasoning, tool_calls=tool_calls,
                       tool_call_id=str(raw.get("tool_call_id") or ""), name=str(raw.get("name") or ""))


def parse_openai_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"messages: expected a non-empty list, got {_short(raw)}", "messages")
    return [parse_openai_message(m, i) for i, m in enumerate(raw)]


def parse_openai_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Tools exactly as the client sent them (templates render them verbatim); None when absent."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise RequestError(f"tools: expected a list, got {_short(raw)}", "tools")
    for k, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{k}].function.name: expected a non-empty string, got {_short(tool)}",
                               f"tools[{k}].function.name")
        if tool.get("type", "function") != "function":
            raise RequestError(f"tools[{k}].type: {_short(tool['type'])} is not 'function'", f"tools[{k}].type")
        check_tool_schema(fn.get("parameters"), fn.get("description"), f"tools[{k}].function", "parameters")
    return raw


def check_tool_schema(schema: Any, description: Any, field: str, schema_key: str) -> None:
    """A tool's JSON schema is an object and its description a string (templates render both)."""
    if schema is not None and not isinstance(schema, dict):
        raise RequestError(f"{field}.{schema_key}: expected a JSON schema object, got {_short(schema)}",
                           f"{field}.{schema_key}")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{field}.description: expected a string, got {_short(description)}",
                           f"{field}.description")
