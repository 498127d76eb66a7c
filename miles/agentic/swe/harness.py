"""The SWE harness: a mini-SWE-agent-style coding agent over the session's OpenAI endpoint.

    [rollout]
    agent = "miles.agentic.swe.harness:agent"
    reward = "miles.agentic.swe.verify:verify"

Five tools (`TOOLS`): `bash` (a shell command in the repository), `view` (lines start..end of a
file, numbered), `edit` (replace lines start..end with text), `search` (grep -rnE), `submit`
(end the episode; the repository as it is then is the submission). Each episode gets a fresh
sandbox with the task's repository (`metadata["files"]`, written by the framework when the first
tool call creates it); the verifier runs the hidden tests there after the agent is done.

Design decisions:
- Built from the tool agent's pieces (`miles.envs.tool_agent`): its `ToolRunner` runs `bash`
  (exit codes, timeouts, output caps as that agent has them), its chat call, limits, parse-error
  answer and first messages are used as they are; this module adds the line-range tools and the
  loop that offers them. The loop is the tool agent's (one model call per turn, every tool call
  answered with a `tool` message, the reply's message sent back as the server returned it).
- Line numbers are 1-based and inclusive, as `view` prints them; `edit` with end = start - 1
  inserts before line start, so one tool covers replace, insert and delete (empty text). An edit
  answers with the changed region and two lines of context around it, numbered: the model sees
  the new numbering without another `view`.
- Arguments are checked per tool (`_args`): integers may come as JSON numbers or digit strings
  (small models write both); a bad one is answered with an error naming the argument, never
  fatal.
- `view` and `edit` read and write through the sandbox's download/upload, not the shell: no
  quoting, no heredocs, the same on every backend.
- `task["declare_tools"] = False` (the rows of `tasks_compact`) sends no tool schemas, as the tool
  agent does: the tools are learned from the SFT transcripts, and prompts are shorter.
- `search` lists its hits sorted by path, then line (grep -r walks directories in no fixed
  order): the oracle's transcripts (`scripted.search_lines`) are what the harness answers.
- A reply whose tool call does not parse is the model's mistake, not a failure: the tool agent
  answers it (`PARSE_ERROR`), the episode goes on, and `parse_errors` (in the result, so the
  verifier reads it as `metadata["agent"]["parse_errors"]`) counts them: the verifier's `format`
  component.
- The result: `metrics` (turns, tool_calls, tool_errors, parse_errors, tool_s, chat_s, tokens,
  edits),
  `stop` (submitted, no_tool_call or the limit), `patch` (a unified diff of the repository's
  files against the task's, SWE-bench's model patch; only where a tool call made the sandbox),
  `status: "truncated"` on a limit. No reward: the verifier scores the sandbox.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import shlex
from typing import Any

from miles.envs.tool_agent import (DEFAULT_LIMITS, MAX_TOOL_OUTPUT_CHARS, PARSE_ERROR, TOOLS as BASE_TOOLS,
                                   ToolRunner, _cap, react)

DEFAULT_TURN_TOKENS = 256
CONTEXT_LINES = 2
VIEW_MAX_LINES = 100


def _spec(name: str, description: str, params: dict[str, str], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": t} for p, t in params.items()},
                       "required": required}}}


TOOLS: dict[str, dict[str, Any]] = {
    "bash": BASE_TOOLS["bash"],
    "view": _spec("view", "Show lines start..end of a file, numbered.",
                  {"path": "string", "start": "integer", "end": "integer"}, ["path"]),
    "edit": _spec("edit", "Replace lines start..end of a file with text (end = start - 1: insert).",
                  {"path": "string", "start": "integer", "end": "integer", "text": "string"},
                  ["path", "start", "end", "text"]),
    "search": _spec("search", "grep -rnE a pattern in the repository.",
                    {"pattern": "string", "path": "string"}, ["pattern"]),
    "submit": _spec("submit", "Submit your changes and stop.", {}, []),
}


def tool_specs() -> list[dict[str, Any]]:
    return list(TOOLS.values())


class ToolArgumentError(ValueError):
    pass


def _args(name: str, raw: Any) -> dict[str, Any]:
    """The call's arguments checked against the tool's schema; integers from numbers or digits."""
    try:
        args = json.loads(raw) if isinstance(raw, str) else (raw if raw is not None else {})
    except json.JSONDecodeError as e:
        raise ToolArgumentError(f"the arguments of {name} are not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ToolArgumentError(f"the arguments of {name} must be an object, got {json.dumps(args)[:100]}")
    params = TOOLS[name]["function"]["parameters"]
    out = {}
    for key in params["required"]:
        if key not in args:
            raise ToolArgumentError(f"{name} needs {key!r} (arguments: {sorted(params['properties'])})")
    for key, value in args.items():
        kind = params["properties"].get(key, {}).get("type")
        if kind is None:
            raise ToolArgumentError(f"{name} has no argument {key!r} (arguments: {sorted(params['properties'])})")
        if kind == "integer":
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ToolArgumentError(f"{name}: {key} must be an integer, got {json.dumps(value)[:50]}")
        elif not isinstance(value, str):
            raise ToolArgumentError(f"{name}: {key} must be a string, got {json.dumps(value)[:50]}")
        out[key] = value
    return out


def numbered(lines: list[str], first: int) -> str:
    return "".join(f"{first + i:>4}| {line if line.endswith(chr(10)) else line + chr(10)}"
                   for i, line in enumerate(lines))


def view_lines(lines: list[str], path: str, start: int = 1, end: int | None = None) -> str:
    """What `view` answers: lines start..end (at most VIEW_MAX_LINES when end is not given)."""
    if not 1 <= start <= max(len(lines), 1):
        raise ToolArgumentError(f"view: start = {start}, but {path} has {len(lines)} lines")
    end = min(len(lines), start + VIEW_MAX_LINES - 1 if end is None else end)
    if end < start:
        raise ToolArgumentError(f"view: end = {end} is before start = {start}")
    return numbered(lines[start - 1:end], start) or f"({path} is empty)"


def edit_lines(lines: list[str], path: str, start: int, end: int, text: str) -> tuple[list[str], str]:
    """`edit` on a file's lines: (the new lines, what the tool answers)."""
    if not 1 <= start <= len(lines) + 1:
        raise ToolArgumentError(f"edit: start = {start}, but {path} has {len(lines)} lines (1..{len(lines) + 1})")
    if not start - 1 <= end <= len(lines):
        raise ToolArgumentError(f"edit: end = {end}: expected {start - 1} (insert) .. {len(lines)}")
    new = text.splitlines(keepends=True)
    if new and not new[-1].endswith("\n"):
        new[-1] += "\n"
    lines = lines[:start - 1] + new + lines[end:]
    a, b = max(1, start - CONTEXT_LINES), min(len(lines), start + len(new) - 1 + CONTEXT_LINES)
    return lines, f"edited {path}: lines {start}..{end} replaced by {len(new)} line(s)\n" + numbered(lines[a - 1:b], a)


