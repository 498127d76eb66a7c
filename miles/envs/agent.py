"""Agent-function plug-in point: any OpenAI/Anthropic-compatible agent, token-exact samples out.

A user writes

    async def agent(base_url: str, task: dict) -> dict | None:
        # talk to f"{base_url}/v1/chat/completions" (or Anthropic's f"{base_url}/v1/messages")
        # with the full message history each turn; run tools; return {"reward": ..., ...}

and names it in the recipe as `"my_pkg.my_agent:agent"`. `run_agent_group(agent_fn, task, n,
session_server_url)` runs it `n` times on one task, each run in a fresh TITO session, and returns
the group's `Sample`s.

Design decisions:
- One run = one session = one trajectory tree = one rollout id (`{group_id}/{i}`). A run that
  forks, retries, spawns subagents or compacts its context yields several samples; they share the
  rollout id so the trainer can normalize per rollout (miles_slime.md 2.8). All samples of the
  group share `group_id`.
- The session is always collected and closed, even when the agent raises or times out (Miles'
  `agentic_tool_call.generate` does the same): tokens that were generated are never lost. Such
  samples are marked `failed` with the error in `metadata["agent_error"]`; a run that produced
  no turn at all gives one empty `aborted` sample, so the group keeps its size and the buffer's
  policy decides.
- The agent's returned dict is the reward channel: `reward` (a float or a dict of floats) goes to
  `Sample.reward`, every other key to `Sample.metadata["agent"]`.
- The agent gets the session base URL (`.../sessions/<id>`), never the engine's: every token it
  causes passes through the session server.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from miles.tito.client import SessionServerClient
from miles.wire.messages import Sample

AgentFn = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]


def load_agent(path: str) -> AgentFn:
    """`module:function` -> the agent function, checked against the contract."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"agent: {path!r} is not an import path of the form 'module:function'")
    fn = getattr(importlib.import_module(module), attr, None)
    if fn is None:
        raise ValueError(f"agent: module {module!r} has no attribute {attr!r}")
    check_agent(fn, path)
    return fn


def check_agent(fn: Any, name: str = "") -> None:
    name = name or getattr(fn, "__qualname__", repr(fn))
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"agent {name}: expected `async def agent(base_url, task) -> dict | None`, "
                        f"got a non-async {type(fn).__name__}")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 2:
        raise TypeError(f"agent {name}: expected two required parameters (base_url, task), "
                        f"got {[p.name for p in params]}")


async def run_agent(agent_fn: AgentFn, task: dict[str, Any], client: SessionServerClient, *,
                    group_id: str, run_index: int, keep: str = "drop_retries",
                    return_routed_experts: bool = False, agent_timeout_s: float | None = None) -> list[Sample]:
    """One agent run in a fresh session; always collects what it generated."""
    rollout_id = f"{group_id}/{run_index}"
    created = await client.create_session(rollout_id=rollout_id,
                                          metadata={"group_id": group_id, "run_index": run_index})
    result: Any = None
    error = ""
    t0 = time.monotonic()
    try:
        result = await asyncio.wait_for(agent_fn(created["base_url"], task), agent_timeout_s)
        if result is not None and not isinstance(result, dict):
            error = f"agent returned {type(result).__name__}, expected a dict or None"
            result = None
    except asyncio.TimeoutError:
        error = f"agent did not finish within {agent_timeout_s} s (agent_timeout_s)"
    except Exception as e:   # the agent's bug or its environment's: record it, keep the tokens
        error = f"{type(e).__name__}: {e}"
    finally:
        samples = await client.collect(created["session_id"], keep=keep, close=True, group_id=group_id,
                                       return_routed_experts=return_routed_experts)
    elapsed_s = time.monotonic() - t0
    result = dict(result or {})
    reward = result.pop("reward", None)
    if not samples:
        samples = [Sample(tokens=np.zeros(0, np.int32), loss_mask=np.zeros(0, np.uint8),
                          rollout_logprobs=np.zeros(0, np.float32), status="aborted", group_id=group_id,
                          rollout_id=rollout_id, metadata={"reason": "the agent made no model call"})]
    for sample in samples:
        sample.reward = reward
        sample.metadata.update({"agent": result, "agent_time_s": elapsed_s, "session_id": created["session_id"]})
        if error:
            sample.status = "failed"
            sample.metadata["agent_error"] = error
    return samples


async def run_agent_group(agent_fn: AgentFn | str, task: dict[str, Any], n: int, session_server_url: str, *,
                          group_id: str | None = None, keep: str = "drop_retries",
                          return_routed_experts: bool = False,
                          agent_timeout_s: float | None = None) -> list[Sample]:
    """Run the agent `n` times on `task` concurrently; the samples of all runs, as one group."""
    if isinstance(agent_fn, str):
        agent_fn = load_agent(agent_fn)
    else:
        check_agent(agent_fn)
    if n < 1:
        raise ValueError(f"n: expected at least 1 agent run per group, got {n}")
    group_id = group_id or str(task.get("id") or uuid.uuid4().hex)
    async with SessionServerClient(session_server_url) as client:
        runs = await asyncio.gather(*(run_agent(agent_fn, task, client, group_id=group_id, run_index=i, keep=keep,
                                                return_routed_experts=return_routed_experts,
                                                agent_timeout_s=agent_timeout_s) for i in range(n)))
    samples = [s for run in runs for s in run]
    for i, sample in enumerate(samples):
        sample.index = i
    return samples
