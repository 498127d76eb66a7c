"""The SWE harness through the real session server (a scripted engine writes the model's turns as
`<tool_call>` blocks): the tools act on a real sandbox holding the task's repository, the fix made
through `edit` is what the verifier scores, bad calls are answered rather than fatal, and the
tools themselves (line ranges, insert, search) do what their schemas say."""

from __future__ import annotations

import json

import pytest

from miles.agentic.swe.harness import SWERunner, agent
from miles.agentic.swe.scripted import episode, malformed, sft_rows
from miles.agentic.swe.tasks import tasks
from miles.agentic.swe.verify import verify
from miles.envs.agent import run_agent_group

ROWS = tasks(seed=0)["test"]


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def task_of(row: dict, sandbox) -> dict:
    return {**row["metadata"], "prompt": row["prompt"], "label": row["label"], "sandbox": sandbox,
            "keep_transcript": True, "sampling": {"max_tokens": 400},
            "limits": {"max_turns": 8, "max_episode_tokens": 4000, "tool_timeout_s": 20.0}}


async def test_the_fix_made_through_the_tools_is_what_the_verifier_scores(scripted_session, host_sandboxes):
    engine, url = scripted_session
    row = ROWS[2]
    fix = row["metadata"]["fix"]
    box = await host_sandboxes(row["metadata"]["files"])
    engine.replies = [call("search", pattern="def ", path=fix["path"]),
                      call("view", path=fix["path"], start=fix["start"], end=fix["end"]),
                      call("edit", path=fix["path"], start=str(fix["start"]), end=fix["end"], text=fix["text"]),
                      call("bash", command="python3 run_tests.py"),
                      call("submit")]
    captured = {}

    async def harness(base_url, task):
        captured.update(await agent(base_url, task))
        return captured

    samples = await run_agent_group(harness, task_of(row, box), 1, url)
    assert captured["stop"] == "submitted" and "status" not in captured, captured["stop"]
    assert captured["metrics"]["turns"] == 5 and captured["metrics"]["tool_errors"] == 0
    assert captured["metrics"]["edits"] == 1
    assert captured["patch"] == row["label"]          # the model patch is the gold patch
    tools = [m for m in captured["messages"] if m["role"] == "tool"]
    assert f"{fix['start']:>4}| " in tools[1]["content"]                 # view numbers the lines
    assert tools[2]["content"].startswith(f"edited {fix['path']}: lines {fix['start']}..{fix['end']}")
    assert '"passed"' in tools[3]["content"] and "[exit code" not in tools[3]["content"]
    assert '"name": "edit"' in engine.prompts[0]        # the schemas were offered to the model
    assert len(samples) == 1 and samples[0].loss_mask.sum() > 0
    reward = await verify(samples[0].__class__(tokens=samples[0].tokens, metadata=row["metadata"]), sandbox=box)
    assert reward == {"resolved": 1.0, "pass_frac": 1.0, "fail_to_pass": 1.0, "format": 1.0}


async def test_bad_calls_are_answered_and_prose_ends_the_episode(scripted_session, host_sandboxes):
    engine, url = scripted_session
    row = ROWS[3]
    path = row["metadata"]["fix"]["path"]
    box = await host_sandboxes(row["metadata"]["files"])
    engine.replies = [call("edit", path=path, start=999, end=999, text="x"),
                      call("view", path=path, start="one"),
                      call("teleport"),
                      call("view", path="no/such.py"),
                      "I give up."]
    captured = {}

    async def harness(base_url, task):
        captured.update(await agent(base_url, task))
        return captured

    await run_agent_group(harness, task_of(row, box), 1, url)
    tools = [m["content"] for m in captured["messages"] if m["role"] == "tool"]
    assert tools[0].startswith("error: edit: start = 999") and "lines" in tools[0]
    assert tools[1] == "error: view: start must be an integer, got \"one\""
    assert tools[2].startswith("error: unknown tool 'teleport'")
    assert tools[3] == "error: no such file: no/such.py"
    assert captured["stop"] == "no_tool_call" and captured["metrics"]["tool_errors"] == 4
    assert "patch" in captured and captured["patch"] == ""   # nothing changed
    reward = await verify(type("S", (), {"metadata": row["metadata"]})(), sandbox=box)
    assert reward["resolved"] == 0.0


