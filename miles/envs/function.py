"""`rollout.function`: one user call makes a whole step's groups (slime's custom rollout function).

A user writes

    async def rollout(ctx: RolloutContext, n_groups: int) -> list[Group]:
        # ctx.prompts: the n_groups prompts reserved for this call (Prompt: index, prompt, label)
        # make one Group per prompt (Group.prompt_index = prompt.index), any number of samples
        # (a trajectory tree is several samples sharing a rollout_id), rewards set

and names it in the recipe: `[rollout] function = "my_pkg.mod:rollout"`. `ctx` holds `prompts`,
`recipe`, `engine` (the gateway's `EngineClient`), `tokenizer`, `sampling_params(seed)`,
`sample_seed(prompt, index, attempt=0)`, `tokenize(prompt)`, `generate_group(prompt)` (the
worker's configured per-sample path, episodes included, for prompts the function does not handle
itself), `reward(sample or samples)` (`rollout.reward`; sets and returns the rewards), and
`sandboxes` / `sessions` (the worker's `SandboxPool` and `SessionServerClient`, None when the
recipe has none).

Design decisions:
- The worker's admission is kept: every prompt of a call gets its slot by the same `Reserve` the
  per-sample loop sends (prompt index, data position, a request id kept with the prompt until a
  slot takes it), so the buffer's staleness rules, its journal, checkpoints ("prompts in flight")
  and a restarted worker's resume work unchanged: no prompt lost, none trained twice.
- `n_groups` is `loop.groups_per_step`, or fewer: after the first slot, each further one is waited
  for at most `FILL_WAIT_S`. Otherwise a step whose filtered groups handed slots back could wait
  for a slot that opens only once that very step is trained (sync mode: a deadlock).
- Each reserved prompt has its own task from the moment its slot is taken (in the worker's group
  table, so a checkpoint lists it and a stop cancels it); it waits for the call's result, puts
  its group, and regenerates it through `generate_group` when the buffer's policy says "retry".
- The result is checked as a whole: a non-list, a non-Group, a group for a prompt not reserved
  or given twice fails the call. A failed call (that, or an exception) releases all its slots
  with the reason, logs its traceback once per kind of error (then one line), and the loop backs
  off (tenacity: 0.5 s doubling to 30 s) and goes on. Prompts left without a group are released
  with a reason; an empty group likewise.
- Samples get the bookkeeping the buffer's policy and the trainer read when the function left it
  out (`metadata["prompt_index"]`, `metadata["retries"]`, `group_id`, `rollout_id`).
- Metrics (the worker's counters): `rollout/function_calls`, `rollout/function_errors`,
  `rollout/function_s` (seconds inside the function, summed).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from miles import plugins
from miles.engines.sampling_params import sampling_params
from miles.rl.data import Prompt
from miles.rl.rewards import check_reward
from miles.seeds import sample_seed
from miles.wire.messages import Group, PutGroup, Reserve, Sample
from miles.wire.transport import RemoteError

FILL_WAIT_S = 1.0   # after a call's first slot, how long each further Reserve may wait
BUFFER_RETRIES = 3  # as the worker's: re-sends of an idempotent buffer call across a restart

RolloutFn = Callable[["RolloutContext", int], Awaitable[list[Group]]]


class FunctionFailed(Exception):
    """One call of the rollout function failed (raised, or returned something unusable)."""


@dataclass
class RolloutContext:
    """What one call of a rollout function gets (see the module docstring)."""
    prompts: list[Prompt]
    recipe: Any
    engine: Any
    tokenizer: Any
    sandboxes: Any
    sessions: Any
    _worker: Any

    def sampling_params(self, seed: int):
        return sampling_params(self.recipe.rollout, seed)

    def sample_seed(self, prompt: Prompt, index: int, attempt: int = 0) -> int:
        """The built-in worker's seed of this sample (`miles.seeds.sample_seed`: a hash)."""
        return sample_seed(self.recipe.run.seed, prompt.index, index, attempt)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self._worker.tokenize_prompt(prompt)

    async def generate_group(self, prompt: Prompt, attempt: int = 0) -> Group:
        return await default_group(self._worker, prompt, attempt)

    async def reward(self, samples: Sample | list[Sample]):
        """Score with `rollout.reward` (batched or not, as configured); sets `reward` on each."""
        w = self._worker
        many = isinstance(samples, list)
        batch = samples if many else [samples]
        where = f"rollout.reward {w.cfg.reward!r}"
        if w.cfg.reward_batched:
            values = await w._call_reward(batch)
            if len(values) != len(batch):
                raise ValueError(f"{where}: returned {len(values)} rewards for {len(batch)} samples")
        else:
            values = await asyncio.gather(*(w._call_reward(s) for s in batch))
        for s, v in zip(batch, values):
            s.reward = check_reward(v, where)
        return [s.reward for s in batch] if many else batch[0].reward


