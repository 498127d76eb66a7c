"""HUD environments as a `rollout.agent`: each episode is one HUD rollout (`Task.run`) of an env
template on a `LocalRuntime`, driven by HUD's own OpenAI-compatible agent pointed at the episode's
TITO session; the reward is HUD's grade (the template's second `yield`).

    [data]
    task = "miles.envs.hud_env:example_tasks"   # or rows naming metadata.hud
    [rollout]
    agent = "miles.envs.hud_env:agent"

Bring your own: a HUD environment source file (or directory) with `@env.template` tasks, and data
rows whose `metadata.hud` names it:

    {"env": "envs/my_env.py",        # what LocalRuntime loads (relative to the repo, or absolute)
     "template": "fix_bug",          # the @env.template id
     "args": {"difficulty": 3},      # the template's arguments: this row's Task
     "system": "You are ..."}        # optional system prompt for the agent

Design decisions:
- In-process: HUD runs on Python 3.11 and installs into Miles' venv (`hud` 0.6.18 there: later
  0.6.x releases need google-genai versions that cap tenacity < 9.2). The template's environment
  is served by `LocalRuntime(path)`, which loads the source afresh for each episode, so episodes
  run concurrently (a live `Environment` object would serialize them) and none shares state.
- The agent is HUD's: `OpenAIChatAgent` with `OpenAIChatConfig(model_client=AsyncOpenAI(base_url=
  <session>/v1))`, `max_steps = agent.max_turns`, the episode's sampling as `completion_kwargs`.
  The episodes' OpenAI clients share one httpx client (per event loop): one each costs an SSL
  context, 0.2 s an episode.
  Every model call goes through the session server, so the samples are token-exact; the
  conversation comes back in `metadata["agent"]["messages"]`.
- No network: before HUD is imported, and again on its settings object, telemetry, CLI analytics
  and file tracking are switched off and the API key is cleared, so the job/trace reports and the
  span exporter (all gated on telemetry and a key) never run; HUD's local span files go to a
  temporary directory removed at exit (`MILES_HUD_SPAN_DIR` keeps them).
- A rollout HUD marks as errored (the template raised, the agent's model call failed, grading
  failed, the rollout timed out) raises here with HUD's error steps: the agent layer marks the
  samples `failed` with it in `metadata["agent_error"]`, keeps their tokens, and the run goes on.
- An episode that used all of `agent.max_turns` (`stop_reason == "max_steps"`) or was cut by its
  token limit (`"length"`) is `truncated`; HUD's grade is still its reward.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_ENV = ROOT / "tests" / "envs" / "hud_envs" / "miles_digits_hud" / "env.py"
SPEC_KEYS = {"env", "template", "args", "system"}
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
    sampling = dict(task.get("sampling") or {})
    max_steps = int(limits.get("max_turns") or 4)
    policy, _ = hud_agent(base_url, task.get("api_key") or "none", sampling, max_steps, spec.get("system"))
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
    llm_s = sum(_span_s(s) for s in turns)
    out: dict[str, Any] = {"reward": float(run.reward), "stop_reason": run.trace.stop_reason,
                           "answer": run.trace.content, "evaluation": run.evaluation,
                           "messages": _conversation(run, spec.get("system")),
                           "metrics": {"hud_rollout_s": wall, "hud_turns": float(len(turns)), "hud_llm_s": llm_s}}
    if run.trace.stop_reason in ("max_steps", "length"):
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
