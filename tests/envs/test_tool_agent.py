"""The built-in tool agent against a real session server, a real engine and subprocess sandboxes.

A tiny model fine-tuned on `find_file` transcripts (conftest `tool_model`) serves behind smg and the
session server; what the agent's tools read and write is in a real sandbox, and the verifier reads
the sandbox. Exact malformed calls and slow tools come from a scripted engine behind the same
session server code. The exactness test checks every sample of quickstart-style episodes against
what the engine received and produced (a recording proxy) and against the chat template.
"""

from __future__ import annotations

import asyncio
import json
import types

import numpy as np
import pytest

from miles.envs.tool_agent import ANSWER_PATH, agent, verify_submission
from miles.tito.client import SessionServerClient

pytestmark = pytest.mark.asyncio(loop_scope="module")


def task_of(row: dict, sandbox, **extra) -> dict:
    """What the framework hands the agent: the row's metadata plus prompt, label, limits, sandbox."""
    return {**row["metadata"], "prompt": row["prompt"], "label": row["label"], "sandbox": sandbox,
            "keep_transcript": True, **extra}


async def run_episode(url: str, task: dict, rollout_id: str):
    async with SessionServerClient(url) as client:
        created = await client.create_session(rollout_id=rollout_id)
        try:
            result = await agent(created["base_url"], task)
        finally:
            samples = await client.collect(created["session_id"], close=True)
    return result, samples, created["session_id"]