def load_rollout_function(path: str) -> RolloutFn:
    """`module:function` -> the function, checked against the contract (errors name the key)."""
    return plugins.load("rollout.function", path)


async def default_group(worker, prompt: Prompt, attempt: int = 0) -> Group:
    """The configured per-sample path for one prompt (`rollout.generate` / `rollout.agent` or one
    engine call per sample): n_samples_per_prompt episodes, rewards set, buffer untouched."""
    return await worker.generate_group(prompt, attempt)


async def run_function_loop(worker) -> None:
    """The worker's loop while `rollout.function` is set: one call per step's prompts."""
    try:
        fn = load_rollout_function(worker.cfg.function)
    except ValueError as e:
        print(f"ERROR [rollout] {e}", flush=True)
        raise
    for key in ("function_calls", "function_errors", "function_s"):
        worker.counts.setdefault(key, 0)
    seen: set[str] = set()   # kinds of errors whose traceback was printed

    def log_failure(state) -> None:
        e = state.outcome.exception()
        cause = e.__cause__ or e
        kind = f"{type(cause).__name__}:{traceback.extract_tb(cause.__traceback__)[-1:]!s}"
        wait_s = state.next_action.sleep if state.next_action else 0.0
        if kind not in seen:
            seen.add(kind)
            print(f"ERROR [rollout] {e}; trying again in {wait_s:.1f} s\n"
                  f"{''.join(traceback.format_exception(cause)).rstrip()}", flush=True)
        else:
            print(f"ERROR [rollout] {e} (again); trying again in {wait_s:.1f} s", flush=True)

    while worker._running:
        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception_type(FunctionFailed),
                                               wait=wait_exponential(multiplier=0.5, max=30.0),
                                               before_sleep=log_failure, reraise=True):
                with attempt:
                    await _one_call(worker, fn)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the buffer or the admission: as the per-sample loop does
            print(f"ERROR [rollout] function loop: {type(e).__name__}: {e}; trying again in 1 s",
                  flush=True)
            await asyncio.sleep(1.0)


async def _one_call(worker, fn: RolloutFn) -> None:
    """Reserve a step's slots, call the function once, hand each group to its prompt's task."""
    await worker._admission_open.wait()
    await worker._wait_engines_up()
    waiting: dict[int, asyncio.Future] = {}   # prompt index -> its task's future
    prompts: list[Prompt] = []
    try:
        n = worker.recipe.loop.groups_per_step
        while len(prompts) < n and worker._running:
            taken = await _reserve(worker, first=not prompts)
            if taken is None:
                break
            prompt, slot = taken
            if prompt.index in waiting:  # cannot happen with a sane source; never two slots' worth
                raise ValueError(f"prompt {prompt.index} was reserved twice in one call")
            waiting[prompt.index] = asyncio.get_running_loop().create_future()
            prompts.append(prompt)
            _track(worker, prompt, _deliver(worker, prompt, slot, waiting[prompt.index]))
    except Exception:
        _settle(waiting, "the rollout function's reservations failed")
        raise
    if not prompts:
        return
    env = worker.env   # the episodes' shared parts: sandbox pool and session client, or None
    ctx = RolloutContext(prompts=list(prompts), recipe=worker.recipe, engine=worker.client,
                         tokenizer=worker.tokenizer, sandboxes=env.pool, sessions=env.sessions,
                         _worker=worker)
    worker.counts["function_calls"] += 1
    t0 = time.monotonic()
    try:
        out = await fn(ctx, len(prompts))
        groups = _check_result(out, waiting)
    except Exception as e:  # a stop (CancelledError) leaves the slots to the checkpoint's replay
        worker.counts["function_errors"] += 1
        reason = f"rollout.function {worker.cfg.function!r} failed: {type(e).__name__}: {e}"
        _settle(waiting, reason)
        raise FunctionFailed(reason) from e
    finally:
        worker.counts["function_s"] += time.monotonic() - t0
    for index, fut in waiting.items():
        if not fut.done():
            fut.set_result(groups.get(index, "rollout.function returned no group for this prompt"))


