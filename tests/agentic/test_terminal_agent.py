"""The terminal agent end to end through the real session server: a scripted engine answers each turn
with the text a model would write (the oracle's commands as a `bash` tool call, a wrong command, a
hanging one, a flood of output); the session server parses the tool calls; the agent runs them in
the task's fresh sandbox (made as the episode runner makes it); the Harbor verifier scores the
sandbox afterwards; the session's samples hold exactly the model's turns under the loss mask."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import types

import pytest
import pytest_asyncio

from miles.agentic.terminal import agent as term
from miles.agentic.terminal.tasks import oracle_command, terminal_tasks
from miles.envs.context import EpisodeStats, LazySandbox, sandbox_spec
from miles.sandboxes.config import SandboxConfig
from miles.sandboxes import SandboxPool, get_backend
from miles.sandboxes.hostfs import default_base_dir
from miles.tito.client import SessionServerClient
from tests.scripted_engine import scripted_session_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served():
    """(scripted engine, session server url), both in this process on real sockets."""
    async with scripted_session_server(family=None) as pair:
        yield pair


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    splits = terminal_tasks(seed=3, out_dir=tmp_path_factory.mktemp("terminal-tasks"))
    return splits["test"]


@pytest_asyncio.fixture(loop_scope="module")
async def pool():
    base = tempfile.mkdtemp(prefix="miles-term-agent-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    p = SandboxPool(get_backend("subprocess", base_dir=base), max_concurrent=4, run_id="term-agent")
    try:
        yield p
    finally:
        await p.close()
        left = await p.sweep()
        await p.backend.close()
        shutil.rmtree(base, ignore_errors=True)
        assert left == 0 and p.stats.live == 0, f"{left} sandboxes outlived their test"


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


async def episode(url: str, pool, row: dict, replies: list[str], engine, **limits):
    """One episode as the framework runs it: a session, the row's sandbox, the agent, the verifier."""
    engine.replies = list(replies)
    m = row["metadata"]
    sandbox = LazySandbox(pool, sandbox_spec(SandboxConfig(backend="subprocess"), m, {}), m["files"],
                          EpisodeStats(), limits.get("tool_timeout_s", 10.0))
    task = {**m, "prompt": row["prompt"], "label": row["label"], "sandbox": sandbox, "keep_transcript": True,
            "limits": {"max_turns": 6, "max_episode_tokens": 8192, **limits}, "sampling": {"max_tokens": 2048}}
    try:
        async with SessionServerClient(url) as client:
            created = await client.create_session(rollout_id=m["task_name"])
            try:
                result = await term.agent(created["base_url"], task)
            finally:
                samples = await client.collect(created["session_id"], close=True)
        verdict = await term.verify(types.SimpleNamespace(metadata=m), sandbox)
        assert verdict["format"] == float(result["stop"] == "submitted"), (verdict, result["stop"])
        reward = verdict["reward"]
    finally:
        await sandbox.destroy()
    return result, samples, reward


async def test_oracle_commands_as_model_tool_calls_score_one(served, rows, pool):
    engine, url = served
    for row in rows[:3]:
        command = oracle_command(row["metadata"]["task_dir"])
        result, samples, reward = await episode(url, pool, row, [call("bash", command=command),
                                                                 call("submit", answer="done")], engine)
        assert reward == 1.0, (row["metadata"]["task_name"], result["messages"][-2:])
        assert result["stop"] == "submitted" and result["metrics"]["tool_calls"] == 2
        msgs = result["messages"]
        assert msgs[0]["role"] == "system" and "bash tool" in msgs[0]["content"]
        assert msgs[2]["tool_calls"][0]["function"]["name"] == "bash"   # parsed by the session server
        assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {"command": command}
        # one trajectory: the model's two turns under the loss mask, nothing else
        replies = [call("bash", command=command), call("submit", answer="done")]
        assert len(samples) == 1
        end = engine.tokenizer.token_id("<|im_end|>")
        want = [t for r in replies for t in engine.tokenizer.encode(r) + [end]]
        s = samples[0]
        response = s.tokens[len(s.tokens) - s.response_length:]
        assert response[s.loss_mask.astype(bool)].tolist() == want


async def test_wrong_or_no_work_scores_zero(served, rows, pool):
    engine, url = served
    row = rows[0]
    _, _, reward = await episode(url, pool, row, [call("bash", command="echo 42 > /workspace/answer.txt"),
                                                  call("submit", answer="42")], engine)
    assert reward == 0.0
    result, _, reward = await episode(url, pool, row, ["I cannot do that."], engine)
    assert (reward, result["stop"], result["metrics"]["tool_calls"]) == (0.0, "no_tool_call", 0.0)