def sample_of(row: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(label=row["label"], prompt=row["prompt"], metadata=row["metadata"])


async def test_the_model_reads_the_file_in_its_sandbox_and_the_verifier_reads_the_submission(
        stack, sandboxes, find_file_rows):
    url, _, _ = stack
    rows = find_file_rows[1][:6]
    boxes = [await sandboxes(r["metadata"]["files"]) for r in rows]
    results = await asyncio.gather(*(run_episode(url, task_of(r, b, sampling={"temperature": 0.0}), f"read-{i}")
                                     for i, (r, b) in enumerate(zip(rows, boxes))))
    calls = reads = submitted = 0
    for row, box, (result, samples, _) in zip(rows, boxes, results):
        msgs = result["messages"]
        for k, m in enumerate(msgs):
            for call in m.get("tool_calls") or []:   # parsed by the session server's qwen3 parser
                calls += 1
                args = json.loads(call["function"]["arguments"])
                path = args.get("path")
                if call["function"]["name"] == "read_file" and isinstance(path, str) and k + 1 < len(msgs):
                    got, files = msgs[k + 1]["content"], row["metadata"]["files"]
                    if path in files:   # what the tool answered is the sandbox's file
                        assert got == files[path]
                        reads += 1
                    else:
                        assert got == f"error: no such file: {path}"
        made = sum(len(m.get("tool_calls") or []) for m in msgs)
        assert result["metrics"]["tool_calls"] <= made   # calls after a submit are not run
        verdict = await verify_submission(sample_of(row), sandbox=box)
        assert verdict["format"] == float(result["answer"] is not None)
        verdict = verdict["reward"]
        if result["answer"] is None:
            assert verdict == 0.0
        else:  # the submission is in the sandbox, and the verdict is what it says
            submitted += 1
            assert (await box.download(ANSWER_PATH)).decode() == result["answer"]
            assert verdict == float(result["answer"] == row["label"])
        assert len(samples) == 1 and samples[0].response_length > 0
    assert calls >= len(rows), f"the fine-tuned model made {calls} tool calls in {len(rows)} episodes"
    assert reads >= 1 and submitted >= 1, (reads, submitted)


async def test_each_limit_marks_the_episode_truncated(stack, sandboxes, find_file_rows):
    url, _, _ = stack
    row = find_file_rows[1][0]
    greedy = {"temperature": 0.0}
    cases = {
        "max_turns": {"max_turns": 1},
        "turn_max_tokens": {"max_episode_tokens": 5},
        "turn_timeout_s": {"turn_timeout_s": 0.0005},
        "episode_timeout_s": {"episode_timeout_s": 0.0005},
    }
    for stop, limits in cases.items():
        box = await sandboxes(row["metadata"]["files"])
        result, samples, _ = await run_episode(url, task_of(row, box, sampling=greedy, limits=limits), f"lim-{stop}")
        assert result["status"] == "truncated" and result["stop"] == stop, (stop, result)
        if stop == "max_turns":
            assert result["metrics"]["turns"] == 1 and result["answer"] is None
        if stop == "turn_max_tokens":
            assert result["metrics"]["tokens"] <= 5 and samples[0].status == "truncated"
    box = await sandboxes(row["metadata"]["files"])
    result, _, _ = await run_episode(url, task_of(row, box, sampling=greedy), "lim-none")
    # An unparsed call is answered and the episode goes on, so a model that never submits may
    # run to the default turn limit; none of the tight limits above can have fired.
    assert result.get("stop") in (None, "submitted", "max_turns"), result


async def test_malformed_calls_are_answered_and_counted(scripted, sandboxes):
    engine, url = scripted
    box = await sandboxes({"a.txt": "417"})
    engine.replies = [
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',                 # unknown tool
        '<tool_call>\n{"name": "read_file", "arguments": {"file": "a.txt"}}\n</tool_call>',  # bad arguments
        '<tool_call>\n{"name": "read_file", "arguments": {oops}\n</tool_call>',           # does not parse
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "nope.txt"}}\n</tool_call>',  # no such file
        '<tool_call>\n{"name": "bash", "arguments": {"command": "sleep 5"}}\n</tool_call>',  # tool timeout
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "b.txt", "content": "9"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.txt b.txt; exit 3"}}\n</tool_call>',
        '<tool_call>\n{"name": "submit", "arguments": {"answer": "4179"}}\n</tool_call>',
    ]
    task = {"prompt": "go", "sandbox": box, "keep_transcript": True, "limits": {"tool_timeout_s": 0.5},
            "sampling": {"max_tokens": 200}}
    result, samples, _ = await run_episode(url, task, "malformed")
    msgs = result["messages"]
    tool_texts = [m["content"] for m in msgs if m["role"] == "tool"]
    assert tool_texts[0].startswith("error: unknown tool 'rm_rf'")
    assert tool_texts[1].startswith("error: read_file takes string arguments ['path']")
    assert msgs[6]["role"] == "user" and "did not parse" in msgs[6]["content"]   # no call id to answer
    assert tool_texts[2] == "error: no such file: nope.txt"
    assert "timed out after 0.5 s" in tool_texts[3]
    assert tool_texts[4] == "wrote 1 bytes to b.txt" and tool_texts[5] == "4179\n[exit code 3]"
    assert result["stop"] == "submitted" and result["answer"] == "4179" and "status" not in result
    assert result["metrics"]["tool_errors"] == 5 and result["metrics"]["tool_calls"] == 7
    assert result["metrics"]["turns"] == 7
    assert (await box.download("b.txt")) == b"9"
    assert result["metrics"]["parse_errors"] == 1
    assert await verify_submission(types.SimpleNamespace(label="4179"), sandbox=box) == {
        "reward": 1.0, "format": 1.0}
    assert await verify_submission(types.SimpleNamespace(label="417"), sandbox=box) == {
        "reward": 0.0, "format": 1.0}
    assert len(samples) == 1 and samples[0].response_length > 0


async def test_declared_tools_reach_the_template_and_the_output_is_capped(scripted, sandboxes):
    engine, url = scripted
    box = await sandboxes()
    engine.replies = ['<tool_call>\n{"name": "bash", "arguments": {"command": "seq 1 5000"}}\n</tool_call>',
                      "I give up."]
    task = {"prompt": "go", "sandbox": box, "keep_transcript": True, "tools": ["bash", "submit"],
            "max_tool_output_chars": 100}
    result, samples, _ = await run_episode(url, task, "capped")
    out = result["messages"][2]["content"]
    assert out.startswith("1\n2\n3\n") and "more characters cut]" in out and len(out) < 150
    assert result["stop"] == "no_tool_call" and result["answer"] is None
    from miles.tiny import build_tokenizer
    from miles.tito.tokenizer import load_tokenizer
    text = load_tokenizer(str(build_tokenizer())).decode(samples[0].tokens)
    assert '"name": "bash"' in text and '"name": "submit"' in text and '"name": "read_file"' not in text
    assert await verify_submission(types.SimpleNamespace(label="1"), sandbox=box) == {
        "reward": 0.0, "format": 0.0}   # never submitted: the model's mistake, a reward that trains


