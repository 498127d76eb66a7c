"""The built-in tool agent: a small ReAct loop over the session's OpenAI endpoint, tools in the sandbox.

    [rollout]
    agent = "miles.envs.tool_agent:agent"
    reward = "miles.envs.tool_agent:verify_submission"

Each turn posts the whole history to `{base_url}/v1/chat/completions` with the tools in OpenAI
format; the session server renders them through the model family's template and parses the reply's
`<tool_call>` blocks into `tool_calls`. The agent runs each call on `task["sandbox"]`, answers it
with a `role: "tool"` message, and goes on until `submit`, a reply without a tool call, or a limit.

Design decisions:
- Four tools, compact schemas (`TOOLS`): every token of the rendered system prompt is prefilled at
  every turn and trained on at every step, which is what a CPU run pays for. `task["tools"]` picks
  a subset by name, `task["system"]` adds a system message. `task["declare_tools"] = False` sends
  no `tools` field at all (no tool system prompt; the family's parser still turns `<tool_call>`
  blocks into tool calls): for a model that learned its tools in training, the prompt shrinks from
  ~500 to ~25 tokens with the tiny tokenizer.
- `task["keep_transcript"]` returns the messages of the episode (tests and debugging).
- `task["sandbox_user"]` runs the `bash` tool's commands as that user of the sandbox (a Harbor
  task's `[agent] user`; `Sandbox.exec(user=)`: a backend that cannot switch users answers the
  call with its error). `read_file` and `write_file` then run as that user too (`cat` and a
  base64 pipe through the same `exec`), so the user's file permissions hold for every tool; without
  a user they are the sandbox's own download / upload.
- The assistant message goes back exactly as the server returned it (content, tool calls and their
  ids), so the server finds the history it recorded and appends only the new tool results.
- `submit(answer)` writes the answer to `ANSWER_PATH` in the sandbox (relative to its workdir:
  `/workspace/.answer` by default) and ends the episode; `verify_submission` reads it from there.
  The verifier trusts the sandbox's state, not what the agent says it did. Its reward is a dict:
  `reward` (trained on: `train.reward_key = "reward"`) and `format` (1 when the episode submitted),
  so an episode that ended without a submission is a reward 0 that trains, never a failure.
- Malformed calls are answered, not fatal: an unknown tool or bad arguments get an error tool
  result; a reply whose `<tool_call>` did not parse (the qwen3 parser then returns it as plain
  content, so there is no call id to answer) gets `PARSE_ERROR` as a user message and the episode
  goes on (within `max_turns`): it is the model's mistake, not a failure. The SFT transcripts show
  that reply and a recovery from it (`miles.rl.tasks.sft_rows`), so the model has seen it. Both
  count as `tool_errors`, the unparsed ones also as `parse_errors`. A failing tool (a missing file, a sandbox error, a command past `tool_timeout_s`)
  is answered with the error and counted too; a command that exits non-zero is a normal result
  (its exit code is shown). A tool timeout does not end the episode: the model may try again.
- Limits come from `task["limits"]` (the recipe's `[agent]`): `max_turns` model calls,
  `max_episode_tokens` generated tokens (from the replies' `usage`; each turn's `max_tokens` is
  clipped to what is left), `turn_timeout_s` per model call, `episode_timeout_s` for the whole run,
  `tool_timeout_s` per tool call. Hitting one ends the episode with `status: "truncated"`; so does a
  turn cut by its token limit (its tool call cannot be complete) or a context-length refusal.
- Tool output is capped at `MAX_TOOL_OUTPUT_CHARS` (`task["max_tool_output_chars"]`), the tail
  replaced by a marker: a runaway `cat` must not fill the context.
- Sampling: `task["sampling"]` holds OpenAI request fields (temperature, top_p, top_k, seed,
  max_tokens per turn); the framework sets it (greedy for evaluation). `seed` is the episode's:
  turn k sends `miles.seeds.turn_seed(seed, k)`, so the turns do not repeat each other's draws.
  Defaults: temperature 1, `DEFAULT_TURN_TOKENS` per turn.
- The result: `metrics` (turns, tool_calls, tool_errors, tool_s, chat_s = time in model calls as
  the agent saw them, tokens = generated), `stop` (submitted, no_tool_call, or the limit that ended
  it), `answer` (the submission or None), `status: "truncated"` when a limit ended it. No `reward`:
  the verifier scores the sandbox.
- aiohttp, not the openai SDK (a test dependency only). `task["api_key"]` goes out as
  `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from miles.seeds import turn_seed

ANSWER_PATH = ".answer"
PARSE_ERROR = ('error: the tool call did not parse; write <tool_call>{"name": ..., "arguments": {...}}'
               '</tool_call>')
REWARD_KEY = "reward"   # the verifiers' trained entry (`train.reward_key`); "format" is the other
MAX_TOOL_OUTPUT_CHARS = 2048
DEFAULT_TURN_TOKENS = 64
DEFAULT_LIMITS = {"max_turns": 8, "max_episode_tokens": 1024, "turn_timeout_s": 120.0,
                  "episode_timeout_s": 600.0, "tool_timeout_s": 30.0}


def _tool(name: str, description: str, *params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in params},
                       "required": list(params)}}}


TOOLS: dict[str, dict[str, Any]] = {
    "bash": _tool("bash", "Run a shell command.", "command"),
    "read_file": _tool("read_file", "Read a file.", "path"),
    "write_file": _tool("write_file", "Write a file.", "path", "content"),
    "submit": _tool("submit", "Submit the final answer.", "answer"),
}


def tool_specs(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The tools an episode offers, in `TOOLS` order or the order given (the rendered prompt
    depends on it, so SFT transcripts must use the same call)."""
    if names is None:
        return list(TOOLS.values())
    unknown = [n for n in names if n not in TOOLS]
    if unknown or not names:
        raise ValueError(f"task['tools'] = {names!r}: expected a non-empty list of {sorted(TOOLS)}")
    return [TOOLS[n] for n in names]


