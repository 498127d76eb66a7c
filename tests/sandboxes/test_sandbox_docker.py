"""The docker backend against a real daemon (skipped, with the reason, when none answers): isolation,
limits, timeouts inside the container, a pool run with nothing left, sweep after a SIGKILLed
controller, TTL, and the Harbor task built from its Dockerfile on an offline base image."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import msgspec
import psutil
import pytest

from miles.sandboxes.base import SandboxSpec
from miles.sandboxes.docker import DockerBackend
from miles.sandboxes.harbor import load_task, run_verifier, task_spec
from miles.sandboxes.pool import SandboxPool
from sandbox_helpers import wait_until

pytestmark = pytest.mark.timeout(120)
TASKS = os.path.join(os.path.dirname(__file__), "tasks")


@pytest.fixture
async def docker():
    backend = DockerBackend(fallback_base_image="host")
    if not await backend.available():
        await backend.close()
        pytest.skip(f"no Docker daemon answers at {backend.api.socket} (install docker.io and "
                    "start dockerd to run these)")
    from miles.sandboxes.baseimage import ensure_base_image
    backend.base_image = await ensure_base_image(backend.api)
    yield backend
    await backend.close()


def spec(docker, **kw) -> SandboxSpec:
    return SandboxSpec(image=docker.base_image, ttl_s=kw.pop("ttl_s", 120), **kw)


def host_processes_with(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(
                    p.info["cmdline"] or []):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


async def test_exec_files_network_and_separation(docker, loopback_server):
    async with await docker.create(spec(docker, env={"A": "1"})) as a, \
            await docker.create(spec(docker)) as b:
        r = await a.exec("echo $A $B; pwd; exit 4", env={"B": "2"})
        assert (r.exit_code, r.stdout) == (4, "1 2\n/workspace\n")
        await a.upload_dir("/tests", {"test.sh": b"echo ok", "sub/x.txt": b"x"})
        await a.upload("/workspace/secret.txt", b"episode-a-secret")
        assert await a.download("/tests/sub/x.txt") == b"x"
        with pytest.raises(FileNotFoundError):
            await a.download("/nope")
        r = await b.exec("find / -xdev -name secret.txt 2>/dev/null; cat /proc/*/root/workspace/"
                         "secret.txt 2>/dev/null; echo done")
        assert r.stdout == "done\n"
        probe = ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
                 f"{loopback_server}), timeout=2); print('connected')\"")
        r = await a.exec(probe, timeout_s=15)
        assert r.exit_code != 0 and "connected" not in r.stdout and not r.timed_out


async def test_limits_and_timeout_inside_the_container(docker):
    marker = f"spin-{uuid.uuid4().hex[:8]}"
    async with await docker.create(spec(docker, memory_mb=64, max_processes=24)) as sb:
        hog = await sb.exec("python3 -c 'x = bytearray(512 << 20); print(1)'", timeout_s=30)
        assert hog.exit_code == 137 and not hog.timed_out  # OOM-killed, not timed out
        busy = f"python3 -c 'while True: pass' {marker}"
        task = asyncio.create_task(sb.exec(f"{busy} & {busy} & sleep 30 & wait", timeout_s=1.0))
        # Host view: timeout, sh and the two spinners all carry the marker in their command line.
        assert await wait_until(lambda: len(host_processes_with(marker)) >= 4, timeout_s=10)
        r = await task
        assert r.timed_out and r.exit_code in (124, 137), r
        assert await wait_until(lambda: host_processes_with(marker) == [], timeout_s=3)
        bomb = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=1.5)
        assert "fork" in bomb.stderr.lower() or "resource" in bomb.stderr.lower(), bomb
        assert (await sb.exec("echo alive")).stdout == "alive\n"


@pytest.mark.parametrize("episodes", [
    12, pytest.param(200, marks=[pytest.mark.slow, pytest.mark.skipif(
        not os.environ.get("MILES_SANDBOX_FULL"),
        reason="200 containers take ~45 s here; set MILES_SANDBOX_FULL=1 to run")])])
async def test_pool_leaves_no_containers(docker, episodes):
    pool = SandboxPool(docker, max_concurrent=8)

    async def episode(sb):
        await sb.upload("in.txt", sb.id.encode())
        r = await sb.exec("cat in.txt")
        assert r.ok and r.stdout == sb.id

    await asyncio.gather(*(pool.run(spec(docker), episode) for _ in range(episodes)))
    assert pool.stats.created == pool.stats.destroyed == episodes
    assert await docker.live_ids({"miles.run": pool.run_id}) == []
    # No container process outlives its container: each ran `docker-init -- sleep 121`.
    assert await wait_until(lambda: host_processes_with("sleep 121") == [], timeout_s=5)


CHILD = textwrap.dedent("""
    import asyncio, sys
    from miles.sandboxes.docker import DockerBackend
    from miles.sandboxes.base import SandboxSpec
    async def main():
        backend = DockerBackend()
        for _ in range(2):
            sb = await backend.create(SandboxSpec(image=sys.argv[1], ttl_s=600,
                                                  labels={"miles.run": sys.argv[2]}))
            asyncio.create_task(sb.exec("sleep 60", timeout_s=100))
        print("ready", flush=True)
        await asyncio.sleep(120)
    asyncio.run(main())