async def test_unparsed_calls_are_answered_and_the_episode_goes_on(scripted, sandboxes):
    """An unparsed call gets PARSE_ERROR and the next turn (what the SFT transcripts show); an
    episode that never submits ends at max_turns with format 0, never as a failure."""
    from miles.envs.tool_agent import PARSE_ERROR
    engine, url = scripted
    box = await sandboxes({"a.txt": "417"})
    bad = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}\n</tool_call>'
    engine.replies = [bad, bad, '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n'
                      '</tool_call>', '<tool_call>\n{"name": "submit", "arguments": {"answer": "417"}}\n'
                      '</tool_call>']
    task = {"prompt": "go", "sandbox": box, "keep_transcript": True, "sampling": {"max_tokens": 200}}
    result, samples, _ = await run_episode(url, task, "unparsed")
    msgs = result["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"][1:] == [PARSE_ERROR, PARSE_ERROR]
    assert result["stop"] == "submitted" and result["answer"] == "417", result
    assert result["metrics"]["parse_errors"] == 2 and result["metrics"]["turns"] == 4
    assert await verify_submission(types.SimpleNamespace(label="417"), sandbox=box) == {
        "reward": 1.0, "format": 1.0}
    assert len(samples) == 1 and samples[0].status == "completed"
    box = await sandboxes({"a.txt": "417"})
    engine.replies = [bad] * 3
    task = {**task, "sandbox": box, "limits": {"max_turns": 3}}
    result, samples, _ = await run_episode(url, task, "unparsed-always")
    assert result["stop"] == "max_turns" and result["metrics"]["parse_errors"] == 3, result
    assert await verify_submission(types.SimpleNamespace(label="417"), sandbox=box) == {
        "reward": 0.0, "format": 0.0}
    assert len(samples) == 1 and samples[0].response_length > 0


async def test_verify_submission_needs_a_sandbox_and_a_label():
    with pytest.raises(ValueError, match=r"\[sandbox\] backend"):
        await verify_submission(types.SimpleNamespace(label="1"))
    with pytest.raises(ValueError, match="needs a label"):
        await verify_submission(types.SimpleNamespace(label=None), sandbox=object())


def check_exact(sample, generates: list[tuple[dict, dict]], messages: list[dict], tools, tokenizer) -> None:
    """tokens = the engine's outputs (as recorded between smg and the engine) + the template's
    tokens for everything else; loss mask = exactly the engine's tokens; logprobs = the engine's."""
    from miles.tito.families import get_family
    from miles.tito.messages import parse_openai_messages, parse_openai_tools
    from miles.tito.template import render_template

    qwen3 = get_family("qwen3")
    tokens = sample.tokens.tolist()
    prompt_len = len(tokens) - sample.response_length
    is_model = np.zeros(len(tokens), bool)
    logprobs = np.zeros(len(tokens), np.float32)
    assert generates, "the session made no engine call"
    for body, answer in generates:   # every turn: its input is the path so far, its output follows it
        start, out = len(body["input_ids"]), answer["output_ids"]
        assert tokens[:start] == body["input_ids"]
        assert tokens[start:start + len(out)] == out
        is_model[start:start + len(out)] = True
        logprobs[start:start + len(out)] = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    end = len(body["input_ids"]) + len(out)
    assert end == len(tokens), "the sample ends with the last engine output"
    assert not is_model[:prompt_len].any()
    np.testing.assert_array_equal(sample.loss_mask.astype(bool), is_model[prompt_len:])
    np.testing.assert_allclose(sample.rollout_logprobs, logprobs[prompt_len:], rtol=0, atol=1e-6)

    # Everything else is what the family's Jinja template renders for the conversation the agent
    # sent (a full re-render, not TITO's splice). Each model turn is replaced by a marker, so the
    # pieces between markers are exactly the template's text around the model's turns.
    from miles.tito.messages import ChatMessage
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    msgs = parse_openai_messages(messages[: last + 1])
    turn_ix = [i for i, m in enumerate(msgs) if m.role == "assistant"]
    assert len(turn_ix) == len(generates)
    marks = [f"\x00turn{k}\x00" for k in range(len(turn_ix))]
    for k, i in enumerate(turn_ix):
        msgs[i] = ChatMessage(role="assistant", content=marks[k])
    text = render_template(qwen3.chat_template, [m.to_template_dict() for m in msgs],
                           parse_openai_tools(tools) if tools else None, False)
    pieces = []
    for mark in marks:
        head, text = text.split(mark)
        pieces.append(head)
    segments, pos = [], 0   # the non-model token runs, in order
    for body, answer in generates:
        segments.append(tokens[pos:len(body["input_ids"])])
        pos = len(body["input_ids"]) + len(answer["output_ids"])
    for k, (piece, seg) in enumerate(zip(pieces, segments)):
        if k:  # the template closes the previous turn with <|im_end|>; the model may have written it
            prev_out = generates[k - 1][1]["output_ids"]
            if tokenizer.id_to_token(prev_out[-1]) == qwen3.end_of_turn:
                assert piece.startswith(qwen3.end_of_turn)
                piece = piece[len(qwen3.end_of_turn):]
        assert seg == tokenizer.encode(piece), (k, tokenizer.decode(seg), piece)