def _check_result(out: Any, waiting: dict[int, asyncio.Future]) -> dict[int, Group]:
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"returned {type(out).__name__}, expected list[Group]")
    groups: dict[int, Group] = {}
    for i, g in enumerate(out):
        if not isinstance(g, Group):
            raise TypeError(f"item {i} is a {type(g).__name__}, expected a Group")
        if g.prompt_index not in waiting:
            raise ValueError(f"item {i} (group {g.group_id!r}) names prompt_index {g.prompt_index}, "
                             f"which was not reserved for this call (reserved: {sorted(waiting)})")
        if g.prompt_index in groups:
            raise ValueError(f"item {i}: a second group for prompt_index {g.prompt_index}")
        bad = [type(s).__name__ for s in g.samples if not isinstance(s, Sample)]
        if bad:
            raise TypeError(f"item {i} (group {g.group_id!r}): samples must be Sample, got {bad[0]}")
        groups[g.prompt_index] = g
    return groups


def _settle(waiting: dict[int, asyncio.Future], reason: str) -> None:
    for fut in waiting.values():
        if not fut.done():
            fut.set_result(reason)


async def _reserve(worker, first: bool) -> tuple[Prompt, int] | None:
    """One slot and its prompt, as the per-sample loop's `_admit_one` takes them; None when the
    buffer admits no further slot within FILL_WAIT_S (not for the call's first)."""
    if worker._pending is None:
        worker._pending = worker._next_prompt()
    prompt, data_state, replay, request_id = worker._pending
    try:
        reservation = await worker.buffer.call(
            Reserve(prompt_index=prompt.index, data_state=data_state, replay=replay,
                    request_id=request_id, owner=worker.incarnation,
                    timeout_s=0.0 if first else FILL_WAIT_S),
            timeout_s=10**9, retries=BUFFER_RETRIES)
    except RemoteError as e:
        if not first and e.reply.error_type == "TimeoutError":
            return None   # the prompt stays pending, with its request id, for the next call
        raise
    if reservation.retry_prompt >= 0 and reservation.retry_prompt != prompt.index:
        # The slot went to a prompt rejected as stale; ours waits for the next slot.
        worker._pending = (prompt, data_state, replay, worker._request_id())
        if not hasattr(worker.source, "at"):
            worker._spawn(worker._release(reservation.slot, "stale prompt cannot be regenerated"))
            return await _reserve(worker, first)
        prompt = worker.source.at(reservation.retry_prompt)
    else:
        worker._pending = None
    return prompt, reservation.slot


def _track(worker, prompt: Prompt, coro) -> None:
    """A prompt's task in the worker's group table (checkpoints list it; a stop cancels it)."""
    worker.counts["groups_started"] += 1
    task = asyncio.get_running_loop().create_task(coro)
    worker._tasks_groups.add(task)
    worker._group_prompts[task] = prompt.index
    task.add_done_callback(worker._group_done)


async def _deliver(worker, prompt: Prompt, slot: int, result: asyncio.Future) -> None:
    """Wait for the call's group for this prompt, put it; regenerate it while the policy retries."""
    try:
        outcome = await result
        if isinstance(outcome, Group) and not outcome.samples:
            outcome = "rollout.function returned an empty group"
        if isinstance(outcome, str):
            await worker._release(slot, outcome)
            return
        group, attempt = outcome, 0
        while (await _put(worker, group, prompt, slot, attempt)).decision == "retry":
            worker.counts["retries"] += 1
            attempt += 1
            group = await default_group(worker, prompt, attempt)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never leak a reserved slot: the buffer would wait for it forever
        print(f"group for prompt {prompt.index} failed: {type(e).__name__}: {e}", flush=True)
        await worker._release(slot, f"{type(e).__name__}: {e}")


async def _put(worker, group: Group, prompt: Prompt, slot: int, attempt: int):
    for i, s in enumerate(group.samples):
        s.metadata.setdefault("prompt_index", prompt.index)
        s.metadata.setdefault("retries", attempt)
        s.group_id = s.group_id or group.group_id
        s.rollout_id = s.rollout_id or f"{group.group_id}-{i}"
    if attempt == 0:  # the default path counts its own samples
        _count_samples(worker, group)
    reply = await worker.buffer.call(PutGroup(group=group, slot=slot, owner=worker.incarnation),
                                     timeout_s=10**9, retries=BUFFER_RETRIES)
    worker.counts["groups_put"] += 1
    if worker.env.episodes is not None:   # <run>/episodes.jsonl, as the per-sample path writes it
        worker.env.episodes.write(group, reply.decision, reply.reason)
    return reply


def _count_samples(worker, group: Group) -> None:
    for s in group.samples:
        worker.counts["samples"] += 1
        worker.counts["tokens_generated"] += s.response_length
        if s.status == "failed":
            worker.counts["samples_failed"] += 1
        elif s.reward is not None:
            try:
                worker.recent_rewards.append(s.scalar_reward(worker.recipe.train.reward_key))
            except ValueError:
                pass