class _Truncated(Exception):
    """A limit ended the episode; the message says which."""


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def _first_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = task.get("prompt")
    if isinstance(prompt, list):  # already chat messages
        messages = [dict(m) for m in prompt]
    elif isinstance(prompt, str) and prompt:
        messages = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"task['prompt']: expected a string or a list of messages, got {prompt!r:.80}")
    if task.get("system"):
        messages.insert(0, {"role": "system", "content": str(task["system"])})
    return messages


class ToolRunner:
    """Runs one tool call on the episode's sandbox; returns (text for the model, is_error)."""

    def __init__(self, sandbox: Any, offered: set[str], timeout_s: float, max_chars: int,
                 user: str | None = None):
        self.sandbox, self.offered, self.user = sandbox, offered, user
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.answer: str | None = None

    async def run(self, name: str, raw_args: Any) -> tuple[str, bool]:
        if name not in self.offered:
            return f"error: unknown tool {name!r}; the tools are {', '.join(sorted(self.offered))}", True
        try:
            args = json.loads(raw_args) if isinstance(raw_args, str) else raw_args
        except json.JSONDecodeError as e:
            return f"error: the arguments of {name} are not JSON ({e.msg})", True
        params = TOOLS[name]["function"]["parameters"]["required"]
        if not isinstance(args, dict) or any(not isinstance(args.get(p), str) for p in params):
            return f"error: {name} takes string arguments {params}, got {json.dumps(args)[:200]}", True
        if self.sandbox is None:
            return f"error: {name}: this episode has no sandbox", True
        try:
            return await asyncio.wait_for(getattr(self, "_" + name)(**{p: args[p] for p in params}),
                                          self.timeout_s + 5.0)
        except asyncio.TimeoutError:
            return f"error: {name} did not finish within {self.timeout_s} s", True
        except FileNotFoundError:
            return f"error: no such file: {args.get('path')}", True
        except Exception as e:  # a sandbox failure is the model's observation, not the run's end
            return f"error: {name}: {type(e).__name__}: {e}", True

    async def _bash(self, command: str) -> tuple[str, bool]:
        r = await self.sandbox.exec(command, timeout_s=self.timeout_s, user=self.user)
        out = r.stdout + (("\n" if r.stdout and r.stderr else "") + r.stderr if r.stderr else "")
        if r.timed_out:
            return _cap(out + f"\n[error: timed out after {self.timeout_s} s]", self.max_chars), True
        if r.exit_code != 0:
            out += f"\n[exit code {r.exit_code}]"
        return _cap(out, self.max_chars), False

    async def _read_file(self, path: str) -> tuple[str, bool]:
        if self.user is None:
            data = await self.sandbox.download(path)
            return _cap(data.decode("utf-8", errors="replace"), self.max_chars), False
        r = await self.sandbox.exec(["cat", "--", path], timeout_s=self.timeout_s, user=self.user)
        if r.exit_code != 0 or r.timed_out:
            return f"error: read_file {path} as {self.user}: {r.stderr.strip() or 'timed out'}", True
        return _cap(r.stdout, self.max_chars), False

    async def _write_file(self, path: str, content: str) -> tuple[str, bool]:
        data = content.encode()
        if self.user is None:
            await self.sandbox.upload(path, data)
        else:  # the content travels base64 in argv, so no byte of it is read as shell
            script = 'mkdir -p -- "$(dirname -- "$1")" && printf %s "$2" | base64 -d > "$1"'
            r = await self.sandbox.exec(["sh", "-c", script, "sh", path, base64.b64encode(data).decode()],
                                        timeout_s=self.timeout_s, user=self.user)
            if r.exit_code != 0 or r.timed_out:
                return f"error: write_file {path} as {self.user}: {r.stderr.strip() or 'timed out'}", True
        return f"wrote {len(data)} bytes to {path}", False

    async def _submit(self, answer: str) -> tuple[str, bool]:
        await self.sandbox.upload(ANSWER_PATH, answer.encode())
        self.answer = answer
        return "submitted", False


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """One episode (the `rollout.agent` contract): talk to the session, act in the sandbox."""
    limits = {**DEFAULT_LIMITS, **(task.get("limits") or {})}
    tools = tool_specs(task.get("tools"))
    runner = ToolRunner(task.get("sandbox"), {t["function"]["name"] for t in tools},
                        float(limits["tool_timeout_s"]),
                        int(task.get("max_tool_output_chars", MAX_TOOL_OUTPUT_CHARS)),
                        task.get("sandbox_user"))
    out = await react(base_url, task, runner, tools, declare=bool(task.get("declare_tools", True)),
                      finished=lambda: runner.answer is not None)
    out["answer"] = runner.answer
    return out


