"""The OpenAI Responses API (`/v1/responses`) through the official `openai` SDK: tools, streaming with
the real event names (checked by the SDK's own stream accumulator), refusals, token exactness."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from miles.tito.client import SessionServerClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOOLS = [{"type": "function", "name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 40}}\n</tool_call>'


def client(session: dict, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["openai_base_url"], api_key=token, max_retries=0)


async def test_function_call_loop_streamed_and_exact(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token)
    st.engine.reply("<think>\nneed add\n</think>\n\n" + CALL, "<think>\nok\n</think>\n\nIt is 42.")
    inputs: list = [{"role": "user", "content": "40 + 2?"}]
    r1 = await oc.responses.create(model="m", instructions="Be terse.", input=inputs, tools=TOOLS,
                                   max_output_tokens=64)
    assert [o.type for o in r1.output] == ["reasoning", "function_call"] and r1.status == "completed"
    fc = r1.output[1]
    assert fc.name == "add" and json.loads(fc.arguments) == {"a": 40}
    inputs += [o.model_dump(exclude_none=True) for o in r1.output]
    inputs.append({"type": "function_call_output", "call_id": fc.call_id, "output": "42"})
    async with oc.responses.stream(model="m", instructions="Be terse.", input=inputs, tools=TOOLS) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == "It is 42." and final.model_extra["miles"]["appended_tokens"] < 20
    async with SessionServerClient(st.scripted_url, token=st.token) as sc:
        [sample] = await sc.collect(s["session_id"])
    req, resp = st.engine.requests[-1], st.engine.responses[-1]
    assert sample.tokens.tolist() == req["input_ids"] + resp["output_ids"]
    assert int(sample.loss_mask.sum()) == sum(len(r["output_ids"]) for r in st.engine.responses[-2:])
    # a streamed function call, too (the collect above closed the session)
    oc = client(await st.session(), st.token)
    st.engine.reply(CALL)
    async with oc.responses.stream(model="m", input="again", tools=TOOLS) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {"a": 40}


async def test_refusals_name_the_item_and_field(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token)
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    before = await st.info("scripted", s["session_id"])
    n = len(st.engine.requests)
    cases = [
        ({"input": [{"role": "user", "content": "x"}, call,
                    {"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
         "input[2].call_id", "'call_9' matches no unanswered function_call item"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "1"}]},
         "input[1].call_id", "function_call_output item with no matching function_call item"),
        ({"input": [{"role": "user", "content": "x"}, call, {"role": "user", "content": "y"}]},
         "input[1]", "function_call item 'call_1' is never answered"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "text.format.type",
         "not supported"),
        ({"input": "x", "tool_choice": "required", "tools": TOOLS}, "tool_choice", "cannot force a tool call"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "need a response store"),
    ]
    for body, param, text in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await oc.responses.create(model="m", **body)
        err = e.value.response.json()["error"]
        assert err["param"] == param and text in err["message"], (body, err)
    assert len(st.engine.requests) == n and await st.info("scripted", s["session_id"]) == before


async def test_real_engine_logprobs_and_exact_tokens(sdk_stack):
    st = sdk_stack
    s = await st.session("real")
    oc = client(s, st.token)
    r = await oc.responses.create(model="m", input="count", max_output_tokens=5, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    [(req, ans)] = st.proxy.for_session(s["session_id"])
    part = next(o for o in r.output if o.type == "message").content[0]
    assert [x.logprob for x in part.logprobs] == pytest.approx([e[0] for e in ans["meta_info"]["output_token_logprobs"]])
    assert all(len(x.top_logprobs) == 2 for x in part.logprobs)
    async with SessionServerClient(st.real_url, token=st.token) as sc:
        [sample] = await sc.collect(s["session_id"], close=True)
    assert sample.tokens.tolist() == req["input_ids"] + ans["output_ids"]
    assert np.allclose(sample.rollout_logprobs, [e[0] for e in ans["meta_info"]["output_token_logprobs"]])
