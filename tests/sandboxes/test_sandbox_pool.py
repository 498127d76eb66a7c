"""SandboxPool: 200 real episodes with nothing left behind, the concurrency and rate limits, retry
with back-off, and sweeping what a SIGKILLed controller left."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from miles.sandboxes.base import (Backend, ExecResult, Sandbox, SandboxCreateError, SandboxSpec,
                                  SandboxSpecError)
from miles.sandboxes.pool import SandboxPool, TokenBucket
from sandbox_helpers import HOST_BACKENDS, leftover_entries, sandbox_processes, wait_until

pytestmark = pytest.mark.timeout(90)


async def test_200_episodes_leave_nothing_behind(host_backend, base_dir):
    pool = SandboxPool(host_backend, max_concurrent=8)
    peak_live = 0

    async def episode(sb: Sandbox) -> str:
        nonlocal peak_live
        peak_live = max(peak_live, pool.stats.live)
        await sb.upload("task/input.txt", sb.id.encode())
        r = await sb.exec("cat task/input.txt > answer.txt && cat answer.txt", timeout_s=20)
        assert r.ok, r
        assert await sb.download("answer.txt") == sb.id.encode()
        return r.stdout

    outs = await asyncio.gather(*(pool.run(SandboxSpec(ttl_s=120), episode)
                                  for _ in range(200)))
    assert len(set(outs)) == 200  # every episode had its own sandbox
    assert 1 < peak_live <= 8
    s = pool.stats
    assert (s.created, s.destroyed, s.live, s.create_failures, s.destroy_failures) == \
        (200, 200, 0, 0, 0)
    assert leftover_entries(base_dir) == []          # no directories, no records
    assert await wait_until(lambda: sandbox_processes(base_dir) == [], timeout_s=5)


class FlakyBackend(Backend):
    """Fails the first `fail_first` creates (retryable or not), tracks concurrency."""

    name = "flaky"

    def __init__(self, fail_first: int = 0, retryable: bool = True, create_s: float = 0.0):
        self.fail_first, self.retryable, self.create_s = fail_first, retryable, create_s
        self.calls: list[float] = []
        self.live = 0
        self.peak = 0

    async def create(self, spec):
        self.calls.append(time.monotonic())
        await asyncio.sleep(self.create_s)
        if len(self.calls) <= self.fail_first:
            raise SandboxCreateError("throttled (429)", retryable=self.retryable)
        backend = self

        class Box(Sandbox):
            backend_name = "flaky"

            async def _exec(self, argv, cwd, env, timeout_s):
                await asyncio.sleep(0.01)
                return ExecResult(0, "", "")

            async def _upload(self, path, data, mode): ...

            async def _download(self, path):
                return b""

            async def _destroy(self):
                backend.live -= 1

        self.live += 1
        self.peak = max(self.peak, self.live)
        return Box(f"f{len(self.calls)}", spec, workdir="/w")

    async def sweep(self, labels):
        return 0


async def test_retry_with_exponential_backoff():
    backend = FlakyBackend(fail_first=3)
    pool = SandboxPool(backend, backoff_initial_s=0.02, backoff_max_s=0.05)
    async with pool.sandbox() as sb:
        assert sb.spec.labels["miles.run"] == pool.run_id
    gaps = [b - a for a, b in zip(backend.calls, backend.calls[1:])]
    assert len(backend.calls) == 4 and pool.stats.create_retries == 3
    assert gaps[0] >= 0.01 and gaps[1] >= 0.02 and gaps[2] >= 0.025  # 0.02, 0.04, capped 0.05
    assert all(g <= 0.2 for g in gaps)


async def test_non_retryable_and_exhausted_creates_fail():
    pool = SandboxPool(FlakyBackend(fail_first=1, retryable=False), backoff_initial_s=0.01)
    with pytest.raises(SandboxCreateError, match="429"):
        async with pool.sandbox():
            pass
    assert pool.stats.create_attempts == 1 and pool.stats.create_failures == 1
    pool = SandboxPool(FlakyBackend(fail_first=10), max_create_attempts=3,
                       backoff_initial_s=0.01, backoff_max_s=0.01)
    with pytest.raises(SandboxCreateError):
        async with pool.sandbox():
            pass
    assert pool.stats.create_attempts == 3


async def test_concurrency_and_rate_limits():
    backend = FlakyBackend(create_s=0.005)
    pool = SandboxPool(backend, max_concurrent=3, create_rate_per_s=50, create_burst=1)

    async def episode(sb):
        await sb.exec("true")
        await asyncio.sleep(0.02)

    started = time.monotonic()
    await asyncio.gather(*(pool.run(None, episode) for _ in range(20)))
    assert backend.peak <= 3 and backend.live == 0
    assert time.monotonic() - started >= 19 / 50 * 0.95  # paced by the token bucket


async def test_rate_limiter_burst():
    bucket = TokenBucket(10, burst=5)
    started = time.monotonic()
    for _ in range(5):
        await bucket.acquire()
    assert time.monotonic() - started < 0.05
    await bucket.acquire()
    assert time.monotonic() - started >= 0.08


async def test_sandbox_destroyed_when_episode_fails_or_is_cancelled():
    backend = FlakyBackend()
    pool = SandboxPool(backend)
    with pytest.raises(RuntimeError):
        async with pool.sandbox():
            raise RuntimeError("agent crashed")
    task = asyncio.create_task(pool.run(None, lambda sb: asyncio.sleep(10)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.live == 0 and pool.stats.live == 0


async def test_sweep_needs_labels(host_backend):
    with pytest.raises(SandboxSpecError, match="sweep"):
        await host_backend.sweep({})


CHILD = textwrap.dedent("""
    import asyncio, sys
    from miles.sandboxes import get_backend, SandboxSpec
    async def main():
        backend = get_backend(sys.argv[1], base_dir=sys.argv[2])
        boxes = [await backend.create(SandboxSpec(labels={"miles.run": sys.argv[3]},
                                                  ttl_s=600)) for _ in range(3)]
        for sb in boxes:
            await sb.upload("/workspace/state.txt", b"mid-episode")
        tasks = [asyncio.create_task(sb.exec("sleep 60", timeout_s=120)) for sb in boxes]
        await asyncio.sleep(0.5)
        print("ready", flush=True)
        await asyncio.sleep(120)
    asyncio.run(main())
