"""EpisodeContext: what a `rollout.generate` plug-in gets for one sample (one episode).

The contract (`rollout.generate = "pkg.mod:generate"`):

    async def generate(ctx: EpisodeContext, sample: Sample) -> Sample | list[Sample]

`sample` arrives with the prompt tokens (`tokens`, `prompt`, `label`, `metadata`, `group_id`,
`rollout_id`, `index`); the plug-in owns the engine calls (multi-turn, tools) and returns the
finished sample, or several (a trajectory tree: the framework gives them all the input's
`rollout_id` and `group_id`). `ctx` offers:

    ctx.recipe, ctx.engine (EngineClient via the gateway), ctx.tokenizer, ctx.limits (AgentConfig)
    ctx.sampling      this sample's SamplingParams (seed: a hash of run seed, prompt, sample, attempt)
    ctx.routing_key   sent with every engine call of the episode (one engine, one KV prefix)
    ctx.sessions      SessionServerClient with the job's token, or None (session server off)
    await ctx.sandbox()                the episode's sandbox, created on the first call
    await ctx.generate(ids, **params)  one model call -> GenerateResult
    ctx.note(key, value)               a number for the episode's metrics

Design decisions:
- `ctx.generate` is a turn: counted, timed as LLM time, refused (`EpisodeLimitError`) past
  `agent.max_turns` or `agent.max_episode_tokens`, bounded by `agent.turn_timeout_s`, and its
  `max_new_tokens` is clipped to what is left of the episode's token budget. Turn k samples with
  seed `miles.seeds.turn_seed(sampling_seed, k)` (turn 0 keeps the sample's seed, later turns
  hash k in: two turns must not repeat each other's draws); transient engine errors are retried
  from the same input and seed, as the built-in path does.
- Every call is traced (input ids, output ids, log-probs). An episode that raises or times out
  still yields its tokens: `EpisodeContext.partial_sample` rebuilds the longest trajectory from the
  trace, with the loss mask on exactly the model's tokens that are still in it.
- The sandbox is lazy (`LazySandbox`): no tool call, no sandbox. It is created from `[sandbox]`
  with the task's `metadata["image"]`, `metadata["sandbox"]` (its own spec fields, `sandbox_spec`)
  and `metadata["files"]`; an `exec` without a timeout gets
  `agent.tool_timeout_s`; its calls are timed (tool time, create/destroy time), non-zero exits
  counted as tool errors. The episode runner destroys it
  after the verifier, whatever happened. Without `[sandbox]`, `ctx.sandbox()` raises a
  `SandboxError` that names `sandbox.backend`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import numpy as np

from miles.sandboxes.base import SandboxError, SandboxSpec, SandboxSpecError
from miles.seeds import turn_seed
from miles.wire.messages import Sample


async def run_to_end(coro, timeout_s: float = 60.0):
    """Await `coro` so that cancelling the caller cannot cut it off: it runs as its own task, and
    a cancelled caller still waits (up to `timeout_s`) for it to finish before the cancellation
    goes on. For the steps that must happen in every outcome: destroy a sandbox, close a session."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task], timeout=timeout_s)
        raise


class EpisodeLimitError(RuntimeError):
    """An episode hit one of its `[agent]` limits: the episode ends, its samples are truncated."""

    def __init__(self, limit: str, message: str):
        super().__init__(f"agent.{limit}: {message}")
        self.limit = limit


class EpisodeStats:
    """Counters and clocks of one episode; `miles.envs.episode.EpisodeMetrics` averages them."""

    def __init__(self) -> None:
        self.turns = 0
        self.generated_tokens = 0
        self.llm_s = self.tool_s = self.sandbox_s = 0.0
        self.execs = self.exec_errors = 0
        self.create_s: float | None = None
        self.destroy_s: float | None = None
        self.notes: dict[str, float] = {}


