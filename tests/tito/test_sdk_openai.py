"""The session server through the official `openai` SDK (chat completions): issue 16 item 8.

The shared `sdk_stack` (conftest) serves a scripted engine (exact tool calls and reasoning) and a
real embedded engine behind a recording proxy (token exactness, logprobs).
"""

from __future__ import annotations

import asyncio
import gc
import time

import aiohttp
import numpy as np
import openai
import pytest

from miles.tito.client import SessionServerClient
from miles.tito.messages import parse_openai_messages

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


def client(session: dict, token: str, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["openai_base_url"], api_key=token, max_retries=retries)


def call(cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}


async def test_tool_loop_streaming_and_session_stats(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token)
    st.engine.reply("<think>\nuse add\n</think>\n\n" + CALL, "<think>\nok\n</think>\n\nIt is 1.")
    msgs = [{"role": "user", "content": "add 1"}]
    r1 = await oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    tc = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls" and tc[0].function.name == "add"
    msgs += [r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": tc[0].id, "content": "1"}]
    stream = await oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True,
                                              stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is 1."
    assert chunks[-1].usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens

    async with SessionServerClient(st.scripted_url, token=st.token) as sc:
        info = await sc.info(s["session_id"])
        [sample] = await sc.collect(s["session_id"])
    stats = sample.metadata["session_stats"]
    assert stats == info["stats"]
    assert stats["turns"] == 2 and stats["output_tokens"] == sum(len(r["output_ids"]) for r in st.engine.responses[-2:])
    assert stats["prompt_tokens"] == sum(len(r["input_ids"]) for r in st.engine.requests[-2:])
    assert stats["engine_s"] > 0 and 0 < stats["server_s"] < 1.0 and stats["cached_tokens"] == 0
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {st.token}"}) as http:
        totals = await (await http.get(f"{st.scripted_url}/stats")).json()
    assert totals["open_sessions"] == len(st.scripted.sessions) and totals["totals"]["turns"] >= 2


async def test_malformed_histories_are_refused_and_leave_the_session_untouched(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token)
    user = {"role": "user", "content": "go"}
    st.engine.reply("<think>\nonly thinking\n</think>\n\n")
    r = await oc.chat.completions.create(model="m", messages=[user])
    recorded = r.choices[0].message.model_dump(exclude_none=True)
    assert recorded["content"] == "" and not recorded.get("tool_calls")
    before = await st.info("scripted", s["session_id"])
    n_engine = len(st.engine.requests)
    other = {"role": "user", "content": "not the recorded turn"}
    cases = [
        ([other, {"role": "tool", "tool_call_id": "c9", "content": "1"}], "messages[1].tool_call_id",
         "tool message with no matching tool call"),
        ([other, {"role": "assistant", "content": None, "tool_calls": [call("c1")]},
          {"role": "tool", "tool_call_id": "zz", "content": "1"}], "messages[2].tool_call_id",
         "'zz' matches no unanswered tool call"),
        ([other, {"role": "assistant", "content": None, "tool_calls": [call("c1")]}, other],
         "messages[1].tool_calls[0]", "tool call 'c1' is never answered"),
        ([other, {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]},
          {"role": "tool", "tool_call_id": "c1", "content": "1"}], "messages[1].tool_calls[1]",
         "'c2' is never answered: a tool message for each tool call must come before the end"),
        ([other, {"role": "assistant", "content": None, "tool_calls": [call("c1")]},
          {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c1", "content": "1"}],
         "messages[3].tool_call_id", "already answered"),
        ([other, {"role": "assistant", "content": ""}, other], "messages[1].content",
         "an assistant turn needs content or tool calls"),
        ([other, {"role": "assistant", "content": None, "reasoning_content": "hm"}, other], "messages[1].content",
         "needs content or tool calls"),
    ]
    for messages, param, text in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await oc.chat.completions.create(model="m", messages=messages)
        err = e.value.response.json()["error"]
        assert e.value.status_code == 400 and err["param"] == param and text in err["message"], (messages, err)
    assert len(st.engine.requests) == n_engine
    assert await st.info("scripted", s["session_id"]) == before
    # the session's own reasoning-only turn, echoed back, is not malformed
    st.engine.reply("fine")
    r = await oc.chat.completions.create(model="m", messages=[user, recorded, {"role": "user", "content": "and?"}])
    assert r.choices[0].message.content == "fine" and r.model_extra["miles"]["appended_tokens"] < 12


async def test_options_are_honoured_or_refused(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token)
    user = [{"role": "user", "content": "x"}]
    refused = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
         "response_format.type", "'json_schema' is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format.type", "'json_object' is not supported"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "cannot force a tool call"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
         "cannot force a tool call"),
        ({"n": 2}, "n", "only 1 choice"),
        ({"top_logprobs": 3}, "top_logprobs", "needs \"logprobs\": true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "outside"),
    ]
    for extra, param, text in refused:
        with pytest.raises(openai.BadRequestError) as e:
            await oc.chat.completions.create(model="m", messages=user, **extra)
        err = e.value.response.json()["error"]
        assert err["param"] == param and text in err["message"], (extra, err)
    # tool_choice none: tools still rendered (same prompt), a call the model writes stays content
    st.engine.reply(CALL)
    r = await oc.chat.completions.create(model="m", messages=user, tools=TOOLS, tool_choice="none",
                                         response_format={"type": "text"})
    m = r.choices[0].message
    assert m.tool_calls is None and m.content == CALL and r.choices[0].finish_reason == "stop"
    assert "# Tools" in st.engine.tokenizer.decode(st.engine.requests[-1]["input_ids"])
    st.engine.reply("next")
    r2 = await oc.chat.completions.create(model="m", messages=[*user, m.model_dump(exclude_none=True),
                                                                {"role": "user", "content": "y"}], tools=TOOLS)
    assert r2.model_extra["miles"]["appended_tokens"] < 12          # the echoed turn matched


async def test_top_logprobs_from_the_real_engine_streaming_too(sdk_stack):
    st = sdk_stack
    s = await st.session("real")
    oc = client(s, st.token)
    msgs = [{"role": "user", "content": "count"}]
    r = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3,
                                         temperature=1.0)
    [(req, ans)] = st.proxy.for_session(s["session_id"])
    assert req["top_logprobs_num"] == 3
    got = r.choices[0].logprobs.content
    assert [x.logprob for x in got] == pytest.approx([e[0] for e in ans["meta_info"]["output_token_logprobs"]])
    assert all(len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob >= x.top_logprobs[-1].logprob for x in got)
    stream = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=6, logprobs=True, stream=True)
    chunks = [c async for c in stream]
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    ans2 = st.proxy.for_session(s["session_id"])[-1][1]
    assert [x.logprob for x in streamed] == pytest.approx([e[0] for e in ans2["meta_info"]["output_token_logprobs"]])


