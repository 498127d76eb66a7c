"""The episode runner: one sample's trip through the configured depth, its verifier and its sandbox.

    env = await EpisodeEnv.open(recipe, engines, engine_client, tokenizer, role="rollout", incarnation=n)
    samples = await run_episode(env, sample, sampling_params)     # list: a trajectory tree
    await env.close()

The rollout worker and the evaluator both call `run_episode`, so an agent recipe's held-out reward
is the agent's. The depth is `rollout.generate` (`miles.envs.context`), `rollout.agent`
(`miles.envs.agent`) or neither (the caller's own one-call generate, passed as `generate=`).

Design decisions:
- The verifier (`rollout.reward`) runs once per episode, on its last sample, and only when the
  plug-in set no reward; its value goes to every sample of the episode (siblings of one rollout
  must share a reward). A reward function with a parameter named `sandbox` is called as
  `reward(sample, sandbox=<the episode's sandbox>)`, so it can read the sandbox's state.
- Then the sandbox is destroyed, in every outcome: success, exception, timeout, cancellation
  (`finally` + shield). A killed actor leaves its sandboxes to the TTL and to the next
  incarnation's sweep: the pool labels every sandbox `miles.run=<run name>` and
  `miles.role=<rollout|eval>`, and the worker sweeps its role's leftovers at start and at stop
  (the evaluator's live sandboxes are not the worker's to sweep).
- Failures are data: a plug-in that raises gives `failed` samples, one past
  `agent.episode_timeout_s` or an `[agent]` limit `truncated` ones, and both keep the tokens they
  generated (the trace of `ctx.generate`, or the agent's session). An ending with no response
  token is `failed` (there is nothing to train).
- Sessions: `rollout.agent` needs the TITO session server. The fleet's (`EngineSet.session_url`)
  is used when it runs one; otherwise the worker starts its own in front of the gateway (a
  supervised child, stopped with the worker). Each session's metadata names the run, the role and
  the worker incarnation: a restarted worker deletes the sessions of its predecessors.
- Metrics: means over the last `WINDOW` episodes (a deque, so any number of readers see the same
  figures) and cumulative counts of episodes, truncated and failed ones.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

from miles.envs.context import (EpisodeContext, EpisodeLimitError, EpisodeStats, LazySandbox,
                                no_sandbox, sandbox_spec)
from miles import plugins
from miles.rl.rewards import call_off_loop, check_reward
from miles.sandboxes.base import SandboxSpecError
from miles.wire.messages import Sample

WINDOW = 256
GenerateFn = Callable[[EpisodeContext, Sample], Awaitable["Sample | list[Sample]"]]


def takes_sandbox(fn: Callable) -> bool:
    try:
        return "sandbox" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class EpisodeMetrics:
    def __init__(self) -> None:
        self.recent: collections.deque = collections.deque(maxlen=WINDOW)
        self.counts = {"count": 0, "truncated": 0, "failed": 0}

    def add(self, stats: EpisodeStats, samples: list[Sample], agent_metrics: dict[str, float]) -> None:
        notes = {**stats.notes, **agent_metrics}
        row = {"turns": notes.pop("turns", stats.turns),
               "tool_calls": notes.pop("tool_calls", stats.execs),
               "tool_errors": notes.pop("tool_errors", stats.exec_errors),
               "llm_s": stats.llm_s, "tool_s": notes.pop("tool_s", stats.tool_s),
               "sandbox_s": stats.sandbox_s,
               "tokens_per_trajectory": float(np.mean([s.response_length for s in samples])),
               "samples_per_rollout": float(len(samples))}
        # the session server's account of the whole session, the same on each of its samples
        session = next((s.metadata["session_stats"] for s in samples
                        if isinstance(s.metadata.get("session_stats"), dict)), None)
        if session is not None:
            row["session_s"] = float(session.get("server_s", 0.0))
            row["llm_s"] = row["llm_s"] or float(session.get("engine_s", 0.0))
            row["turns"] = row["turns"] or int(session.get("turns", 0))
        for key in ("create_s", "destroy_s"):
            if getattr(stats, key) is not None:
                row[f"sandbox/{key}"] = getattr(stats, key)
        if stats.execs:
            row["sandbox/exec_s"] = stats.tool_s / stats.execs
        row.update({f"note/{k}": v for k, v in notes.items()})
        self.recent.append(row)
        self.counts["count"] += 1
        self.counts["truncated"] += any(s.status == "truncated" for s in samples)
        self.counts["failed"] += any(s.status in ("failed", "aborted") for s in samples)

    def values(self) -> dict[str, float]:
        out = {f"episode/{k}": float(v) for k, v in self.counts.items()}
        keys = {k for row in self.recent for k in row}
        for key in sorted(keys):
            vals = [row[key] for row in self.recent if key in row]
            name = key if key.startswith("sandbox/") else f"episode/{key.removeprefix('note/')}"
            out[name] = float(np.mean(vals))
        return out


class EpisodeEnv:
    """What every episode of one actor shares: engine, tokenizer, plug-ins, sandbox pool, sessions."""

    def __init__(self, recipe, engine, tokenizer, *, role: str, incarnation: int = 0, retry=None,
                 reward_fn=None):
        ro = recipe.rollout
        self.recipe, self.engine, self.tokenizer = recipe, engine, tokenizer
        self.role, self.incarnation, self.retry = role, incarnation, retry
        self.generate_fn: GenerateFn | None = plugins.load("rollout.generate", ro.generate) if ro.generate else None
        self.agent_fn = plugins.load("rollout.agent", ro.agent) if ro.agent else None
        self.reward_fn = reward_fn or plugins.load("rollout.reward", ro.reward,
                                                    sandbox=bool(recipe.sandbox.backend))
        self.reward_takes_sandbox = takes_sandbox(self.reward_fn)
        self.pool = None
        self.sessions = None
        self._server = None
        self.metrics = EpisodeMetrics()
        self.episodes = None   # the rollout role's EpisodeStore (`logging.episodes`), set by open

    @classmethod
    async def open(cls, recipe, engines, engine, tokenizer, *, role: str, incarnation: int = 0,
                   retry=None, reward_fn=None) -> "EpisodeEnv":
        """`engines` is the fleet's `EngineSet`. The rollout role sweeps its run's leftovers."""
        env = cls(recipe, engine, tokenizer, role=role, incarnation=incarnation, retry=retry,
                  reward_fn=reward_fn)
        if role == "rollout":
            from miles.episodes import EpisodeStore
            env.episodes = EpisodeStore.for_recipe(recipe, incarnation)
        if recipe.sandbox.backend:
            from miles.sandboxes import SandboxPool, get_backend
            cfg = recipe.sandbox
            env.pool = SandboxPool(get_backend(cfg.backend, **cfg.options), max_concurrent=cfg.max_concurrent,
                                   create_rate_per_s=cfg.create_rate_per_s or None,
                                   run_id=recipe.run.name, labels={"miles.role": role})
            if role == "rollout":
                await env.pool.sweep()
        if recipe.rollout.agent or recipe.session.enabled == "on":
            await env._open_sessions(engines)
        return env

    async def _open_sessions(self, engines) -> None:
        from miles.tito.client import SessionServerClient
        url, token = engines.session_url, None
        if url and engines.session_token_file:
            token = Path(engines.session_token_file).read_text().strip()
        if not url:
            url, token = await self._start_session_server(engines)
        self.sessions = SessionServerClient(url, token=token, timeout_s=self.recipe.agent.turn_timeout_s + 60)
        if self.role == "rollout" and self.incarnation > 0:
            await self._delete_stale_sessions()

    async def _start_session_server(self, engines) -> tuple[str, str]:
        """The fleet runs no session server: start one for this actor, in front of the gateway."""
        from miles.engines.procs import ServerProcess, free_port
        logs = Path(self.recipe.output_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        token_file = logs / f"session-{self.role}-{self.incarnation}.token"
        token_file.write_text(token)
        os.chmod(token_file, 0o600)
        port = free_port()
        s = self.recipe.session
        argv = [sys.executable, "-m", "miles.tito.server", "--engine-url", engines.gateway_url,
                "--model-path", engines.model_path, "--family", s.family, "--port", str(port),
                "--token-file", str(token_file)]
        if s.max_context_tokens:
            argv += ["--max-context-tokens", str(s.max_context_tokens)]
        self._server = ServerProcess(f"session-server-{self.role}", argv,
                                     log_path=logs / f"session-{self.role}-{self.incarnation}.log").start()
        url = f"http://127.0.0.1:{port}"
        await self._server.wait_healthy(url, timeout_s=120.0)
        return url, token

    async def our_sessions(self) -> list[tuple[str, dict[str, Any]]]:
        """(session id, metadata) of the open sessions of this run and role."""
        from miles.tito.client import SessionServerError
        out = []
        for sid in await self.sessions.list_sessions():
            try:
                meta = (await self.sessions.info(sid)).get("metadata") or {}
            except SessionServerError as e:
                if e.status == 404:
                    continue  # collected meanwhile
                raise
            if meta.get("run") == self.recipe.run.name and meta.get("role") == self.role:
                out.append((sid, meta))
        return out

    async def _delete_stale_sessions(self) -> None:
        """Sessions of this run and role opened by an older incarnation: nobody will collect them."""
        for sid, meta in await self.our_sessions():
            if int(meta.get("incarnation", -1)) < self.incarnation:
                try:
                    await self.sessions.delete(sid)
                except Exception as e:  # one session that went away meanwhile stops nothing
                    print(f"[{self.role}] stale session {sid}: {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"[{self.role}] deleted session {sid} of incarnation {meta['incarnation']}", flush=True)

    async def settle(self) -> None:
        """After the episodes were stopped (cancelled): wait for their collects, then say what is
        still open (none of it should be)."""
        from miles.envs.agent import _COLLECTS
        if _COLLECTS:
            await asyncio.wait(list(_COLLECTS), timeout=30.0)
        parts = []
        if self.sessions is not None:
            try:
                parts.append(f"sessions of this run open: {len(await self.our_sessions())}")
            except Exception as e:  # the session server may be gone already: say so, go on
                parts.append(f"sessions: not listed ({type(e).__name__}: {e})")
        if self.pool is not None:
            parts.append(f"sandboxes live: {self.pool.stats.live}")
        if parts:
            print(f"[{self.role}] episodes settled: {'; '.join(parts)}", flush=True)

    async def close(self) -> None:
        """Free what the episodes left: live sandboxes, then the run's leftovers (one line says
        what was found), the session client and a session server of our own."""
        from miles.envs.agent import _COLLECTS
        if _COLLECTS:
            await asyncio.wait(list(_COLLECTS), timeout=30.0)
        parts = []
        if self.sessions is not None:
            await self.sessions.close()
        if self.pool is not None:
            st = self.pool.stats
            parts.append(f"sandboxes created {st.created}, destroyed {st.destroyed}, live at close {st.live}")
            await self.pool.close()
            if self.role == "rollout":
                own, others = await self.pool.sweep_counted()
                parts.append(f"swept {own}" + (f" (and {others} expired or orphaned of other runs)"
                                               if others else ""))
            await self.pool.backend.close()
        if self._server is not None:
            await self._server.stop_async(grace_s=5)
        if self.episodes is not None:
            await asyncio.to_thread(self.episodes.close)
        if parts:
            print(f"[{self.role}] episodes closed: {'; '.join(parts)}", flush=True)

    def pool_values(self) -> dict[str, float]:
        """The sandbox pool's counts, and the episode store's (`episodes/written`, ...)."""
        out = self.episodes.metrics() if self.episodes is not None else {}
        if self.pool is None:
            return out
        st = self.pool.stats
        return {**out, "sandbox/live": float(st.live), "sandbox/created": float(st.created),
                "sandbox/destroyed": float(st.destroyed), "sandbox/create_failures": float(st.create_failures),
                "sandbox/destroy_failures": float(st.destroy_failures)}


def _task(sample: Sample, recipe, sandbox: LazySandbox | None, sampling=None) -> dict[str, Any]:
    # keep_transcript: the agent returns its messages, which the episode store keeps
    return {"keep_transcript": recipe.logging.episodes, **sample.metadata,
            "prompt": sample.prompt, "label": sample.label, "id": sample.rollout_id,
            "limits": msgspec.structs.asdict(recipe.agent), "sampling": _openai_sampling(sampling),
            "sandbox": sandbox if sandbox is not None else _NoSandbox(no_sandbox)}


def _openai_sampling(sampling) -> dict[str, Any]:
    """This episode's sampling parameters in OpenAI request names (`task["sampling"]`), so an agent
    samples as the recipe says: `rollout.*` for training, `eval.temperature` for evaluation."""
    if sampling is None:
        return {}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "sampling_seed": "seed",
             "max_new_tokens": "max_tokens"}
    out = {k: getattr(sampling, f) for f, k in names.items() if getattr(sampling, f, None) is not None}
    if out.get("top_k") == -1:
        out.pop("top_k")
    return out


class _NoSandbox:
    """`task["sandbox"]` without `[sandbox]`: any use names the missing recipe key."""

    def __init__(self, fail):
        self._fail = fail

    def __getattr__(self, name):
        self._fail()


async def run_episode(env: EpisodeEnv, sample: Sample, sampling, *, generate: GenerateFn | None = None,
                      verify: bool = True) -> list[Sample]:
    """One episode: the configured depth (else `generate`), the verifier, the sandbox destroyed."""
    recipe = env.recipe
    stats = EpisodeStats()
    sandbox = None
    if env.pool is not None:
        try:
            spec = sandbox_spec(recipe.sandbox, sample.metadata, {})
        except SandboxSpecError as e:   # the task's own sandbox fields: this sample fails, the run goes on
            failed = msgspec.structs.replace(sample, status="failed", metadata={**sample.metadata, "error": str(e)})
            env.metrics.add(stats, [failed], {})
            return [failed]
        sandbox = LazySandbox(env.pool, spec, dict(sample.metadata.get("files") or {}), stats,
                              recipe.agent.tool_timeout_s)
    ctx = EpisodeContext(recipe=recipe, engine=env.engine, tokenizer=env.tokenizer, sampling=sampling,
                         routing_key=sample.group_id or sample.rollout_id, sessions=env.sessions,
                         sandbox=sandbox, stats=stats, rid=f"{sample.rollout_id}-{sampling.sampling_seed}",
                         retry=env.retry)
    agent_metrics: dict[str, float] = {}
    try:
        if env.agent_fn is not None:
            samples, agent_metrics = await _agent_episode(env, sample, sandbox, sampling)
        elif env.generate_fn is not None:
            samples = await _generate_episode(env.generate_fn, ctx, sample, recipe)
        else:  # the caller's one-call path: its errors are its own to handle
            out = await generate(ctx, sample)
            samples = out if isinstance(out, list) else [out]
        for s in samples:
            s.group_id, s.rollout_id = s.group_id or sample.group_id, s.rollout_id or sample.rollout_id
            s.metadata = {**sample.metadata, **s.metadata}
            s.prompt, s.label = s.prompt or sample.prompt, sample.label if s.label is None else s.label
            if s.status in ("completed", "truncated") and s.response_length == 0:
                s.status = "failed"
                s.metadata.setdefault("error", "the episode ended before the model generated a token")
        if verify:
            await _verify(env, samples, sandbox)
        if sandbox is not None and sandbox.created:   # the episode store shows it
            for s in samples:
                s.metadata.setdefault("sandbox_id", sandbox.id)
                s.metadata.setdefault("sandbox_image", spec.image or "")   # provenance
    finally:
        if sandbox is not None:
            await sandbox.destroy()
    env.metrics.add(stats, samples, agent_metrics)
    return samples


async def _generate_episode(fn: GenerateFn, ctx: EpisodeContext, sample: Sample, recipe) -> list[Sample]:
    status, error = "", ""
    try:
        out = await asyncio.wait_for(fn(ctx, msgspec.structs.replace(sample, metadata=dict(sample.metadata))),
                                     recipe.agent.episode_timeout_s)
        samples = out if isinstance(out, list) else [out]
        if not samples or not all(isinstance(s, Sample) for s in samples):
            raise TypeError(f"rollout.generate = {recipe.rollout.generate!r} returned {type(out).__name__}"
                            f"{'' if not isinstance(out, list) else ' of ' + str([type(s).__name__ for s in out])}"
                            f": expected a Sample or a non-empty list of Samples")
        return samples
    except asyncio.TimeoutError:
        status, error = "truncated", f"agent.episode_timeout_s = {recipe.agent.episode_timeout_s}: episode cut off"
    except EpisodeLimitError as e:
        status, error = "truncated", str(e)
    except Exception as e:  # the plug-in's bug or its environment's: keep its tokens, say why
        status, error = "failed", f"{type(e).__name__}: {e}"
    partial = ctx.partial_sample(sample)
    partial.status = status
    partial.metadata["error"] = error
    return [partial]


async def _agent_episode(env: EpisodeEnv, sample: Sample, sandbox,
                         sampling=None) -> tuple[list[Sample], dict[str, float]]:
    from miles.envs.agent import run_agent
    recipe = env.recipe
    run = await run_agent(env.agent_fn, _task(sample, recipe, sandbox, sampling), env.sessions, group_id=sample.group_id,
                          rollout_id=sample.rollout_id,
                          metadata={"run": recipe.run.name, "role": env.role, "incarnation": env.incarnation},
                          keep=recipe.agent.keep, return_routed_experts=recipe.rollout.return_routed_experts,
                          agent_timeout_s=recipe.agent.episode_timeout_s)
    if run.reward is not None:
        try:
            reward = check_reward(run.reward, f"rollout.agent {recipe.rollout.agent!r} returned")
        except ValueError as e:  # the tokens stay; the buffer's policy decides on the group
            reward = None
            for s in run.samples:
                s.status, s.metadata["error"] = "failed", str(e)
        for s in run.samples:
            s.reward = reward
    return run.samples, run.metrics


async def _verify(env: EpisodeEnv, samples: list[Sample], sandbox) -> None:
    """The verifier, once per episode, unless the plug-in scored it; every sample gets its value."""
    last = samples[-1]
    given = [s.reward for s in samples if s.reward is not None]
    if given:
        for s in samples:
            s.reward = s.reward if s.reward is not None else given[-1]
        return
    if last.status not in ("completed", "truncated") or env.recipe.rollout.reward_batched:
        return
    fn, where = env.reward_fn, f"rollout.reward {env.recipe.rollout.reward!r}"
    kwargs = {"sandbox": sandbox} if env.reward_takes_sandbox else {}
    try:
        reward = check_reward(await call_off_loop(fn, last, **kwargs), where)
    except Exception as e:
        for s in samples:
            s.status, s.metadata["error"] = "failed", f"reward: {type(e).__name__}: {e}"
        return
    for s in samples:
        s.reward = reward
