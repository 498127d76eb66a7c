"""Llama 3.1-style headers: `<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>`, JSON tool calls.

Design decisions:
- The template follows Meta's Llama 3.1 chat template (custom tools in the first user message,
  the fixed "Cutting Knowledge Date / Today Date" system preamble, tool results as the `ipython`
  role, one tool call per assistant turn written as `{"name": ..., "parameters": ...}`), written
  from its public form; it has not been diffed against Meta's file, which is not available
  offline. Its quirks are kept on purpose because they are what a Llama checkpoint saw in
  training: every content is `trim`med, a tool result is JSON-encoded (a string becomes a quoted
  JSON string), and an assistant turn with a tool call drops its text content.
- There is no reasoning channel; `parse_reply` finds a tool call when the whole reply (after an
  optional `<|python_tag|>`) is one JSON object with `name` and `parameters` (or `arguments`).
- Every turn ends with `<|eot_id|>` and nothing follows it, so the bridge after a normal stop is
  empty; after a stop string or a length cut it is `<|eot_id|>` (loss mask 0).
- The vocabulary must contain the Llama 3 header tokens; `LLAMA3_SPECIAL_TOKENS` lists them for
  building a test tokenizer (the real Llama 3 vocabulary is not available offline).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles.tito.families import register_family
from miles.tito.families.base import Family, Reply
from miles.tito.messages import ChatMessage, ToolCall

LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
BOS = "<|begin_of_text|>"
DATE_STRING = "26 Jul 2024"
TOOLS_PREAMBLE = ("Given the following functions, please respond with a JSON for a function call "
                  "with its proper arguments that best answers the given prompt.\n\n"
                  'Respond in the format {"name": function name, "parameters": dictionary of '
                  'argument name and its value}.Do not use variables.\n\n')

CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


class Llama3Family(Family):
    name = "llama3"
    chat_template = CHAT_TEMPLATE
    end_of_turn = "<|eot_id|>"
    stop_tokens = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    structural_tokens = tuple(LLAMA3_SPECIAL_TOKENS)
    template_kwargs = {"bos_token": BOS}

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, start: int,
               add_generation_prompt: bool = True, options: dict[str, Any] | None = None) -> str:
        out: list[str] = []
        n = len(messages)
        first = start
        if start == 0:
            system = ""
            if n and messages[0].role == "system":
                system, first = messages[0].content.strip(), 1
            out.append(BOS + _header("system"))
            if tools:
                out.append("Environment: ipython\n")
            out.append(f"Cutting Knowledge Date: December 2023\nToday Date: {DATE_STRING}\n\n{system}<|eot_id|>")
            if tools:
                if first >= n:
                    raise ValueError("llama3: tools need a first user message to live in")
                out.append(_header("user") + TOOLS_PREAMBLE)
                for tool in tools:
                    out.append(json.dumps(tool, ensure_ascii=False, indent=4) + "\n\n")
                out.append(messages[first].content.strip() + "<|eot_id|>")
                first += 1
        for k in range(first, n):
            m = messages[k]
            if m.role == "tool":
                out.append(_header("ipython") + json.dumps(m.content, ensure_ascii=False) + "<|eot_id|>")
            elif m.role == "assistant":
                out.append(_header("assistant") + self._assistant_body(m, trim=True) + "<|eot_id|>")
            else:
                out.append(_header(m.role) + m.content.strip() + "<|eot_id|>")
        if add_generation_prompt:
            out.append(_header("assistant"))
        return "".join(out)

    def _assistant_body(self, message: ChatMessage, trim: bool) -> str:
        if message.tool_calls:
            if len(message.tool_calls) != 1:
                raise ValueError(f"llama3: one tool call per assistant turn, got {len(message.tool_calls)}")
            call = message.tool_calls[0]
            return '{"name": "' + call.name + '", "parameters": ' + call.arguments_json() + "}"
        return message.content.strip() if trim else message.content

    def bridge(self, last_token: str | None) -> str:
        return "" if last_token in ("<|eot_id|>", "<|eom_id|>") else self.end_of_turn

    def generation_text(self, message: ChatMessage) -> str:
        return self._assistant_body(message, trim=False) + self.end_of_turn

    def parse_reply(self, text: str) -> Reply:
        body = text.removeprefix("<|python_tag|>").strip()
        if body.startswith("{") and body.endswith("}"):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("parameters", obj.get("arguments"))
                if isinstance(args, dict):
                    return Reply(content="", tool_calls=[ToolCall(
                        name=obj["name"], arguments=args, id="call_" + uuid.uuid4().hex[:24])])
        return Reply(content=text)


LLAMA3 = register_family(Llama3Family())