async def react(base_url: str, task: dict[str, Any], runner: Any, tools: list[dict[str, Any]], *,
                declare: bool = True, finished: Callable[[], bool],
                turn_tokens: int = DEFAULT_TURN_TOKENS) -> dict[str, Any]:
    """The ReAct loop every harness here shares: ask the session, run each tool call with
    `runner.run(name, arguments)`, feed the results back, until `finished()`, a prose answer, or a
    limit (`task["limits"]`: a limit is `status = "truncated"`, with the reason in `stop`)."""
    limits = {**DEFAULT_LIMITS, **(task.get("limits") or {})}
    sampling = dict(task.get("sampling") or {})
    turn_cap = int(sampling.pop("max_tokens", turn_tokens))
    sampling.setdefault("temperature", 1.0)
    messages = _first_messages(task)
    headers = {"Authorization": f"Bearer {task['api_key']}"} if task.get("api_key") else {}
    m = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "parse_errors": 0, "tool_s": 0.0,
         "chat_s": 0.0, "tokens": 0}
    t0 = time.monotonic()
    deadline = t0 + float(limits["episode_timeout_s"])
    stop, truncated = "no_tool_call", False
    url = base_url.rstrip("/") + "/v1/chat/completions"
    async with aiohttp.ClientSession(headers=headers) as http:
        try:
            while True:
                if m["turns"] >= limits["max_turns"]:
                    raise _Truncated("max_turns")
                budget = int(limits["max_episode_tokens"]) - m["tokens"]
                if budget <= 0:
                    raise _Truncated("max_episode_tokens")
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise _Truncated("episode_timeout_s")
                body = {"messages": messages, "max_tokens": min(turn_cap, budget), **sampling}
                if sampling.get("seed") is not None:   # each turn its own draws
                    body["seed"] = turn_seed(int(sampling["seed"]), m["turns"])
                if declare:
                    body["tools"] = tools
                t = time.monotonic()
                reply = await _chat(http, url, body, min(float(limits["turn_timeout_s"]), left_s))
                m["chat_s"] += time.monotonic() - t
                m["turns"] += 1
                m["tokens"] += int((reply.get("usage") or {}).get("completion_tokens", 0))
                choice = reply["choices"][0]
                message = choice["message"]
                messages.append(message)
                calls = message.get("tool_calls") or []
                if choice.get("finish_reason") == "length":
                    raise _Truncated("turn_max_tokens")
                if not calls:
                    if "<tool_call>" not in (message.get("content") or ""):
                        break  # the model answered in prose: the episode is over
                    m["tool_errors"] += 1
                    m["parse_errors"] += 1   # the model's mistake: answered, and the episode goes on
                    messages.append({"role": "user", "content": PARSE_ERROR})
                    continue
                for call in calls:
                    fn = call.get("function") or {}
                    if time.monotonic() > deadline:
                        raise _Truncated("episode_timeout_s")
                    t = time.monotonic()
                    text, is_error = await runner.run(str(fn.get("name")), fn.get("arguments", "{}"))
                    m["tool_s"] += time.monotonic() - t
                    m["tool_calls"] += 1
                    m["tool_errors"] += is_error
                    if finished():
                        break
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": text})
                if finished():
                    stop = "submitted"
                    break
        except _Truncated as e:
            stop, truncated = str(e), True
        except asyncio.TimeoutError:  # the model call's timeout: the turn's or what the episode had left
            stop = "episode_timeout_s" if time.monotonic() >= deadline else "turn_timeout_s"
            truncated = True
    out: dict[str, Any] = {"metrics": {k: float(v) for k, v in m.items()}, "stop": stop,
                           "episode_s": time.monotonic() - t0}
    if truncated:
        out["status"] = "truncated"
    if task.get("keep_transcript"):
        out["messages"] = messages
    return out