async def test_x_should_retry_tells_the_sdk_what_to_do(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token, retries=2)
    user = [{"role": "user", "content": "x"}]
    n = len(st.engine.requests)
    st.engine.fail_status = 400          # the engine refused the body: a 502 not worth retrying
    try:
        with pytest.raises(openai.InternalServerError) as e:
            await oc.chat.completions.create(model="m", messages=user)
        assert e.value.status_code == 502 and e.value.response.headers["x-should-retry"] == "false"
        assert len(st.engine.requests) == n + 1                     # sent once, not three times
        st.engine.fail_status = 500      # engine unavailable: retryable
        with pytest.raises(openai.InternalServerError) as e:
            await openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=st.token, max_retries=1).chat.completions.create(
                model="m", messages=user)
        assert e.value.status_code == 503 and e.value.response.headers["x-should-retry"] == "true"
        assert len(st.engine.requests) == n + 3
    finally:
        st.engine.fail_status = None
    info = await st.info("scripted", s["session_id"])
    assert info["nodes"] == 1 and info["stats"]["turns"] == 0


async def test_body_limit_routes_and_models(sdk_stack):
    st = sdk_stack
    s = await st.session()
    oc = client(s, st.token, retries=2)
    n = len(st.engine.requests)
    with pytest.raises(openai.APIStatusError) as e:
        await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert e.value.status_code == 413 and e.value.response.headers["x-should-retry"] == "false"
    assert "over the limit of 4194304 bytes (--max-body-bytes)" in e.value.response.json()["error"]["message"]
    assert len(st.engine.requests) == n and (await st.info("scripted", s["session_id"]))["nodes"] == 1
    model = await oc.models.retrieve("gpt-harness-name")
    assert model.id == "gpt-harness-name" and model.object == "model"
    assert [m.id async for m in oc.models.list()] == ["miles"]
    with pytest.raises(openai.NotFoundError) as e:
        await oc.post("/embeddings", cast_to=object, body={"input": "x"})
    err = e.value.response.json()["error"]
    assert "unsupported route" in err["message"] and "POST /sessions/{id}/v1/responses" in err["message"]
    assert e.value.response.headers["x-should-retry"] == "false"


async def test_32_concurrent_sessions_are_token_exact(sdk_stack):
    st = sdk_stack

    async def episode(i: int):
        s = await st.session("real")
        oc = client(s, st.token)
        msgs = [{"role": "system", "content": f"agent {i}"}, {"role": "user", "content": "count"}]
        for t in range(2):
            if t == 1 and i % 2:
                stream = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=5, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                msgs += [{"role": "assistant", "content": text}]
            else:
                r = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=1.0)
                msgs += [r.choices[0].message.model_dump(exclude_none=True)]
            msgs.append({"role": "user", "content": f"more {t}"})
        return s["session_id"]

    t0 = time.perf_counter()
    sids = await asyncio.gather(*(episode(i) for i in range(32)))
    elapsed = time.perf_counter() - t0
    async with SessionServerClient(st.real_url, token=st.token) as sc:
        samples = await asyncio.gather(*(sc.collect(sid, close=True) for sid in sids))
    for sid, got in zip(sids, samples):
        turns = st.proxy.for_session(sid)
        assert len(turns) == 2 and len(got) == 1, (sid, len(turns), len(got))
        sample = got[0]
        (req0, ans0), (req1, ans1) = turns
        assert sample.tokens.tolist() == req1["input_ids"] + ans1["output_ids"]
        assert req1["input_ids"][:len(req0["input_ids"]) + len(ans0["output_ids"])] == req0["input_ids"] + ans0["output_ids"]
        mask = np.zeros(len(sample.tokens), np.uint8)
        for req, ans in turns:
            mask[len(req["input_ids"]):len(req["input_ids"]) + len(ans["output_ids"])] = 1
        assert sample.loss_mask.tolist() == mask[sample.prompt_length:].tolist()
        lps = [e[0] for _, ans in turns for e in ans["meta_info"]["output_token_logprobs"]]
        assert np.allclose(sample.rollout_logprobs[sample.loss_mask == 1], lps)
        assert sample.metadata["session_stats"]["turns"] == 2
    print(f"32 sessions x 2 turns through the SDK: {elapsed:.2f} s")


