"""HUD environments as a `rollout.agent`: each episode is one HUD rollout (`Task.run`) of an env
template on a `LocalRuntime`, driven by Miles' own agent (or HUD's, on request) against the
episode's TITO session; the reward is HUD's grade (the template's second `yield`).

    [data]
    task = "miles.envs.hud_env:example_tasks"   # or rows naming metadata.hud
    [rollout]
    agent = "miles.envs.hud_env:agent"

Bring your own: a HUD environment source file (or directory) with `@env.template` tasks, and data
rows whose `metadata.hud` names it:

    {"env": "envs/my_env.py",        # what LocalRuntime loads (relative to the repo, or absolute)
     "template": "fix_bug",          # the @env.template id
     "args": {"difficulty": 3},      # the template's arguments: this row's Task
     "system": "You are ...",        # optional system prompt for the agent
     "agent": "miles"}               # optional: "miles" (the default) or "hud"

Design decisions:
- In-process: HUD runs on Python 3.11 and installs into Miles' venv (`hud` 0.6.18 there: later
  0.6.x releases need google-genai versions that cap tenacity < 9.2). The template's environment
  is served by `LocalRuntime(path)`, which loads the source afresh for each episode, so episodes
  run concurrently (a live `Environment` object would serialize them) and none shares state.
- The agent is Miles' by default (`MilesAgent`, a HUD `Agent`): the ReAct loop every Miles harness
  shares (`tool_agent.react`, aiohttp to `<session>/v1/chat/completions`), with the tools the env
  publishes as MCP capabilities (`Capability.mcp`, opened through the run's client, listed and
  offered in OpenAI form, called with `call_tool`). HUD starts the task, hands the agent its
  prompt, and grades the answer the agent leaves in `run.trace.content`; the agent records its
  turns and tool calls on the trace as HUD's own agents do. Limits and sampling are the recipe's
  (`[agent]`, `task["sampling"]`), as for every other Miles agent.
- `agent = "hud"` runs HUD's `OpenAIChatAgent` instead, with `OpenAIChatConfig(model_client=
  AsyncOpenAI(base_url=<session>/v1))`, `max_steps = agent.max_turns`, the episode's sampling as
  `completion_kwargs`: for comparing against HUD's harness. Its OpenAI clients share one httpx
  client per event loop (one each costs an SSL context, 0.2 s an episode).
- Every model call goes through the session server either way, so the samples are token-exact;
  the conversation comes back in `metadata["agent"]["messages"]`.
- No network: before HUD is imported, and again on its settings object, telemetry, CLI analytics
  and file tracking are switched off and the API key is cleared, so the job/trace reports and the
  span exporter (all gated on telemetry and a key) never run; HUD's local span files go to a
  temporary directory removed at exit (`MILES_HUD_SPAN_DIR` keeps them).
- A rollout HUD marks as errored (the template raised, the agent's model call failed, grading
  failed, the rollout timed out) raises here with HUD's error steps: the agent layer marks the
  samples `failed` with it in `metadata["agent_error"]`, keeps their tokens, and the run goes on.
  A failing tool call is the model's observation (an error tool result), not the episode's end.
- An episode cut by a limit (HUD's `stop_reason` "max_steps", "length" or "timeout") is
  `truncated`; HUD's grade is still its reward.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_ENV = ROOT / "tests" / "envs" / "hud_envs" / "miles_digits_hud" / "env.py"
SPEC_KEYS = {"env", "template", "args", "system", "agent"}
AGENTS = ("miles", "hud")
TRUNCATED = ("max_steps", "length", "timeout")
# tool_agent.react's stop -> HUD's StopReason
STOPS = {"no_tool_call": "done", "max_turns": "max_steps", "turn_max_tokens": "length",
         "max_episode_tokens": "length", "context_length": "length", "episode_timeout_s": "timeout",
         "turn_timeout_s": "timeout"}
_QUIET = {"HUD_TELEMETRY_ENABLED": "false", "HUD_CLI_ANALYTICS_ENABLED": "false",
          "HUD_FILE_TRACKING_ENABLED": "false"}
_ENVS: dict[str, Any] = {}   # source path -> the environment as first loaded (its name, templates)
_HTTP: dict[int, tuple[Any, Any]] = {}   # id(event loop) -> (loop, the httpx client its episodes share)


class HudError(RuntimeError):
    """A HUD rollout ended without a valid grade: HUD's errors, in order."""


