"""Families: the incremental renderer equals the Jinja template, replies parse back, ids are real."""

from __future__ import annotations

from pathlib import Path

import json

import pytest

from miles.tito.families import Family, family_names, get_family, register_family
from miles.tito.families.qwen3 import Qwen3Family
from miles.tito.messages import ChatMessage, RequestError, ToolCall, parse_openai_messages, parse_openai_tools
from miles.tito.template import render_template

DATA = Path(__file__).parent / "data"


def _conversations(name: str):
    for line in (DATA / name).read_text().splitlines():
        row = json.loads(line)
        yield parse_openai_messages(row["messages"]), parse_openai_tools(row.get("tools"))


@pytest.mark.parametrize("family_name,data", [("qwen3", "conversations_qwen3.jsonl"),
                                              ("llama3", "conversations_llama3.jsonl")])
def test_incremental_render_equals_template_at_every_split(family_name, data):
    """Rendering messages[start:] after an assistant turn, plus the bridge, is the template's text."""
    family = get_family(family_name)
    for messages, tools in _conversations(data):
        dicts = [m.to_template_dict() for m in messages]
        for gen in (True, False):
            full = render_template(family.chat_template, dicts, tools, gen, **family.template_kwargs)
            assert family.render(messages, tools, 0, gen) == full
        for a, m in enumerate(messages):
            if m.role != "assistant":
                continue
            head = render_template(family.chat_template, dicts[:a], tools, True, **family.template_kwargs)
            tail = family.bridge(family.end_of_turn) + family.render(messages, tools, a + 1, True)
            full = render_template(family.chat_template, dicts, tools, True, **family.template_kwargs)
            assert head + family.generation_text(m)[:-len(family.end_of_turn)] + family.end_of_turn + tail == full


def test_qwen3_real_vocabulary_ids():
    from miles.tito.tokenizer import load_tokenizer
    tok = load_tokenizer("qwen")
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    for token, tid in {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                       "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
                       "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}.items():
        assert tok.token_id(token) == tid
        assert tok.encode(f"a{token}b") == tok.encode("a") + [tid] + tok.encode("b")


def test_qwen3_parse_reply_reasoning_and_tool_calls():
    q = get_family("qwen3")
    r = q.parse_reply('<think>\nadd them\n</think>\n\nSure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
                      '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": "{\\"b\\": 2}"}\n</tool_call>')
    assert r.reasoning == "add them" and r.content == "Sure."
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("add", {"a": 1}), ("mul", {"b": 2})]
    # A block that is not JSON keeps the whole reply as text: a half-parsed reply would not round-trip.
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    assert q.parse_reply(bad).tool_calls == [] and q.parse_reply(bad).content == bad
    cut = q.parse_reply("<think>\nstill thinking")
    assert cut.reasoning == "still thinking" and cut.content == ""
    assert q.parse_reply("plain").reasoning is None


def test_generation_text_round_trips_through_the_parser():
    q = get_family("qwen3")
    msg = ChatMessage(role="assistant", content="Calling.", reasoning="plan",
                      tool_calls=[ToolCall(name="f", arguments={"x": [1, 2], "y": "é"})])
    back = q.parse_reply(q.generation_text(msg)[:-len(q.end_of_turn)]).to_message()
    assert (back.content, back.reasoning, [(c.name, c.arguments) for c in back.tool_calls]) == \
        ("Calling.", "plan", [("f", {"x": [1, 2], "y": "é"})])
    ll = get_family("llama3")
    call = ChatMessage(role="assistant", tool_calls=[ToolCall(name="f", arguments={"x": 1})])
    parsed = ll.parse_reply("<|python_tag|>" + ll.generation_text(call)[:-len(ll.end_of_turn)])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", {"x": 1})]


def test_bridges_close_what_the_engine_did_not():
    q, ll = get_family("qwen3"), get_family("llama3")
    assert q.bridge("<|im_end|>") == "\n" and q.bridge("x") == "<|im_end|>\n" and q.bridge(None) == "<|im_end|>\n"
    assert ll.bridge("<|eot_id|>") == "" and ll.bridge("x") == "<|eot_id|>"


def test_registry_names_import_paths_and_errors():
    assert {"qwen3", "llama3"} <= set(family_names())
    assert isinstance(get_family("qwen3"), Qwen3Family)
    with pytest.raises(KeyError, match="unknown family 'gpt9'"):
        get_family("gpt9")

    class Shouty(Qwen3Family):
        name = "shouty-test"

        def parse_reply(self, text):
            return super().parse_reply(text.upper())

    register_family(Shouty())
    assert get_family("shouty-test").parse_reply("hi").content == "HI"
    # a user family in one file, given by import path
    user = get_family("user_family:ChatMLFamily")
    assert user.name == "chatml-user" and get_family("chatml-user") is user
    assert user.render([ChatMessage(role="user", content="hi")], None, 0) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TypeError, match="is not a Family"):
        get_family("user_family:NOT_A_FAMILY")
    with pytest.raises(ValueError, match="already registered"):
        class Other(Family):
            name = "shouty-test"
        register_family(Other())


def test_message_validation_names_the_field():
    with pytest.raises(RequestError, match=r"messages\[1\]\.role: 'robot' is not one of"):
        parse_openai_messages([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])
    with pytest.raises(RequestError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: invalid JSON"):
        parse_openai_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1,"}}]}])
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\]: only text parts"):
        parse_openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(RequestError, match="messages: expected a non-empty list"):
        parse_openai_messages([])
    msgs = parse_openai_messages([{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert (msgs[0].role, msgs[0].content) == ("system", "ab")


def test_tito_never_imports_actors():
    import subprocess
    import sys
    code = ("import sys, miles.tito.server, miles.tito.verify, miles.tito.client, miles.envs.agent; "
            "bad = [m for m in sys.modules if m.startswith('miles.actors')]; assert not bad, bad")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