@pytest.mark.slow
async def test_a_3mb_tool_result_does_not_stall_other_sessions(sdk_stack):
    """Issue 16 item 8: one 8 MB tool result stalled every session for 17 s. The render goes to the
    tokenizer process pool; the ids are exactly the in-process tokenizer's. The stall is measured
    as the CPU time the event loop's thread spends between two ticks of a 10 ms ticker: a render
    on the loop shows there, while other processes on a busy machine (CI runs two test streams on
    two cores) delay the ticks without adding to it, so wall-clock latency is only printed."""
    st = sdk_stack
    words = ["alpha", "beta", "file", "total", "drwxr", "error", "line", "value", "print", "return"]
    rng = np.random.default_rng(0)
    big = " ".join(f"{words[k]}{n}" for k, n in zip(rng.integers(0, 10, 400_000), rng.integers(0, 99, 400_000)))
    big = big[:3_000_000]
    await st.scripted.pool.warm()                      # spawn cost is not what this test measures

    done: list[float] = []   # completion times: a stalled loop shows as a gap, whatever was in flight

    async def small_turns(stop: asyncio.Event, out: list[float]):
        s = await st.session()
        oc = client(s, st.token)
        msgs = [{"role": "user", "content": "ping"}]
        while not stop.is_set():
            t = time.perf_counter()
            await oc.chat.completions.create(model="m", messages=msgs, max_tokens=4)
            out.append(time.perf_counter() - t)
            done.append(time.perf_counter())
            await asyncio.sleep(0.02)

    async def measure(load) -> list[float]:
        stop, lat = asyncio.Event(), [[] for _ in range(4)]
        tasks = [asyncio.create_task(small_turns(stop, x)) for x in lat]
        try:
            await load()
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return [v for x in lat for v in x]

    base = await measure(lambda: asyncio.sleep(2.0))
    s = await st.session()
    oc = client(s, st.token)
    msgs = [{"role": "user", "content": "list"}, {"role": "assistant", "content": None, "tool_calls": [call("c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": big}]
    timing = {}

    async def big_turn():
        t = time.perf_counter()
        await oc.chat.completions.create(model="m", messages=msgs, max_tokens=4, timeout=120)
        timing["big_s"] = time.perf_counter() - t

    stalls: list[float] = []   # thread CPU seconds between consecutive ticks

    async def ticker(stop: asyncio.Event):
        last = time.thread_time()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.thread_time()
            stalls.append(now - last)
            last = now

    done.clear()
    tick_stop = asyncio.Event()
    tick = asyncio.create_task(ticker(tick_stop))
    # the heap the suite built before this test (hundreds of tests in one process) is frozen out of
    # the collector, so a full collection over it does not count as this server's stall
    gc.collect()
    gc.freeze()
    try:
        loaded = await measure(big_turn)
    finally:
        gc.unfreeze()
        tick_stop.set()
        await tick
    gap = float(np.diff(sorted(done)).max())
    p95 = lambda xs: float(np.percentile(xs, 95))
    print(f"small-turn p95: {p95(base) * 1e3:.0f} ms idle, {p95(loaded) * 1e3:.0f} ms during a 3 MB tool result "
          f"({timing['big_s']:.1f} s, {len(loaded)} small turns, max {max(loaded) * 1e3:.0f} ms, longest gap "
          f"between completions {gap * 1e3:.0f} ms, loop CPU between ticks at most {max(stalls) * 1e3:.0f} ms)")
    assert st.scripted.stats["pool_tokenized"] >= 1
    assert len(loaded) >= 20, len(loaded)
    # tokenizing 3 MB on the loop: 2.4 s here (idle box); through the pool 0.12-0.16 s (0.64 s once
    # in CI beside the other test stream)
    assert max(stalls) < 1.0, sorted(stalls)[-5:]
    req = [b for b in st.engine.requests if len(b["input_ids"]) > 100_000][-1]   # a rerun adds one
    text = st.scripted.family.render(parse_openai_messages(msgs), None, 0, True, {})
    assert req["input_ids"] == st.engine.tokenizer.encode(text)     # exactly the in-process tokenizer's