class SWERunner:
    """Runs one tool call of the SWE harness on the episode's sandbox -> (text, is_error)."""

    def __init__(self, sandbox: Any, timeout_s: float, max_chars: int = MAX_TOOL_OUTPUT_CHARS):
        self.sandbox, self.timeout_s, self.max_chars = sandbox, timeout_s, max_chars
        self.shell = ToolRunner(sandbox, {"bash"}, timeout_s, max_chars)
        self.submitted = False
        self.edits = 0

    async def run(self, name: str, raw_args: Any) -> tuple[str, bool]:
        if name == "bash":
            return await self.shell.run(name, raw_args)
        if name not in TOOLS:
            return f"error: unknown tool {name!r}; the tools are {', '.join(TOOLS)}", True
        try:
            args = _args(name, raw_args)
        except ToolArgumentError as e:
            return f"error: {e}", True
        if self.sandbox is None:
            return f"error: {name}: this episode has no sandbox", True
        try:
            text = await asyncio.wait_for(getattr(self, "_" + name)(**args), self.timeout_s + 5.0)
            return _cap(text, self.max_chars), False
        except asyncio.TimeoutError:
            return f"error: {name} did not finish within {self.timeout_s} s", True
        except FileNotFoundError:
            return f"error: no such file: {args.get('path')}", True
        except ToolArgumentError as e:
            return f"error: {e}", True
        except Exception as e:  # a sandbox failure is the model's observation, not the run's end
            return f"error: {name}: {type(e).__name__}: {e}", True

    async def _lines(self, path: str) -> list[str]:
        return (await self.sandbox.download(path)).decode("utf-8", errors="replace").splitlines(keepends=True)

    async def _view(self, path: str, start: int = 1, end: int | None = None) -> str:
        return view_lines(await self._lines(path), path, start, end)

    async def _edit(self, path: str, start: int, end: int, text: str) -> str:
        lines, message = edit_lines(await self._lines(path), path, start, end, text)
        await self.sandbox.upload(path, "".join(lines).encode())
        self.edits += 1
        return message

    async def _search(self, pattern: str, path: str = ".") -> str:
        r = await self.sandbox.exec(f"grep -rnE --exclude-dir=.verifier -e {shlex.quote(pattern)} -- "
                                    f"{shlex.quote(path)}", timeout_s=self.timeout_s)
        if r.exit_code == 1 and not r.stderr:
            return "no matches"
        if not r.ok:
            raise ToolArgumentError(f"search: grep exited {r.exit_code}: {r.stderr.strip()[:200]}")
        # by path, then line: grep -r walks directories in no fixed order, and a transcript
        # (scripted.search_lines) must be what the harness answers
        hits = [line.split(":", 2) for line in r.stdout.splitlines()]
        keyed = sorted((h[0], int(h[1]) if len(h) == 3 and h[1].isdigit() else 0, ":".join(h)) for h in hits)
        return "".join(line + "\n" for _, _, line in keyed)

    async def _submit(self) -> str:
        self.submitted = True
        return "submitted"