def quiet_hud():
    """Import HUD with everything that could reach HUD's platform switched off; its settings."""
    for key, value in _QUIET.items():
        os.environ[key] = value
    from hud.settings import settings
    settings.telemetry_enabled = False
    settings.cli_analytics_enabled = False
    settings.file_tracking_enabled = False
    settings.api_key = None        # reports, the gateway and the span uploads all need a key
    if not settings.telemetry_local_dir:
        span_dir = os.environ.get("MILES_HUD_SPAN_DIR")
        if not span_dir:
            span_dir = tempfile.mkdtemp(prefix="miles-hud-spans-")
            atexit.register(shutil.rmtree, span_dir, True)
        settings.telemetry_local_dir = span_dir
    return settings


def check_spec(spec: Any) -> dict[str, Any]:
    """`metadata.hud`, checked: errors name the key and the value."""
    if not isinstance(spec, dict):
        raise HudError(f"metadata.hud: expected a table (env, template, args), got {spec!r:.200}")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise HudError(f"metadata.hud: unknown keys {sorted(unknown)}; expected some of {sorted(SPEC_KEYS)}")
    for key in ("env", "template"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise HudError(f"metadata.hud.{key}: expected a non-empty string, got {spec.get(key)!r:.200}")
    if not isinstance(spec.get("args", {}), dict):
        raise HudError(f"metadata.hud.args: expected a table of template arguments, got {spec['args']!r:.200}")
    if "system" in spec and not isinstance(spec["system"], str):
        raise HudError(f"metadata.hud.system: expected a string, got {spec['system']!r:.200}")
    if spec.get("agent", "miles") not in AGENTS:
        raise HudError(f"metadata.hud.agent: expected one of {list(AGENTS)}, got {spec['agent']!r:.200}")
    return spec


def load_task(spec: dict[str, Any]):
    """The HUD `Task` row and the `LocalRuntime` for `metadata.hud`."""
    quiet_hud()
    from hud import LocalRuntime, Task
    from hud.environment import load_environment
    path = Path(spec["env"]) if os.path.isabs(spec["env"]) else ROOT / spec["env"]
    if not path.exists():
        raise HudError(f"metadata.hud.env: {spec['env']!r}: no such file or directory")
    key = str(path.resolve())
    if key not in _ENVS:
        _ENVS[key] = load_environment(path)
    env = _ENVS[key]
    if spec["template"] not in env.tasks:
        raise HudError(f"metadata.hud.template: {spec['template']!r} is not a template of HUD env "
                       f"{env.name!r} ({spec['env']}); it has {sorted(env.tasks)}")
    task = Task(env=env.name, id=spec["template"], args=dict(spec.get("args") or {}))
    return task, LocalRuntime(path, env=env.name)


class McpTools:
    """The env's MCP tools for `tool_agent.react`: `run(name, arguments)` -> (text, is_error), each
    call kept in order (`calls`: name, arguments, text, is_error) for the HUD trace."""

    def __init__(self, clients: dict[str, Any], timeout_s: float, max_chars: int):
        self.clients, self.timeout_s, self.max_chars = clients, timeout_s, max_chars
        self.calls: list[tuple[str, Any, str, bool]] = []

    async def run(self, name: str, raw_args: Any) -> tuple[str, bool]:
        text, is_error = await self._run(name, raw_args)
        self.calls.append((name, raw_args, text, is_error))
        return text, is_error

    async def _run(self, name: str, raw_args: Any) -> tuple[str, bool]:
        from miles.envs.tool_agent import _cap
        if name not in self.clients:
            return f"error: unknown tool {name!r}; the tools are {', '.join(sorted(self.clients)) or 'none'}", True
        try:
            args = json.loads(raw_args or "{}") if isinstance(raw_args, str) else raw_args
        except json.JSONDecodeError as e:
            return f"error: the arguments of {name} are not JSON ({e.msg})", True
        if not isinstance(args, dict):
            return f"error: {name} takes an object of arguments, got {json.dumps(args)[:200]}", True
        try:
            result = await asyncio.wait_for(self.clients[name].call_tool(name, args), self.timeout_s)
        except asyncio.TimeoutError:
            return f"error: {name} did not finish within {self.timeout_s} s", True
        except Exception as e:  # a failing tool is the model's observation, not the episode's end
            return f"error: {name}: {type(e).__name__}: {e}", True
        text = "\n".join(c.text for c in result.content if getattr(c, "text", None) is not None)
        return _cap(text, self.max_chars), bool(result.isError)


@functools.cache
def _miles_agent_class() -> type:
    """`MilesAgent`, made once HUD is imported quietly (its base class is HUD's `Agent`)."""
    quiet_hud()
    from hud.agents.base import Agent

    class MilesAgent(Agent):
        """Miles' ReAct loop (`tool_agent.react`) driving a HUD run: the run's prompt, the env's
        MCP tools, every model call to the episode's session; the answer and the steps go on
        `run.trace` for HUD to grade. One per episode (`result` keeps the loop's metrics)."""

        def __init__(self, base_url: str, task: dict[str, Any], system: str | None):
            self.base_url, self.task, self.system = base_url, task, system
            self.result: dict[str, Any] = {}

        async def __call__(self, run: Any) -> None:
            from hud.capabilities import MCPClient
            from hud.types import Step

            from miles.envs.tool_agent import DEFAULT_LIMITS, MAX_TOOL_OUTPUT_CHARS, react
            limits = {**DEFAULT_LIMITS, **(self.task.get("limits") or {})}
            manifest = run.client.manifest
            opened = []
            try:
                clients, specs = {}, []
                for cap in (manifest.bindings if manifest is not None else []):
                    if cap.protocol != MCPClient.protocol:
                        continue
                    client, listed = await _open_tools(run, cap, float(limits["tool_timeout_s"]))
                    opened.append(client)
                    for tool in listed:
                        if tool.name in clients:
                            raise HudError(f"HUD env tool {tool.name!r} is published by two MCP capabilities")
                        clients[tool.name] = client
                        specs.append({"type": "function", "function": {
                            "name": tool.name, "description": tool.description or "",
                            "parameters": tool.inputSchema or {"type": "object", "properties": {}}}})
                tools = McpTools(clients, float(limits["tool_timeout_s"]),
                                 int(self.task.get("max_tool_output_chars", MAX_TOOL_OUTPUT_CHARS)))
                episode = {**self.task, "prompt": run.prompt_text, "system": self.system, "keep_transcript": True}
                self.result = await react(self.base_url, episode, tools, specs, declare=bool(specs),
                                          finished=lambda: False)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:   # HUD's own agents end the trace this way: HUD reports it
                run.trace.status = "error"
                run.record(Step(source="system", error=f"{type(e).__name__}: {e}"))
                return
            finally:
                for client in opened:
                    await client.close()
            _record(run, self.result["messages"], tools.calls)
            run.trace.stop_reason = STOPS.get(self.result["stop"], "done")
            run.trace.status = "completed"

    return MilesAgent


async def _open_tools(run: Any, cap: Any, timeout_s: float) -> tuple[Any, list[Any]]:
    """The MCP capability opened through the run's client and its tools listed, within
    `timeout_s` (the recipe's agent.tool_timeout_s), or a HudError naming the capability."""
    async def open_and_list():
        client = await run.client.open(cap.name)
        try:
            return client, await client.list_tools()
        except BaseException:
            await client.close()
            raise
    try:
        return await asyncio.wait_for(open_and_list(), timeout_s)
    except asyncio.TimeoutError:
        raise HudError(f"HUD env capability {cap.name!r} ({cap.url}) did not open and list its "
                       f"tools within {timeout_s} s (agent.tool_timeout_s)") from None


def _record(run: Any, messages: list[dict[str, Any]], calls: list[tuple[str, Any, str, bool]]) -> None:
    """The loop's turns on HUD's trace: an AgentStep per reply, a ToolStep per tool result; the last
    reply's text is the answer HUD grades."""
    import mcp.types as mcp_types
    from hud.agents.types import AgentStep, ToolStep
    from hud.types import MCPToolCall, MCPToolResult
    pending = iter(calls)
    by_id: dict[str, MCPToolCall] = {}
    for message in messages:
        if message.get("role") == "assistant":
            tool_calls = []
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                try:
                    arguments = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    arguments = fn.get("arguments")
                tool_calls.append(MCPToolCall(id=call.get("id") or "", name=str(fn.get("name")),
                                              arguments=arguments if isinstance(arguments, (dict, str)) else None))
                by_id[tool_calls[-1].id] = tool_calls[-1]
            run.record(AgentStep(content=message.get("content") or "", tool_calls=tool_calls, done=not tool_calls))
            run.trace.content = message.get("content") or ""
        elif message.get("role") == "tool":
            _, _, text, is_error = next(pending, ("", None, message.get("content", ""), False))
            run.record(ToolStep(call=by_id.get(message.get("tool_call_id", "")),
                                result=MCPToolResult(content=[mcp_types.TextContent(type="text", text=text)],
                                                     isError=is_error)))


def hud_agent(base_url: str, api_key: str, sampling: dict[str, Any], max_steps: int, system: str | None):
    """HUD's own OpenAI-compatible agent, every model call to the episode's session."""
    from hud.agents.openai_compatible import OpenAIChatAgent
    from hud.agents.types import OpenAIChatConfig
    from openai import AsyncOpenAI
    kwargs = dict(sampling)
    if "top_k" in kwargs:   # not an OpenAI field: SGLang-style servers read it from the body
        kwargs["extra_body"] = {"top_k": kwargs.pop("top_k")}
    client = AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                         http_client=_http_client())
    config = OpenAIChatConfig(model_client=client, model="policy", completion_kwargs=kwargs,
                              max_steps=max_steps, system_prompt=system)
    return OpenAIChatAgent(config), client