""")


@pytest.mark.parametrize("backend_name", HOST_BACKENDS)
async def test_sweep_after_controller_is_killed(backend_name, base_dir):
    from sandbox_helpers import make_host_backend
    backend = make_host_backend(backend_name, base_dir)
    run_id = f"crash-{os.getpid()}-{backend_name}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, backend_name, base_dir, run_id],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "ready"
        records = backend.records()
        assert len(records) == 3
        assert len(sandbox_processes(base_dir)) >= 3  # reapers and the running commands
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # The controller is gone; its sandboxes' directories, records and reapers are still here.
    assert len(leftover_entries(base_dir)) == 6
    assert any("miles-reaper" in " ".join(p.cmdline()) for p in sandbox_processes(base_dir))
    other = await backend.create(SandboxSpec(labels={"miles.run": "someone-else"}, ttl_s=60))
    # The next run's start-up sweep removes exactly what carried the crashed run's labels.
    pool = SandboxPool(backend, run_id=run_id)
    assert await pool.sweep() == 3
    assert leftover_entries(base_dir) == sorted([other.id, other.id + ".json"])
    await other.destroy()
    assert leftover_entries(base_dir) == []
    assert await wait_until(lambda: sandbox_processes(base_dir) == [], timeout_s=5)


async def test_ttl_reaper_kills_a_lost_sandbox(host_backend, base_dir):
    sb = await host_backend.create(SandboxSpec(ttl_s=1))
    # Nobody calls destroy: the reaper must clean up on its own once the TTL passes.
    hold = asyncio.create_task(sb.exec("sleep 30", timeout_s=30))
    r = await hold
    assert r.timed_out  # the exec's deadline was clipped to the sandbox's TTL
    assert await wait_until(lambda: leftover_entries(base_dir) == [], timeout_s=6)
    assert await wait_until(lambda: sandbox_processes(base_dir) == [], timeout_s=3)
    await sb.destroy()  # still safe afterwards
