"""The session server through the official `anthropic` SDK: messages, streaming, tools, count_tokens,
models.retrieve, refusals of malformed histories (issue 16 item 8)."""

from __future__ import annotations

import anthropic
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOOLS = [{"name": "add", "description": "Add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


def client(session: dict, token: str, retries: int = 0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=session["base_url"], api_key=token, max_retries=retries)


async def test_tool_loop_stream_count_tokens_and_models(sdk_stack):
    st = sdk_stack
    s = await st.session()
    ac = client(s, st.token)
    st.engine.reply("<think>\nlook\n</think>\n\n" + CALL, "Done.")
    msgs = [{"role": "user", "content": "add 1"}]
    m1 = await ac.messages.create(model="claude-x", max_tokens=64, system="Be terse.", tools=TOOLS, messages=msgs)
    assert [b.type for b in m1.content] == ["thinking", "tool_use"] and m1.stop_reason == "tool_use"
    use = m1.content[1]
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1"}]}]
    counted = await ac.messages.count_tokens(model="claude-x", system="Be terse.", tools=TOOLS, messages=msgs)
    before = await st.info("scripted", s["session_id"])
    assert before["nodes"] == 3                                        # count_tokens committed nothing
    async with ac.messages.stream(model="claude-x", max_tokens=64, system="Be terse.", tools=TOOLS,
                                  messages=msgs) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Done." and final.stop_reason == "end_turn"
    assert counted.input_tokens == final.usage.input_tokens == len(st.engine.requests[-1]["input_ids"])
    assert final.model_extra["miles"]["appended_tokens"] < 20           # the echoed tool_use turn matched
    model = await ac.models.retrieve("claude-sonnet-harness")
    assert model.id == "claude-sonnet-harness" and model.type == "model"


async def test_malformed_histories_are_refused_and_leave_the_session_untouched(sdk_stack):
    st = sdk_stack
    s = await st.session()
    ac = client(s, st.token)
    user = {"role": "user", "content": "hi"}
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}
    before = await st.info("scripted", s["session_id"])
    n = len(st.engine.requests)
    cases = [
        ([user, {"role": "assistant", "content": [use]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}],
         "messages[2].content[0].tool_use_id: 'toolu_9' matches no unanswered tool_use block"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]}],
         "messages[0].content[0]: a tool_result block with no matching tool_use block"),
        ([user, {"role": "assistant", "content": [use]}, {"role": "user", "content": "never mind"}],
         "messages[1].content[0]: tool_use block 'toolu_1' is never answered"),
        ([user, {"role": "assistant", "content": []}, {"role": "user", "content": "?"}],
         "messages[1]: an assistant turn needs content or tool_use blocks"),
    ]
    for messages, text in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            await ac.messages.create(model="c", max_tokens=8, tools=TOOLS, messages=messages)
        body = e.value.response.json()
        assert body["type"] == "error" and text in body["error"]["message"], (messages, body)
    for extra, text in [({"tool_choice": {"type": "any"}}, "tool_choice: {'type': 'any'} is not supported"),
                        ({"tool_choice": {"type": "tool", "name": "add"}}, "cannot force a tool call")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            await ac.messages.create(model="c", max_tokens=8, tools=TOOLS, messages=[user], **extra)
        assert text in e.value.response.json()["error"]["message"]
    assert len(st.engine.requests) == n and await st.info("scripted", s["session_id"]) == before


async def test_errors_in_anthropics_shape_and_not_retried(sdk_stack):
    st = sdk_stack
    s = await st.session()
    ac = client(s, st.token, retries=2)
    with pytest.raises(anthropic.NotFoundError) as e:
        await ac.post("/v1/complete", cast_to=object, body={"prompt": "x"})
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "unsupported route" in body["error"]["message"]
    n = len(st.engine.requests)
    st.engine.fail_status = 400
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            await ac.messages.create(model="c", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    finally:
        st.engine.fail_status = None
    assert e.value.status_code == 502 and e.value.response.headers["x-should-retry"] == "false"
    assert len(st.engine.requests) == n + 1
