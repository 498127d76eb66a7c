"""Agent-function plug-in point (`rollout.agent`): any OpenAI/Anthropic-compatible agent, token-exact
samples out.

A user writes

    async def agent(base_url: str, task: dict) -> dict | None:
        # talk to f"{base_url}/v1/chat/completions" (or Anthropic's f"{base_url}/v1/messages")
        # with the full message history each turn, `task["api_key"]` as the API key; run tools
        # (in `task["sandbox"]`); return {"reward": ..., "status": ..., "metrics": {...}, ...}

and names it in the recipe as `"my_pkg.my_agent:agent"`. In the loop, `task` is the prompt row's
metadata plus `prompt`, `label`, `id`, `limits` (the `[agent]` table as a dict), `sandbox` (the
episode's lazy sandbox: `exec`, `upload`, `download`, `upload_dir`; created on first use) and
`api_key` (the session token) and `sampling` (this episode's sampling parameters in OpenAI names:
temperature, top_p, top_k, seed, max_tokens). `run_agent_group(agent_fn, task, n, session_server_url)` runs an
agent outside the loop (tests, benchmarks).

Design decisions:
- One run = one session = one trajectory tree = one rollout id. A run that forks, retries,
  spawns subagents or compacts its context yields several samples; they share the rollout id so
  the trainer can normalize per rollout. The session's metadata names the run, the worker
  incarnation and the group, so a restarted worker can find and delete its predecessor's sessions.
- The session is always collected and closed, even when the agent raises, times out or is
  cancelled: the collect runs in its own task (`context.run_to_end`), so a cancellation of the
  episode cannot cut it off, and the cancelled episode waits for it before it ends. Tokens that were generated are never lost:
  an agent that raised gives `failed` samples (error in `metadata["agent_error"]`), one that ran
  past `agent_timeout_s` gives `truncated` ones. A run that produced no turn gives one empty
  `aborted` sample; a collect that fails (a restarted session server answers 404) one empty
  `failed` sample naming why. The group keeps its size and the buffer's policy decides.
- The returned dict is the reward channel: `reward` (a float or a dict of floats) goes to
  `Sample.reward`, `status: "truncated"` marks the samples truncated, `metrics` (numbers) goes to
  the episode's metrics, every other key to `Sample.metadata["agent"]`.
- The agent gets the session base URL (`.../sessions/<id>`), never the engine's: every token it
  causes passes through the session server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np

from miles import plugins
from miles.envs.context import run_to_end
from miles.tito.client import SessionServerClient, SessionServerError
from miles.wire.messages import Sample

AgentFn = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]
_COLLECTS: set[asyncio.Task] = set()   # collects outliving a cancelled episode are kept referenced


class AgentRun(msgspec.Struct):
    samples: list[Sample]
    reward: Any = None
    status: str = ""                  # "truncated" when the agent said so or ran out of time
    error: str = ""
    metrics: dict[str, float] = {}
    elapsed_s: float = 0.0


def load_agent(path: str) -> AgentFn:
    """`module:function` -> the agent function, checked against the `rollout.agent` contract."""
    return plugins.load("rollout.agent", path)


def _empty(status: str, rollout_id: str, group_id: str, reason: str) -> Sample:
    return Sample(tokens=np.zeros(0, np.int32), loss_mask=np.zeros(0, np.uint8),
                  rollout_logprobs=np.zeros(0, np.float32), status=status, group_id=group_id,
                  rollout_id=rollout_id, metadata={"reason": reason})


async def run_agent(agent_fn: AgentFn, task: dict[str, Any], client: SessionServerClient, *,
                    group_id: str, rollout_id: str, metadata: dict[str, Any] | None = None,
                    keep: str = "drop_retries", return_routed_experts: bool = False,
                    agent_timeout_s: float | None = None) -> AgentRun:
    """One agent run in a fresh session; always collects and closes it."""
    create = asyncio.ensure_future(client.create_session(
        rollout_id=rollout_id, metadata={"group_id": group_id, **(metadata or {})},
        return_routed_experts=return_routed_experts))
    try:
        created = await asyncio.shield(create)
    except asyncio.CancelledError:  # the server may have made it already: nobody else knows its id
        _delete_when_created(client, create)
        raise
    sid = created["session_id"]
    result: Any = None
    error = status = ""
    t0 = time.monotonic()
    try:
        task = {**task, "api_key": client.token or "none"}
        result = await asyncio.wait_for(agent_fn(created["base_url"], task), agent_timeout_s)
        if result is not None and not isinstance(result, dict):
            error = f"agent returned {type(result).__name__}, expected a dict or None"
            result = None
    except asyncio.TimeoutError:
        status = "truncated"
        error = f"agent did not finish within {agent_timeout_s} s (agent.episode_timeout_s)"
    except Exception as e:   # the agent's bug or its environment's: record it, keep the tokens
        error = f"{type(e).__name__}: {e}"
    finally:
        collect = asyncio.get_running_loop().create_task(client.collect(
            sid, keep=keep, close=True, group_id=group_id, return_routed_experts=return_routed_experts))
        _COLLECTS.add(collect)
        collect.add_done_callback(_COLLECTS.discard)
        try:
            samples = await run_to_end(collect)
        except (SessionServerError, OSError, asyncio.TimeoutError) as e:
            gone = isinstance(e, SessionServerError) and e.status == 404
            reason = (f"session {sid} is gone from the session server (restarted?): its tokens are lost"
                      if gone else f"collecting session {sid} failed: {type(e).__name__}: {e}")
            samples = [_empty("failed", rollout_id, group_id, reason)]
            error = error or reason
    run = AgentRun(samples=samples, elapsed_s=time.monotonic() - t0, error=error, status=status)
    result = dict(result or {})
    run.reward = result.pop("reward", None)
    if result.pop("status", None) == "truncated":
        run.status = "truncated"
    metrics = result.pop("metrics", None) or {}
    run.metrics = {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    if not samples:
        samples.append(_empty("failed" if error else "aborted", rollout_id, group_id,
                              "the agent made no model call"))
    for sample in samples:
        sample.rollout_id = rollout_id
        sample.metadata.update({"agent": result, "agent_time_s": run.elapsed_s, "session_id": sid})
        if error:
            sample.metadata["agent_error"] = error
        if sample.status in ("failed", "aborted"):
            continue
        if run.status == "truncated":
            sample.status = "truncated"
        elif error:
            sample.status = "failed"
    return run


def _delete_when_created(client: SessionServerClient, create: asyncio.Future) -> None:
    async def delete() -> None:
        try:
            await client.delete((await create)["session_id"])
        except Exception:  # never created, or the server is gone: nothing is left open
            pass
    task = asyncio.get_running_loop().create_task(delete())
    _COLLECTS.add(task)
    task.add_done_callback(_COLLECTS.discard)


async def run_agent_group(agent_fn: AgentFn | str, task: dict[str, Any], n: int, session_server_url: str, *,
                          group_id: str | None = None, keep: str = "drop_retries",
                          return_routed_experts: bool = False,
                          agent_timeout_s: float | None = None) -> list[Sample]:
    """Run the agent `n` times on `task` concurrently, outside the loop; the samples of all runs,
    as one group, with the agent's reward."""
    if isinstance(agent_fn, str):
        agent_fn = load_agent(agent_fn)
    else:
        plugins.check_object("rollout.agent", agent_fn)
    if n < 1:
        raise ValueError(f"n: expected at least 1 agent run per group, got {n}")
    group_id = group_id or str(task.get("id") or uuid.uuid4().hex)
    async with SessionServerClient(session_server_url) as client:
        runs = await asyncio.gather(*(run_agent(
            agent_fn, task, client, group_id=group_id, rollout_id=f"{group_id}/{i}",
            metadata={"run_index": i}, keep=keep, return_routed_experts=return_routed_experts,
            agent_timeout_s=agent_timeout_s) for i in range(n)))
    samples = []
    for run in runs:
        for sample in run.samples:
            sample.reward = run.reward
            samples.append(sample)
    for i, sample in enumerate(samples):
        sample.index = i
    return samples