""")


async def test_sweep_after_controller_is_killed_and_ttl(docker):
    run_id = f"crash-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, docker.base_image, run_id],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line.strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert len(await docker.live_ids({"miles.run": run_id})) == 2  # containers outlive it
    assert await SandboxPool(docker, run_id=run_id).sweep() == 2
    assert await docker.live_ids({"miles.run": run_id}) == []
    # A lost container dies on its own at its TTL (its only process is `sleep ttl_s`).
    lost = await docker.create(spec(docker, ttl_s=1, labels={"miles.run": run_id}))
    assert await docker.live_ids({"miles.run": run_id}) == [lost.id]

    async def gone():
        return await docker.live_ids({"miles.run": run_id}) == []
    for _ in range(40):
        if await gone():
            break
        await asyncio.sleep(0.25)
    assert await gone()


async def test_harbor_task_on_docker(docker):
    task = load_task(os.path.join(TASKS, "hello-sum"))
    async with await docker.create(task_spec(task)) as sb:
        assert sb.workdir == "/app"
        await sb.exec("read -r a b < input.txt && echo $((a + b)) > answer.txt")
        right = await run_verifier(sb, task)
        await sb.exec("echo 41 > answer.txt")
        wrong = await run_verifier(sb, task)
    assert (right.status, right.reward) == ("ok", 1.0), right
    assert (wrong.status, wrong.reward) == ("ok", 0.0), wrong
    # [verifier] user: test.sh runs as that user (docker exec --user), the set-up as the image's
    as_nobody = msgspec.structs.replace(task, verifier_user="65534")
    async with await docker.create(task_spec(task)) as sb:
        assert (await sb.exec("id -u", user="65534")).stdout == "65534\n"
        await sb.exec("read -r a b < input.txt && echo $((a + b)) > answer.txt")
        # bash sources $BASH_ENV as test.sh starts: uid.txt is the uid test.sh ran as
        await sb.upload("/tests-extra/whoami.sh", b"id -u > /logs/verifier/uid.txt\n")
        result = await run_verifier(sb, msgspec.structs.replace(
            as_nobody, verifier_env={**task.verifier_env, "BASH_ENV": "/tests-extra/whoami.sh"}))
        assert (result.status, result.reward) == ("ok", 1.0), result
        assert await sb.download("/logs/verifier/uid.txt") == b"65534\n"
    slow = load_task(os.path.join(TASKS, "slow-verifier"))
    async with await docker.create(task_spec(slow)) as sb:
        result = await run_verifier(sb, slow)
    assert (result.status, result.reward) == ("timeout", None), result