async def test_the_shell_tool_times_out_and_caps_output(served, rows, pool):
    engine, url = served
    row = rows[1]
    command = oracle_command(row["metadata"]["task_dir"])
    result, _, reward = await episode(url, pool, row, [
        call("bash", command="sleep 30"), call("bash", command="seq 1 100000"),
        call("bash", command="ls /tests; exit 3"), call("bash", command=command), call("submit", answer="ok")],
        engine, tool_timeout_s=1.0)
    tools = [m["content"] for m in result["messages"] if m["role"] == "tool"]
    assert "timed out after 1.0 s" in tools[0]
    assert len(tools[1]) < term.MAX_OUTPUT_CHARS + 100 and "more characters cut" in tools[1]
    assert tools[1].startswith("1\n2\n3\n")
    assert "[exit code 3]" in tools[2]                       # the hidden tests are not there yet
    assert result["metrics"]["tool_errors"] == 1.0 and result["stop"] == "submitted"
    assert reward == 1.0                                     # a timed-out command does not end the episode


@pytest.mark.parametrize("who", ["current", "nobody"])
async def test_the_agents_commands_run_as_the_tasks_agent_user(served, rows, pool, tmp_path, who):
    """`[agent] user` in task.toml reaches the bash tool's exec (`Sandbox.exec(user=)`): the
    subprocess backend runs the current user's commands, and answers another user's with an error
    naming the user and the backend (the episode goes on; nothing ran, so the reward is 0)."""
    from miles.sandboxes.local import current_user
    row = rows[0]
    task_dir = tmp_path / "task"
    shutil.copytree(row["metadata"]["task_dir"], task_dir)
    user = current_user()[0] if who == "current" else "nobody"
    toml = (task_dir / "task.toml").read_text()
    assert "\n[agent]\n" in toml
    (task_dir / "task.toml").write_text(toml.replace("\n[agent]\n", f'\n[agent]\nuser = "{user}"\n'))
    row = {**row, "metadata": {**row["metadata"], "task_dir": str(task_dir)}}
    assert term.agent_user(row["metadata"]) == user
    command = oracle_command(task_dir)
    result, _, reward = await episode(url=served[1], pool=pool, row=row, engine=served[0],
                                      replies=[call("bash", command=command), call("submit", answer="done")])
    tools = [m["content"] for m in result["messages"] if m["role"] == "tool"]
    if who == "current":
        assert reward == 1.0 and result["metrics"]["tool_errors"] == 0.0, tools
    else:
        assert reward == 0.0 and result["metrics"]["tool_errors"] == 1.0
        assert "cannot run commands as user 'nobody'" in tools[0] and "subprocess" in tools[0], tools


async def test_verifier_needs_a_sandbox_and_a_terminal_row():
    with pytest.raises(ValueError, match=r"\[sandbox\] backend"):
        await term.verify(types.SimpleNamespace(metadata={}), None)
    with pytest.raises(ValueError, match="metadata\\['task_dir'\\] is missing"):
        await term.verify(types.SimpleNamespace(metadata={"files": {}}), object())


async def test_scripted_agents_and_the_external_evaluator_score_pass_at_k(served, rows):
    """`run_rows` (the external eval mode's episodes) with the oracle and null `rollout.agent`s:
    pass@k is 1.0 and 0.0, every episode verified, the timings add up."""
    from miles.agentic.terminal.evaluate import run_rows, summary
    _, url = served
    base = tempfile.mkdtemp(prefix="miles-term-eval-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    try:
        for agent_fn, want in ((term.oracle_agent, 1.0), (term.null_agent, 0.0)):
            result = await run_rows(url, rows[:4], k=2, temperature=0.7, backend_options={"base_dir": base},
                                    agent_fn=agent_fn, concurrency=4)
            out = summary(result)
            assert (out["pass@1"], out["pass@k"], out["reward"]) == (want, want, want), out
            assert (out["k"], out["n"], out["verifier_errors"]) == (2.0, 4.0, 0.0)
            assert 0.0 < out["sandbox_share"] < 1.0 and out["episodes_per_s"] > 0
            assert all(e["error"] == "" for e in result["episodes"]), result["episodes"][0]
    finally:
        shutil.rmtree(base, ignore_errors=True)
