"""SandboxPool: how rollout code gets sandboxes. One fresh sandbox per episode, never reused.

    pool = SandboxPool(get_backend("bwrap"), max_concurrent=32, create_rate_per_s=20)
    await pool.sweep()                       # remove what a crashed run with our labels left
    async with pool.sandbox(spec) as sb:     # waits for a slot, creates (with retries), destroys
        await sb.exec("make test", timeout_s=60)

Design decisions:
- A concurrency slot is held from before create until destroy has finished, so `max_concurrent`
  bounds live sandboxes (and provider quota), not just running episodes. The one exception is an
  episode's second sandbox (`own_slot=False`, a separate verifier), which rides on its slot.
- Creation is paced by a token bucket (`create_rate_per_s`, `create_burst`) shared by every
  episode of the pool: providers throttle bursts (Modal's 5/s, Daytona's org limits) and a start-up
  stampede of hundreds of creates is the usual way to hit them.
- Failed creates are retried with exponential back-off and jitter only when the backend says the
  failure is transient (`Backend.is_retryable`); a bad image fails at once. A create that exceeds
  `create_timeout_s` is retried too: the provider may still make that sandbox, which the labels
  and TTL exist for.
- The pool stamps its labels (a run id by default) on every spec, so `sweep()` without arguments
  removes exactly what this run (or a crashed predecessor reusing its run id) created.
- Destroy errors never mask the episode's own exception; they are counted and logged, and the
  sandbox's TTL still bounds the leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Mapping, TypeVar

import msgspec

from miles.sandboxes.base import Backend, Sandbox, SandboxCreateError, SandboxSpec, check, labels_match

log = logging.getLogger("miles.sandboxes")
T = TypeVar("T")
RUN_LABEL = "miles.run"


class TokenBucket:
    """At most `burst` creations at once, refilled at `rate_per_s`. None means unlimited."""

    def __init__(self, rate_per_s: float | None, burst: int = 1):
        check(rate_per_s is None or rate_per_s > 0, "create_rate_per_s", rate_per_s,
              "a positive rate or None")
        check(burst >= 1, "create_burst", burst, ">= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._updated = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        if self.rate_per_s is None:
            return
        async with self._lock:  # FIFO: waiters are served in arrival order
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst,
                                   self._tokens + (now - self._updated) * self.rate_per_s)
                self._updated = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.rate_per_s)


class PoolStats(msgspec.Struct):
    live: int = 0
    created: int = 0
    destroyed: int = 0
    create_attempts: int = 0
    create_retries: int = 0
    create_failures: int = 0
    destroy_failures: int = 0
    create_s_total: float = 0.0


class SandboxPool:
    def __init__(self, backend: Backend, *, max_concurrent: int = 8,
                 create_rate_per_s: float | None = None, create_burst: int | None = None,
                 max_create_attempts: int = 5, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, create_timeout_s: float = 600.0,
                 labels: Mapping[str, str] | None = None, run_id: str | None = None):
        check(max_concurrent >= 1, "max_concurrent", max_concurrent, ">= 1")
        check(max_create_attempts >= 1, "max_create_attempts", max_create_attempts, ">= 1")
        check(0 < backoff_initial_s <= backoff_max_s, "backoff_initial_s", backoff_initial_s,
              f"in (0, backoff_max_s={backoff_max_s}]")
        check(create_timeout_s > 0, "create_timeout_s", create_timeout_s, "> 0")
        self.backend = backend
        self.max_concurrent = max_concurrent
        self.max_create_attempts = max_create_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.create_timeout_s = create_timeout_s
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.labels = {RUN_LABEL: self.run_id, **(labels or {})}
        SandboxSpec(labels=self.labels)  # validate the labels once, here
        self.stats = PoolStats()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._bucket = TokenBucket(create_rate_per_s,
                                   create_burst or max(1, int(create_rate_per_s or 1)))
        self._live: set[Sandbox] = set()

    def _backoff_s(self, attempt: int) -> float:
        # "Equal jitter": at least half the exponential step, so retries do spread out.
        step = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempt - 1))
        return step * random.uniform(0.5, 1.0)

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        spec = spec.with_labels(self.labels)
        for attempt in range(1, self.max_create_attempts + 1):
            await self._bucket.acquire()
            self.stats.create_attempts += 1
            started = time.monotonic()
            try:
                sandbox = await asyncio.wait_for(self.backend.create(spec), self.create_timeout_s)
            except asyncio.TimeoutError:
                exc: BaseException = SandboxCreateError(
                    f"{self.backend.name}: create took longer than create_timeout_s="
                    f"{self.create_timeout_s}", retryable=True)
                retryable = True
            except Exception as e:  # noqa: BLE001 - classified by the backend below
                exc, retryable = e, self.backend.is_retryable(e)
            else:
                self.stats.created += 1
                self.stats.create_s_total += time.monotonic() - started
                return sandbox
            if not retryable or attempt == self.max_create_attempts:
                self.stats.create_failures += 1
                if isinstance(exc, SandboxCreateError) or not retryable:
                    raise exc
                raise SandboxCreateError(f"{self.backend.name}: create failed after {attempt} "
                                         f"attempts: {exc!r}") from exc
            delay = self._backoff_s(attempt)
            self.stats.create_retries += 1
            log.warning("sandbox create failed (attempt %d/%d, retrying in %.2fs): %r",
                        attempt, self.max_create_attempts, delay, exc)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _destroy(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.destroy()
            self.stats.destroyed += 1
        except Exception as exc:  # noqa: BLE001 - see module docstring
            self.stats.destroy_failures += 1
            log.error("destroying sandbox %s failed (its TTL still applies): %r", sandbox.id,
                      exc)
        finally:
            self._live.discard(sandbox)
            self.stats.live = len(self._live)

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec | None = None, *,
                      own_slot: bool = True) -> AsyncIterator[Sandbox]:
        """A fresh sandbox for one episode, destroyed on exit whatever happens. `own_slot=False`
        is for a second sandbox of an episode that holds a slot already (a Harbor task's separate
        verifier): it takes none, as holders waiting for a second slot could deadlock the pool."""
        async with self._slots if own_slot else contextlib.nullcontext():
            sandbox = await self._create(spec or SandboxSpec())
            self._live.add(sandbox)
            self.stats.live = len(self._live)
            try:
                yield sandbox
            finally:
                await asyncio.shield(self._destroy(sandbox))

    async def run(self, spec: SandboxSpec | None,
                  episode: Callable[[Sandbox], Awaitable[T]]) -> T:
        async with self.sandbox(spec) as sandbox:
            return await episode(sandbox)

    async def sweep(self, labels: Mapping[str, str] | None = None) -> int:
        """Destroy sandboxes carrying `labels` (default: this pool's labels) and expired ones."""
        n = await self.backend.sweep(dict(labels or self.labels))
        if n:
            log.info("sweep removed %d sandbox(es) of backend %s", n, self.backend.name)
        return n

    async def sweep_counted(self) -> tuple[int, int]:
        """`sweep()`, counted apart: (this pool's labels, other runs' expired or orphaned ones).
        Backends that cannot list their sandboxes count everything as this pool's."""
        records = getattr(self.backend, "records", None)
        own = sum(labels_match(r.labels, self.labels) for r in records()) if records else None
        n = await self.sweep()
        return (n, 0) if own is None else (min(own, n), n - min(own, n))

    async def close(self) -> None:
        for sandbox in list(self._live):
            await self._destroy(sandbox)

    async def __aenter__(self) -> "SandboxPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