class LazySandbox:
    """The episode's sandbox, created on first use; proxies the Sandbox methods and times them."""

    def __init__(self, pool, spec: SandboxSpec, files: dict[str, str], stats: EpisodeStats,
                 tool_timeout_s: float | None = None):
        self._pool, self._spec, self._files, self._stats = pool, spec, files, stats
        self.tool_timeout_s = tool_timeout_s   # an exec's default timeout (agent.tool_timeout_s)
        self._cm = None
        self._sandbox = None
        self._lock = asyncio.Lock()

    @property
    def created(self) -> bool:
        return self._sandbox is not None

    async def get(self):
        async with self._lock:
            if self._sandbox is None:
                t0 = time.monotonic()
                cm = self._pool.sandbox(self._spec)
                sandbox = await cm.__aenter__()
                self._cm, self._sandbox = cm, sandbox
                for path, text in self._files.items():
                    await sandbox.upload(path, text.encode() if isinstance(text, str) else bytes(text))
                self._stats.create_s = time.monotonic() - t0
                self._stats.sandbox_s += self._stats.create_s
            return self._sandbox

    @property
    def id(self) -> str:
        return self._sandbox.id if self._sandbox is not None else ""

    @property
    def workdir(self) -> str:
        return self._sandbox.workdir if self._sandbox is not None else (self._spec.workdir or "/workspace")

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    def open_another(self, spec: SandboxSpec):
        """A fresh sandbox from the same pool, `async with`-ed by the caller (a Harbor task's
        separate verifier); it is the caller's to close, not the episode's. It rides on the
        episode's pool slot: waiting for a second one could deadlock a full pool."""
        return self._pool.sandbox(spec, own_slot=False)

    async def exec(self, cmd, cwd=None, env=None, timeout_s=None, user=None):
        sandbox = await self.get()
        t0 = time.monotonic()
        try:
            result = await sandbox.exec(cmd, cwd=cwd, env=env, user=user,
                                        timeout_s=self.tool_timeout_s if timeout_s is None else timeout_s)
        except Exception:
            self._stats.exec_errors += 1
            raise
        finally:
            self._stats.execs += 1
            self._stats.tool_s += time.monotonic() - t0
        if not result.ok:
            self._stats.exec_errors += 1
        return result

    async def _timed(self, method: str, *args):
        sandbox = await self.get()
        t0 = time.monotonic()
        try:
            return await getattr(sandbox, method)(*args)
        finally:
            self._stats.tool_s += time.monotonic() - t0

    async def upload(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._timed("upload", path, data, mode)

    async def download(self, path: str) -> bytes:
        return await self._timed("download", path)

    async def upload_dir(self, path: str, files) -> None:
        await self._timed("upload_dir", path, files)

    async def destroy(self) -> None:
        """Destroy it if it was created (idempotent; shielded, so a cancelled episode frees it)."""
        cm, self._cm = self._cm, None
        if cm is None:
            return
        t0 = time.monotonic()
        try:
            await run_to_end(cm.__aexit__(None, None, None))
        finally:
            self._stats.destroy_s = time.monotonic() - t0
            self._stats.sandbox_s += self._stats.destroy_s


_TASK_SANDBOX_FIELDS = frozenset(f for f in SandboxSpec.__struct_fields__ if f != "labels")


def sandbox_spec(cfg, metadata: dict[str, Any], labels: dict[str, str]) -> SandboxSpec:
    """The spec of one episode's sandbox: `[sandbox]`, then the task's own fields over it.

    A task row may carry `metadata["image"]` (its image) and `metadata["sandbox"]` (any SandboxSpec
    field but labels: a Harbor task's Dockerfile, workdir, env, resources and lifetime). A task's
    image, rootfs or dockerfile replaces the recipe's image and rootfs; its resources win over the
    recipe's defaults; `network` is the recipe's AND the task's (a recipe without network keeps
    every task off it). The run's labels go on every spec."""
    own = metadata.get("sandbox") or {}
    if not isinstance(own, dict):
        raise SandboxSpecError(f"metadata.sandbox={own!r} is invalid: expected a table of SandboxSpec fields")
    unknown = sorted(set(own) - _TASK_SANDBOX_FIELDS)
    if unknown:
        raise SandboxSpecError(f"metadata.sandbox.{unknown[0]}={own[unknown[0]]!r} is invalid: not a "
                               f"SandboxSpec field; expected one of {sorted(_TASK_SANDBOX_FIELDS)}")
    image = metadata.get("image") or cfg.image or None
    fields: dict[str, Any] = dict(image=image, rootfs=None if image else (cfg.rootfs or None), cpu=cfg.cpu,
                                  memory_mb=cfg.memory_mb, network=cfg.network, ttl_s=cfg.ttl_s)
    if any(own.get(k) is not None for k in ("image", "rootfs", "dockerfile")):
        fields.update(image=None, rootfs=None)
    fields.update(own)
    fields["network"] = bool(cfg.network) and own.get("network", True) is not False
    try:
        return msgspec.convert({**fields, "labels": labels}, SandboxSpec)
    except msgspec.ValidationError as e:   # a wrong type, or SandboxSpec's own check (names the field)
        raise SandboxSpecError(f"a task's sandbox: {str(e).replace('`$.', '`metadata.sandbox.')}") from None


def no_sandbox(*_args, **_kwargs):
    raise SandboxError("this episode asked for a sandbox, but the recipe has none: set "
                       "sandbox.backend (subprocess | bwrap | docker | e2b | daytona | modal | agentenv)")


class EpisodeContext:
    def __init__(self, *, recipe, engine, tokenizer, sampling, routing_key: str, sessions,
                 sandbox: LazySandbox | None, stats: EpisodeStats, rid: str, retry=None):
        self.recipe, self.engine, self.tokenizer = recipe, engine, tokenizer
        self.sampling, self.routing_key, self.sessions = sampling, routing_key, sessions
        self.limits = recipe.agent
        self.stats = stats
        self._sandbox, self._rid, self._retry = sandbox, rid, retry
        self.trace: list[tuple[list[int], Any]] = []   # (input ids, GenerateResult) per turn

    async def sandbox(self) -> LazySandbox:
        if self._sandbox is None:
            no_sandbox()
        await self._sandbox.get()
        return self._sandbox

    def note(self, key: str, value: float) -> None:
        self.stats.notes[key] = self.stats.notes.get(key, 0.0) + float(value)

    async def generate(self, input_ids, **param_overrides):
        """One model call (a turn) through the gateway, with the episode's routing key."""
        limits, stats = self.limits, self.stats
        if stats.turns >= limits.max_turns:
            raise EpisodeLimitError("max_turns", f"the episode already made {stats.turns} model calls")
        left = limits.max_episode_tokens - stats.generated_tokens
        if left <= 0:
            raise EpisodeLimitError("max_episode_tokens", f"{stats.generated_tokens} tokens generated")
        ids = input_ids.tolist() if isinstance(input_ids, np.ndarray) else list(input_ids)
        seed = self.sampling.sampling_seed
        if seed is not None:   # turn k > 0 hashes k in: two turns must not share their draws
            seed = turn_seed(seed, stats.turns)
        params = msgspec.structs.replace(self.sampling, sampling_seed=seed, **param_overrides)
        params = msgspec.structs.replace(params, max_new_tokens=min(params.max_new_tokens or left, left))
        rid = f"{self._rid}-t{stats.turns}"
        stats.turns += 1

        async def call():
            return await self.engine.generate(
                ids, params, return_logprob=True, routing_key=self.routing_key, rid=rid,
                return_routed_experts=self.recipe.rollout.return_routed_experts)
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(self._retry(call) if self._retry else call(),
                                            limits.turn_timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeLimitError("turn_timeout_s", f"a model call took over {limits.turn_timeout_s} s") from None
        finally:
            stats.llm_s += time.monotonic() - t0
        stats.generated_tokens += len(result.output_ids)
        self.trace.append((ids, result))
        return result

    def partial_sample(self, sample: Sample) -> Sample:
        """The longest trajectory of the trace as a sample (prompt from `sample`), for an episode
        that ended early: the model's tokens still in it are trained on, nothing else."""
        prompt_len = sample.prompt_length
        if not self.trace:
            out = msgspec.structs.replace(sample, response_length=0, loss_mask=np.zeros(0, np.uint8),
                                          rollout_logprobs=np.zeros(0, np.float32), metadata=dict(sample.metadata))
            return out
        last_ids, last = self.trace[-1]
        tokens = np.asarray(last_ids + list(last.output_ids), np.int32)
        n = len(tokens) - prompt_len
        mask, logprobs = np.zeros(n, np.uint8), np.zeros(n, np.float32)
        for ids, result in self.trace:   # a turn counts if its input+output is a prefix of the end
            out = list(result.output_ids)
            start = len(ids) - prompt_len
            if start < 0 or start + len(out) > n or tokens[:len(ids) + len(out)].tolist() != ids + out:
                continue
            mask[start:start + len(out)] = 1
            if result.output_logprobs is not None:
                logprobs[start:start + len(out)] = result.output_logprobs
        return msgspec.structs.replace(sample, tokens=tokens, response_length=n, loss_mask=mask,
                                       rollout_logprobs=logprobs, weight_versions=[],
                                       metadata=dict(sample.metadata),
                                       response=self.tokenizer.decode(tokens[prompt_len:].tolist(),
                                                                      skip_special_tokens=True))
