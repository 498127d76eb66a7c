"""Qwen3: ChatML turns, `<think>` reasoning and `<tool_call>` JSON tool calls.

Design decisions:
- The template is Qwen3's own with one fix, as in Miles' `qwen3_fixed` template: historical
  reasoning is never cut. The stock template drops `<think>` blocks of assistant turns before the
  last user query, so a later re-render is no longer an extension of what the engine saw (the
  verifier reports it at the dropped `<think>`; see tests/tito/test_verify.py).
- Assistant turns render a think block whenever the message carries reasoning (even an empty
  one), or when its content contains `</think>` (then it is split out, as the stock template does).
- The engine stops on `<|im_end|>`; the template then writes `\n`, which the model never
  generates: that is the bridge (loss mask 0). After a stop string or a length cut the bridge also
  closes the turn with `<|im_end|>`.
- Consecutive tool results share one `<|im_start|>user` block. The server only splices after an
  assistant turn, so a run of tool messages is always rendered in one piece.
- Parsing follows SGLang's qwen3 reasoning parser and qwen25 tool parser: reasoning is the text
  between `<think>` and `</think>`; every `<tool_call>` block must hold a JSON object with `name`
  and `arguments`, otherwise the whole reply stays plain content (a half-parsed reply would
  round-trip to different text).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles.tito.families import register_family
from miles.tito.families.base import Family, Reply
from miles.tito.messages import ChatMessage, ToolCall

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and "
               "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")

CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = none %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if reasoning_content is not none %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


class Qwen3Family(Family):
    name = "qwen3"
    chat_template = CHAT_TEMPLATE
    end_of_turn = "<|im_end|>"
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    structural_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                         "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, start: int,
               add_generation_prompt: bool = True, options: dict[str, Any] | None = None) -> str:
        out: list[str] = []
        n = len(messages)
        first = start
        if start == 0 and n:
            has_system = messages[0].role == "system"
            if tools:
                out.append("<|im_start|>system\n")
                if has_system:
                    out.append(messages[0].content + "\n\n")
                out.append(TOOLS_INTRO)
                for tool in tools:
                    out.append("\n" + json.dumps(tool, ensure_ascii=False))
                out.append(TOOLS_OUTRO)
            elif has_system:
                out.append("<|im_start|>system\n" + messages[0].content + "<|im_end|>\n")
            first = 1 if has_system else 0
        for k in range(first, n):
            m = messages[k]
            if m.role in ("user", "system"):
                out.append(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n")
            elif m.role == "assistant":
                out.append("<|im_start|>assistant\n" + self.generation_text(m) + "\n")
            elif m.role == "tool":
                if k == 0 or messages[k - 1].role != "tool":
                    out.append("<|im_start|>user")
                out.append("\n<tool_response>\n" + m.content + "\n</tool_response>")
                if k == n - 1 or messages[k + 1].role != "tool":
                    out.append("<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            if (options or {}).get("enable_thinking") is False:
                out.append("<think>\n\n</think>\n\n")
        return "".join(out)

    def bridge(self, last_token: str | None) -> str:
        return "\n" if last_token == self.end_of_turn else self.end_of_turn + "\n"

    def generation_text(self, message: ChatMessage) -> str:
        content, reasoning = message.content, message.reasoning
        if reasoning is None and "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if reasoning is not None:
            text = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            text = content
        for j, call in enumerate(message.tool_calls):
            if j > 0 or content:
                text += "\n"
            text += '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + call.arguments_json() + "}\n</tool_call>"
        return text + self.end_of_turn

    def parse_reply(self, text: str, tools: bool = True) -> Reply:
        reasoning = None
        content = text
        if "</think>" in text:
            before, _, content = text.partition("</think>")
            reasoning = before.split("<think>")[-1].strip("\n")
            content = content.lstrip("\n")
        elif "<think>" in text:  # cut off while thinking
            reasoning = text.split("<think>", 1)[1].strip("\n")
            content = ""
        calls, head = _parse_tool_calls(content) if tools else (None, content)
        if calls is None:
            return Reply(content=content, reasoning=reasoning)
        return Reply(content=head, reasoning=reasoning, tool_calls=calls)

    def parse_reply_without_tools(self, text: str) -> Reply:
        return self.parse_reply(text, tools=False)


def _parse_tool_calls(content: str) -> tuple[list[ToolCall] | None, str]:
    """(tool calls, content before them), or (None, content) when any block does not parse."""
    if "<tool_call>" not in content:
        return None, content
    head, _, rest = content.partition("<tool_call>")
    head = head[:-1] if head.endswith("\n") else head
    calls: list[ToolCall] = []
    for block in ("<tool_call>" + rest).split("<tool_call>")[1:]:
        body, sep, tail = block.partition("</tool_call>")
        if not sep or tail.strip():
            return None, content
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None, content
        args = obj.get("arguments") if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, content
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return None, content
        calls.append(ToolCall(name=obj["name"], arguments=args, id="call_" + uuid.uuid4().hex[:24]))
    return calls, head


QWEN3 = register_family(Qwen3Family())
