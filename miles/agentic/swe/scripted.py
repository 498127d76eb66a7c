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

`transcript(row)` is the oracle's episode as OpenAI messages (search, view, edit, submit; the tool
results computed from the task's files by the harness's own `view_lines`/`edit_lines` and
`search_lines`), and `sft_rows` renders them into the warm-start's prompt/label rows, tools
included, exactly as the session server renders the RL prompts.

Design decisions:
- The oracle knows only what an agent can: every argument of its calls is in the issue or in an
  earlier tool result of the episode (the function's name from the issue, the path from the
  search hit, the line numbers from the view, the new text from the view's line and the issue's
  words). It never reads `metadata["fix"]` for a path or a line number it has not been shown;
  `tests/agentic/test_swe_tasks.py` checks this over every transcript of the task set.
- Some transcripts recover from a malformed call: the first call does not parse, the harness
  answers with the tool agent's `PARSE_ERROR`, the oracle makes the call again. The malformed turn
  is in the prompt of the next rows, never a label: SFT shows what rollout shows after a mistake.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import aiohttp

from miles.agentic.swe.harness import SWERunner, edit_lines, tool_specs, view_lines
from miles.envs.tool_agent import DEFAULT_LIMITS, PARSE_ERROR, _chat, _first_messages

RECOVERY_EVERY = 4
Action = tuple[str, dict[str, Any]]


class ScriptError(RuntimeError):
    """A scripted step failed where it must not (the oracle's fix did not apply, its tests failed)."""


def search_lines(files: dict[str, str], pattern: str, path: str = ".") -> str:
    """What `search` answers on a repository holding `files` (grep -rnE, hits sorted by path and
    line), for the transcripts: the oracle's episode is computed, not recorded."""
    rx, under = re.compile(pattern), path.removeprefix(".").removeprefix("/")
    hits = [(f"./{p}", i, line) for p, text in files.items() if p.startswith(under)
            for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]
    return "".join(f"{p}:{i}:{line}\n" for p, i, line in sorted(hits)) or "no matches"


def episode(meta: dict[str, Any]) -> list[tuple[str, dict[str, Any], str | None]]:
    """The oracle's steps, (tool, arguments, result), each argument taken from the issue or an
    earlier result: search the function the issue names, view the whole file of the first hit,
    edit the lines that view numbered, submit. Raises `ScriptError` when the task does not allow
    it (the first hit is not the definition)."""
    fn, files, fix = meta["fn"], meta["files"], meta["fix"]
    found = search_lines(files, fn)
    first = found.splitlines()[0]
    path = first.split(":", 1)[0].removeprefix("./")
    if path != fix["path"] or f"def {fn}(" not in first:
        raise ScriptError(f"{meta['task_id']}: the first hit of {fn!r} is {first!r}, not its definition")
    lines = files[path].splitlines(keepends=True)
    _, edited = edit_lines(lines, path, fix["start"], fix["end"], fix["text"])
    return [("search", {"pattern": fn}, found), ("view", {"path": path}, view_lines(lines, path)),
            ("edit", {"path": path, "start": fix["start"], "end": fix["end"], "text": fix["text"]}, edited),
            ("submit", {}, None)]


def oracle_actions(meta: dict[str, Any]) -> list[Action]:
    """The calls of the oracle's episode (`episode`): search, view, edit, submit."""
    return [(name, args) for name, args, _ in episode(meta)]


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


def malformed(name: str, args: dict[str, Any]) -> str:
    """A tool call that does not parse (its JSON lacks the closing brace): the recovery
    transcripts' first turn, answered by the harness with `PARSE_ERROR`."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}\n</tool_call>'


def transcript(row: dict[str, Any], recover: bool = False) -> list[dict[str, Any]]:
    """The oracle's episode of a task as OpenAI messages (`episode`). `recover`: the first call
    is malformed (`malformed`), the harness answers `PARSE_ERROR` as it does at rollout, and the
    oracle then makes the right call."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    steps = episode(row["metadata"])
    if recover:
        name, args, _ = steps[0]
        messages += [{"role": "assistant", "content": malformed(name, args), "unparsed": True},
                     {"role": "user", "content": PARSE_ERROR}]
    for i, (name, args, result) in enumerate(steps):
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        if result is not None:
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
    return messages


def sft_rows(rows: list[dict[str, Any]], family: str = "qwen3") -> list[dict[str, Any]]:
    """One prompt/label row per well-formed assistant turn of each task's oracle transcript; every
    `RECOVERY_EVERY`-th task also gives its recovery transcript (`transcript(recover=True)`)."""
    from miles.tito.sft import transcript_rows

    specs = tool_specs()
    return transcript_rows(((transcript(row, recover), specs if row["metadata"].get("declare_tools", True)
                             else None)
                            for i, row in enumerate(rows)
                            for recover in ([False, True] if i % RECOVERY_EVERY == 0 else [False])),
                           family)