def _http_client() -> Any:
    """One httpx client per event loop for every episode's model calls: a client of its own per
    episode builds an SSL context, 0.2 s each (measured), most of an episode's overhead."""
    import asyncio

    import openai
    loop = asyncio.get_running_loop()
    entry = _HTTP.get(id(loop))
    if entry is None or entry[0] is not loop or entry[1].is_closed:
        for key in [k for k, (lp, _) in _HTTP.items() if lp.is_closed()]:
            del _HTTP[key]
        entry = _HTTP[id(loop)] = (loop, openai.DefaultAsyncHttpxClient())
    return entry[1]


def _conversation(run: Any, system: str | None) -> list[dict[str, str]]:
    """The messages the agent exchanged, from HUD's trace (user turns, the model's answers)."""
    from hud.agents.types import AgentStep
    messages = [{"role": "system", "content": system}] if system else []
    for step in run.trace.steps:
        if isinstance(step, AgentStep):
            messages.append({"role": "assistant", "content": step.content or ""})
        elif step.source == "user" and step.messages:
            text = "\n\n".join(getattr(m.content, "text", "") for m in step.messages)
            messages.append({"role": "user", "content": text})
    return messages


async def agent(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """`rollout.agent`: one HUD rollout of `task["hud"]`, graded by HUD."""
    spec = check_spec(task.get("hud"))
    hud_task, runtime = load_task(spec)
    limits = task.get("limits") or {}
    if spec.get("agent", "miles") == "miles":
        policy = _miles_agent_class()(base_url, task, spec.get("system"))
    else:
        policy, _ = hud_agent(base_url, task.get("api_key") or "none", dict(task.get("sampling") or {}),
                              int(limits.get("max_turns") or 4), spec.get("system"))
    t0 = time.monotonic()
    job = await hud_task.run(policy, runtime=runtime, rollout_timeout=float(limits.get("episode_timeout_s") or 600.0))
    wall = time.monotonic() - t0
    run = job.runs[0]
    errors = [s.error for s in run.trace.steps if getattr(s, "error", None)]
    if run.grade.is_error or run.trace.status == "error":
        raise HudError(f"HUD rollout of {spec['template']!r}: " + ("; ".join(errors) or
                       f"trace status {run.trace.status!r}, grade {run.grade.raw!r}"))
    from hud.agents.types import AgentStep
    turns = [s for s in run.trace.steps if isinstance(s, AgentStep)]
    loop = getattr(policy, "result", None)
    metrics = {"hud_rollout_s": wall, "hud_turns": float(len(turns)),
               "hud_llm_s": loop["metrics"]["chat_s"] if loop else sum(_span_s(s) for s in turns)}
    if loop:
        metrics.update({k: loop["metrics"][k] for k in ("tool_calls", "tool_errors", "tool_s")})
    messages = loop["messages"] if loop else _conversation(run, spec.get("system"))
    out: dict[str, Any] = {"reward": float(run.reward), "stop_reason": run.trace.stop_reason,
                           "answer": run.trace.content, "evaluation": run.evaluation,
                           "messages": messages, "metrics": metrics}
    if run.trace.stop_reason in TRUNCATED:
        out["status"] = "truncated"
    return out


def _span_s(step: Any) -> float:
    """A step's duration from HUD's timestamps (ISO strings), 0 when it has none."""
    from datetime import datetime
    try:
        return max((datetime.fromisoformat(step.ended_at) - datetime.fromisoformat(step.started_at)).total_seconds(), 0.0)
    except (TypeError, ValueError, AttributeError):
        return 0.0


def example_rows(n: int, seed: int = 0, **spec: Any) -> list[dict[str, Any]]:
    """`n` rows of the test suite's HUD digits env (tests/envs/hud_envs); `spec` overrides keys."""
    import random
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = " ".join(str(rng.randrange(10)) for _ in range(3))
        meta = {"hud": {"env": str(EXAMPLE_ENV.relative_to(ROOT)), "template": "say_digits",
                        "args": {"digits": digits}, **spec}}
        rows.append({"prompt": f"Say the digits {digits}.", "label": digits, "metadata": meta})
    return rows


def example_tasks(seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict[str, Any]]]:
    """`data.task` task set: 64 digits rollouts, split train/test, and SFT rows from other seeds."""
    from miles.envs.openenv_env import sft_rows
    rows = example_rows(64, seed)
    n_test = max(1, int(len(rows) * test_frac))
    sft = [(r["prompt"], r["label"]) for r in example_rows(2000, seed + 1)]
    return {"test": rows[:n_test], "train": rows[n_test:], "sft": sft_rows(sft)}