async def _chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                timeout_s: float) -> dict[str, Any]:
    async with http.post(url, json=body,
                         timeout=aiohttp.ClientTimeout(total=max(timeout_s, 0.001))) as r:
        reply = await r.json(content_type=None)
        error = (reply.get("error") or {}) if isinstance(reply, dict) else {}
        if r.status == 400 and "context_length_exceeded" in (error.get("type"), error.get("code")):
            raise _Truncated("context_length")
        if r.status != 200:
            raise RuntimeError(f"session server: HTTP {r.status} on chat/completions: "
                               f"{json.dumps(reply)[:300]}")
        return reply


async def submitted(sandbox: Any) -> str | None:
    """What the episode submitted into the sandbox (`ANSWER_PATH`), None when it never did."""
    try:
        return (await sandbox.download(ANSWER_PATH)).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


async def verify_submission(sample: Any, sandbox: Any = None) -> dict[str, float]:
    """The verifier: {"reward": 1.0 when the answer submitted into the sandbox equals the label,
    "format": 1.0 when the episode submitted at all}. An episode that never submitted (prose, calls
    that did not parse until `max_turns`) is the model's mistake: reward 0, format 0, trained on."""
    if sample.label is None:
        raise ValueError("verify_submission needs a label (the row's `label`)")
    if sandbox is None:
        raise ValueError("verify_submission reads the submitted answer from the episode's sandbox: "
                         "set [sandbox] backend (e.g. \"subprocess\")")
    got = await submitted(sandbox)
    return {REWARD_KEY: float(got is not None and got.strip() == str(sample.label).strip()),
            "format": float(got is not None)}