async def repo_patch(sandbox: Any, files: dict[str, str]) -> str:
    """A unified diff of the task's files as the sandbox has them now (deleted files as empty)."""
    out = []
    for path, before in sorted(files.items()):
        try:
            after = (await sandbox.download(path)).decode("utf-8", errors="replace")
        except FileNotFoundError:
            after = ""
        out += difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                    f"a/{path}", f"b/{path}")
    return "".join(out)


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """One episode (the `rollout.agent` contract): talk to the session, work in the repository."""
    limits = {**DEFAULT_LIMITS, **(task.get("limits") or {})}
    runner = SWERunner(task.get("sandbox"), float(limits["tool_timeout_s"]),
                       int(task.get("max_tool_output_chars", MAX_TOOL_OUTPUT_CHARS)))
    out = await react(base_url, {**task, "keep_transcript": True}, runner, tool_specs(),
                      declare=bool(task.get("declare_tools", True)), finished=lambda: runner.submitted,
                      turn_tokens=DEFAULT_TURN_TOKENS)
    messages = out.pop("messages")
    if task.get("keep_transcript"):
        out["messages"] = messages
    # the tool agent answers a reply whose <tool_call> did not parse with PARSE_ERROR as a user turn
    out["parse_errors"] = sum(m.get("role") == "user" and m.get("content") == PARSE_ERROR for m in messages)
    out["metrics"]["parse_errors"] = float(out["parse_errors"])
    out["metrics"]["edits"] = float(runner.edits)
    sandbox = task.get("sandbox")
    if sandbox is not None and getattr(sandbox, "created", True) and task.get("files"):
        out["patch"] = await repo_patch(sandbox, dict(task["files"]))
    return out
