"""Scripted SWE agents: the oracle (applies the task's known fix) and the null agent (does nothing).

They prove the verifiers, as Terminal-Bench validates its tasks with oracle runs: every task must
give 1.0 to the oracle and 0.0 to the null agent. Both act through the harness's own tools
(`SWERunner`: the same `view`/`edit`/`bash`/`submit` code, in the same sandbox the model gets),
so a task whose fix cannot be made through the tools fails here too.

    actions = oracle_actions(row["metadata"])           # [(tool, arguments), ...]
    await play(SWERunner(sandbox, timeout_s=30), actions)

As `rollout.agent`s (`oracle_agent`, `null_agent`) they make one model call first (one token,
so the session has a turn to collect: an episode without one is `aborted` and never verified),
then play their script; a recipe or an eval run with them must score 1.0 / 0.0 per episode.

`transcript(row)` is the oracle's episode as OpenAI messages (view, edit, submit; the tool results
computed from the task's files by the harness's own `view_lines`/`edit_lines`), and `sft_rows`
renders them into the warm-start's prompt/label rows, tools included, exactly as the session
server renders the RL prompts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from miles.agentic.swe.harness import SWERunner, edit_lines, tool_specs, view_lines
from miles.envs.tool_agent import DEFAULT_LIMITS, _chat, _first_messages

Action = tuple[str, dict[str, Any]]


class ScriptError(RuntimeError):
    """A scripted step failed where it must not (the oracle's fix did not apply, its tests failed)."""


def oracle_actions(meta: dict[str, Any]) -> list[Action]:
    """Look at the lines, replace them with the fix, run the visible tests, submit."""
    fix = meta["fix"]
    return [("search", {"pattern": "def ", "path": fix["path"]}),
            ("view", {"path": fix["path"], "start": fix["start"], "end": fix["end"]}),
            ("edit", {"path": fix["path"], "start": fix["start"], "end": fix["end"], "text": fix["text"]}),
            ("bash", {"command": meta["test_command"]}),
            ("submit", {})]


def null_actions(meta: dict[str, Any]) -> list[Action]:
    return [("submit", {})]


async def play(runner: SWERunner, actions: list[Action], *, strict: bool = True) -> list[tuple[str, str, bool]]:
    """Run the actions through the runner; (tool, output, is_error) each. `strict`: a tool error,
    or visible tests that still fail after the edit, raise `ScriptError`."""
    out = []
    for name, args in actions:
        text, is_error = await runner.run(name, json.dumps(args))
        out.append((name, text, is_error))
        failed_tests = name == "bash" and "[exit code" in text
        if strict and (is_error or failed_tests):
            raise ScriptError(f"scripted {name}({json.dumps(args)[:200]}) failed: {text[-500:]}")
    return out


async def _scripted(base_url: str, task: dict[str, Any], actions: list[Action]) -> dict[str, Any]:
    limits = {**DEFAULT_LIMITS, **(task.get("limits") or {})}
    headers = {"Authorization": f"Bearer {task['api_key']}"} if task.get("api_key") else {}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers=headers) as http:
        body = {"messages": _first_messages(task), "max_tokens": 1, "temperature": 0.0}
        await _chat(http, base_url.rstrip("/") + "/v1/chat/completions", body, float(limits["turn_timeout_s"]))
    t1 = time.monotonic()
    steps = await play(SWERunner(task["sandbox"], float(limits["tool_timeout_s"])), actions)
    return {"metrics": {"turns": 1.0, "tool_calls": float(len(steps)),
                        "tool_errors": float(sum(e for _, _, e in steps)), "chat_s": t1 - t0,
                        "tool_s": time.monotonic() - t1},
            "stop": "submitted", "episode_s": time.monotonic() - t0}


async def oracle_agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one model call, then the known fix through the harness's tools."""
    return await _scripted(base_url, task, oracle_actions(task))


async def null_agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one model call, then submit the repository unchanged."""
    return await _scripted(base_url, task, null_actions(task))


def transcript(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The oracle's episode of a task as OpenAI messages: view the lines, edit them, submit."""
    fix = row["metadata"]["fix"]
    lines = row["metadata"]["files"][fix["path"]].splitlines(keepends=True)
    span = {"path": fix["path"], "start": fix["start"], "end": fix["end"]}
    _, edited = edit_lines(lines, fix["path"], fix["start"], fix["end"], fix["text"])
    steps = [("view", span, view_lines(lines, fix["path"], fix["start"], fix["end"])),
             ("edit", {**span, "text": fix["text"]}, edited), ("submit", {}, None)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    for i, (name, args, result) in enumerate(steps):
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        if result is not None:
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
    return messages


def sft_rows(rows: list[dict[str, Any]], family: str = "qwen3") -> list[dict[str, Any]]:
    """One prompt/label row per assistant turn of each task's oracle transcript."""
    from miles.tito.families import get_family
    from miles.tito.messages import parse_openai_messages, parse_openai_tools

    fam = get_family(family)
    tools = parse_openai_tools(tool_specs())
    out = []
    for row in rows:
        messages = parse_openai_messages(transcript(row))
        for k, m in enumerate(messages):
            if m.role == "assistant":
                label = fam.generation_text(m)
                out.append({"prompt": fam.render(messages[:k], tools, 0, True),
                            "label": label[: -len(fam.end_of_turn)]})
    return out
