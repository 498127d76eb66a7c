"""The terminal agent, its Harbor verifier, and the oracle and null agents.

    [rollout]
    agent = "miles.agentic.terminal.agent:agent"
    reward = "miles.agentic.terminal.agent:verify"

Design decisions:
- The agent is the built-in tool agent (`miles.envs.tool_agent`) with the terminal's tools: `bash`
  (a command in the episode's sandbox; its output, stdout then stderr, capped at
  `MAX_OUTPUT_CHARS` with a marker; a non-zero exit shown as `[exit code N]`; a command past
  `agent.tool_timeout_s` is killed inside the sandbox and answered with the timeout) and `submit`
  (ends the episode). One ReAct loop for every agentic recipe: what differs is the task's tools,
  system prompt and output cap, which the rows carry and `agent` only defaults.
- The agent's and the oracle's commands run as the task's `[agent] user` (None: the sandbox's
  default), the verifier's as `[verifier] user`, as Harbor runs them.
- The verifier is Harbor's (`miles.sandboxes.harbor.run_verifier`): after the agent is done it
  wipes /tests and /logs/verifier, uploads the task's tests/, runs tests/test.sh and reads
  reward.txt. The agent never sees the tests. A verifier that timed out or wrote no reward raises
  (the episode's samples become `failed`): an infrastructure failure must not train as reward 0.
  The reward is `{"reward": reward.txt, "format": 1 when the agent submitted}` (as
  `tool_agent.verify_submission`'s; `train.reward_key = "reward"`).
- The oracle and the null agent act on a sandbox through the same `ToolRunner` the model's calls
  go through: the oracle sends solution/solve.sh's commands to `bash`, then `submit`s; the null
  agent only submits. `check_task` runs one of them and the verifier on a fresh sandbox, which is
  how the task set is validated (oracle 1.0, null 0.0 on every task).
- As `rollout.agent`s (`oracle_agent`, `null_agent`) they make one model call first (one token, so
  the session has a turn to collect: an episode without one is never verified), then act. A run or
  an evaluation with `rollout.agent = "miles.agentic.terminal.agent:oracle_agent"` must score 1.0
  per episode (pass@k = 1), with the null agent 0.0: the whole path (sessions, sandboxes, verifier,
  rewards, eval modes) checked without a model that can solve the tasks.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from miles.agentic.terminal.tasks import SYSTEM, TOOLS, ensure_task, oracle_command
from miles.envs import tool_agent

MAX_OUTPUT_CHARS = 4096


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """One terminal episode (the `rollout.agent` contract)."""
    task = {"tools": TOOLS, "system": SYSTEM, "max_tool_output_chars": MAX_OUTPUT_CHARS,
            "sandbox_user": agent_user(task), **task}
    return await tool_agent.agent(base_url, task)


def agent_user(metadata: dict[str, Any]) -> str | None:
    """The task's `[agent] user` (Harbor's task.toml), whom the agent's commands run as; None for
    a row that names no task directory."""
    from miles.sandboxes.harbor import load_task
    return load_task(ensure_task(metadata)).agent_user if "task_dir" in metadata else None


async def _real(sandbox: Any) -> Any:
    """The Sandbox itself: the episode's lazy proxy is created on first use (a null agent never
    ran a command) and times tool calls, which the verifier's calls are not."""
    return await sandbox.get() if hasattr(sandbox, "get") else sandbox


async def verify(sample: Any, sandbox: Any = None) -> dict[str, float]:
    """The Harbor verifier of the row's task, on the episode's sandbox: {"reward": the task's
    reward.txt, "format": 1.0 when the episode ended with a submit}."""
    from miles.sandboxes.harbor import load_task, run_verifier
    if sandbox is None:
        raise ValueError("the terminal verifier runs tests/test.sh in the episode's sandbox: set "
                         "[sandbox] backend (subprocess, bwrap or docker)")
    task = load_task(ensure_task(sample.metadata))
    real = await _real(sandbox)
    done = await tool_agent.submitted(real) is not None
    # a task with a separate verifier gets a fresh sandbox riding on the episode's pool slot
    result = await run_verifier(real, task, open_sandbox=getattr(sandbox, "open_another", None))
    if result.status != "ok":
        raise RuntimeError(f"verifier of {task.name}: {result.status}: {result.detail} "
                           f"(output: {result.output[-300:]!r})")
    return {tool_agent.REWARD_KEY: float(result.reward), "format": float(done)}


def runner(sandbox: Any, timeout_s: float = 30.0, user: str | None = None) -> tool_agent.ToolRunner:
    return tool_agent.ToolRunner(sandbox, set(TOOLS), timeout_s, MAX_OUTPUT_CHARS, user)


async def oracle(sandbox: Any, metadata: dict[str, Any], timeout_s: float = 30.0) -> str:
    """The oracle: solve.sh's commands through the bash tool, then submit. Returns bash's answer."""
    tools = runner(sandbox, timeout_s, agent_user(metadata))
    text, is_error = await tools.run("bash", {"command": oracle_command(ensure_task(metadata))})
    if is_error:
        raise RuntimeError(f"oracle of {metadata.get('task_name')}: bash failed: {text}")
    await tools.run("submit", {"answer": "done"})
    return text


async def null(sandbox: Any, metadata: dict[str, Any], timeout_s: float = 30.0) -> str:
    """The null agent: submits at once."""
    text, _ = await runner(sandbox, timeout_s).run("submit", {"answer": "nothing"})
    return text


async def check_task(sandbox: Any, metadata: dict[str, Any], who: str = "oracle") -> tuple[float, str]:
    """Run the oracle (or `null`) on a fresh sandbox of the task, then the verifier: (reward, its
    output)."""
    from miles.sandboxes.harbor import load_task, run_verifier
    if who not in ("oracle", "null"):
        raise ValueError(f"who={who!r}: expected 'oracle' or 'null'")
    await (oracle if who == "oracle" else null)(sandbox, metadata)
    result = await run_verifier(await _real(sandbox), load_task(ensure_task(metadata)),
                                open_sandbox=getattr(sandbox, "open_another", None))
    if result.status != "ok":
        raise RuntimeError(f"verifier of {metadata.get('task_name')}: {result.status}: {result.detail}")
    return float(result.reward), result.output


async def _scripted(base_url: str, task: dict[str, Any], act) -> dict[str, Any]:
    limits = {**tool_agent.DEFAULT_LIMITS, **(task.get("limits") or {})}
    headers = {"Authorization": f"Bearer {task['api_key']}"} if task.get("api_key") else {}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers=headers) as http:
        body = {"messages": tool_agent._first_messages(task), "max_tokens": 1, "temperature": 0.0}
        await tool_agent._chat(http, base_url.rstrip("/") + "/v1/chat/completions", body,
                               float(limits["turn_timeout_s"]))
    t1 = time.monotonic()
    await act(task["sandbox"], task, float(limits["tool_timeout_s"]))
    calls = 2.0 if act is oracle else 1.0
    return {"metrics": {"turns": 1.0, "tool_calls": calls, "tool_errors": 0.0, "chat_s": t1 - t0,
                        "tool_s": time.monotonic() - t1},
            "stop": "submitted", "answer": "done", "episode_s": time.monotonic() - t0}


async def oracle_agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one model call, then the oracle's commands through the bash tool."""
    return await _scripted(base_url, task, oracle)


async def null_agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one model call, then submit without doing anything."""
    return await _scripted(base_url, task, null)