async def test_every_sample_of_quickstart_episodes_is_token_exact(stack, sandboxes, find_file_rows):
    """The agent quickstart's episodes (its rows, sampling at temperature 1, its limits), once with
    the tool schemas declared and once without: every sample checked by `check_exact`."""
    from miles.envs.tool_agent import tool_specs
    from miles.tito.tokenizer import load_tokenizer

    url, proxy, model_dir = stack
    tokenizer = load_tokenizer(str(model_dir))
    rows = find_file_rows[0][:12]
    limits = {"max_turns": 4, "max_episode_tokens": 160}
    runs = []
    for i, row in enumerate(rows):
        declare = i % 3 == 0
        task = task_of(row, await sandboxes(row["metadata"]["files"]), limits=limits, declare_tools=declare,
                       sampling={"temperature": 1.0, "max_tokens": 48, "seed": i})
        runs.append((task, run_episode(url, task, f"exact-{i}")))
    results = await asyncio.gather(*(r for _, r in runs))
    turns = 0
    for (task, _), (result, samples, sid) in zip(runs, results):
        assert len(samples) == 1, samples
        tools = tool_specs(task["tools"]) if task["declare_tools"] else None
        check_exact(samples[0], proxy.for_session(sid), result["messages"], tools, tokenizer)
        turns += result["metrics"]["turns"]
    assert turns > len(rows), "some episodes went past their first turn (a tool was called)"


@pytest.mark.parametrize("who", ["current", "nobody"])
async def test_file_tools_run_as_the_sandbox_user(sandboxes, who):
    """With `task["sandbox_user"]`, read_file and write_file go through `exec(user=)` like bash, so
    the user's permissions hold for every tool. Content with shell metacharacters and bytes that
    are not text survive the round trip (base64 in argv); a user the backend cannot switch to is
    the tool's error, naming the user, and nothing is written."""
    from miles.envs.tool_agent import TOOLS, ToolRunner
    from miles.sandboxes.local import current_user
    box = await sandboxes({"seed.txt": "412"})
    user = current_user()[0] if who == "current" else "nobody"
    runner = ToolRunner(box, set(TOOLS), timeout_s=10.0, max_chars=4000, user=user)
    content = "a'b\"c $(echo no) `x` \\n ; | & \u00e9\n"
    wrote, err = await runner.run("write_file", {"path": "sub/dir/out.txt", "content": content})
    if who == "current":
        assert not err and wrote == f"wrote {len(content.encode())} bytes to sub/dir/out.txt"
        assert (await box.download("sub/dir/out.txt")).decode() == content
        assert await runner.run("read_file", {"path": "sub/dir/out.txt"}) == (content, False)
        text, err = await runner.run("read_file", {"path": "missing.txt"})
        assert err and text.startswith(f"error: read_file missing.txt as {user}:"), text
    else:
        assert err and "nobody" in wrote, wrote
        with pytest.raises(FileNotFoundError):
            await box.download("sub/dir/out.txt")
        text, err = await runner.run("read_file", {"path": "seed.txt"})
        assert err and "nobody" in text, text