async def test_view_edit_insert_delete_and_search_on_a_sandbox(host_sandboxes):
    box = await host_sandboxes({"m.py": "a = 1\nb = 2\nc = 3\n"})
    runner = SWERunner(box, 10.0)

    async def run(name, **args):
        text, err = await runner.run(name, json.dumps(args))
        assert not err, text
        return text

    assert await run("view", path="m.py", start=2) == "   2| b = 2\n   3| c = 3\n"
    await run("edit", path="m.py", start=2, end=1, text="x = 0")            # insert before line 2
    assert (await box.download("m.py")).decode() == "a = 1\nx = 0\nb = 2\nc = 3\n"
    await run("edit", path="m.py", start=3, end=4, text="")                 # delete lines 3..4
    assert (await box.download("m.py")).decode() == "a = 1\nx = 0\n"
    assert await run("search", pattern="x = [0-9]") == "./m.py:2:x = 0\n"
    assert await run("search", pattern="nothing here") == "no matches"
    text, err = await runner.run("edit", json.dumps({"path": "m.py", "start": 1, "end": 0}))
    assert err and text == "error: edit needs 'text' (arguments: ['end', 'path', 'start', 'text'])"
    text, err = await runner.run("search", json.dumps({"pattern": "(", "path": "."}))
    assert err and "grep exited 2" in text
    assert await run("submit") == "submitted" and runner.submitted
    with pytest.raises(AssertionError):
        await run("view", path="m.py", start=9)


@pytest.mark.parametrize("declare", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("recover", [False, True], ids=["oracle", "recovery"])
async def test_sft_rows_are_token_for_token_what_the_harness_renders(scripted_session, host_sandboxes,
                                                                     recover, declare):
    """Each SFT row's prompt is the engine's input ids at that turn of a real episode (session
    server, harness, sandbox), and its label is the turn's reply; the recovery transcript's
    malformed call gets the harness's parse error, and its episode is scored, not failed."""
    from miles.envs.tool_agent import PARSE_ERROR
    engine, url = scripted_session
    row = {**ROWS[0], "metadata": {**ROWS[0]["metadata"], "declare_tools": declare}}
    rows = sft_rows([row])                  # task 0 gives the plain transcript and the recovery
    n = len(episode(row["metadata"]))
    rows = rows[n:] if recover else rows[:n]
    assert len(rows) == n
    name, args, _ = episode(row["metadata"])[0]
    engine.replies = ([malformed(name, args)] if recover else []) + [r["label"] for r in rows]
    box = await host_sandboxes(row["metadata"]["files"])
    captured = {}

    async def harness(base_url, task):
        captured.update(await agent(base_url, task))
        return captured

    samples = await run_agent_group(harness, task_of(row, box), 1, url)
    assert captured["stop"] == "submitted" and captured["parse_errors"] == int(recover)
    turns = engine.prompt_ids[int(recover):]
    assert len(turns) == n
    for k, r in enumerate(rows):
        assert turns[k] == engine.tokenizer.encode(r["prompt"]), (k, engine.prompts[k + int(recover)][-300:])
    if recover:
        assert PARSE_ERROR in engine.prompts[1] and engine.prompts[1] == rows[0]["prompt"]
    sample = samples[0]
    assert sample.status == "completed"
    meta = {**row["metadata"], "agent": {"parse_errors": captured["parse_errors"]}}
    reward = await verify(sample.__class__(tokens=sample.tokens, metadata=meta), sandbox=box)
    assert reward["resolved"] == 1.0 and reward["format"] == float(not recover), reward


async def test_an_unparseable_call_is_scored_zero_with_its_format_and_not_failed(scripted_session,
                                                                                host_sandboxes):
    engine, url = scripted_session
    row = ROWS[1]
    box = await host_sandboxes(row["metadata"]["files"])
    engine.replies = [malformed("search", {"pattern": row["metadata"]["fn"]}), "I give up."]
    captured = {}

    async def harness(base_url, task):
        captured.update(await agent(base_url, task))
        return captured

    samples = await run_agent_group(harness, task_of(row, box), 1, url)
    assert captured["parse_errors"] == 1 and captured["metrics"]["parse_errors"] == 1.0
    assert samples[0].status == "completed" and samples[0].loss_mask.sum() > 0   # it is trained on
    meta = {**row["metadata"], "agent": {"parse_errors": captured["parse_errors"]}}
    reward = await verify(type("S", (), {"metadata": meta})(), sandbox=box)
    assert reward["resolved"] == 0.0 and reward["format"] == 0.0, reward
