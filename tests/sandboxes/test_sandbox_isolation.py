"""Isolation of the host backends (subprocess, bwrap), with real processes: exec semantics, no
network, no view of another episode, memory limit, timeout kills the whole tree, fork bomb."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from miles.sandboxes.base import SandboxClosedError, SandboxError, SandboxSpec, SandboxSpecError
from sandbox_helpers import needs_jail, processes_of_uid, wait_until

pytestmark = pytest.mark.timeout(60)


async def test_exec_files_and_env(host_backend):
    needs_jail(host_backend)
    spec = SandboxSpec(env={"GREETING": "hi"}, workdir="/app", ttl_s=60)
    async with await host_backend.create(spec) as sb:
        r = await sb.exec("echo $GREETING $EXTRA; pwd; echo oops >&2; exit 3",
                          env={"EXTRA": "there"}, timeout_s=10)
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "hi there\n/app\n",
                                                                   "oops\n", False)
        await sb.upload("/logs/verifier/in.txt", b"payload")
        await sb.upload("notes/rel.txt", b"relative to workdir")
        r = await sb.exec("cat /logs/verifier/in.txt; cat /app/notes/rel.txt; "
                          "mkdir -p /out && echo made > /out/f", cwd="/logs")
        assert r.ok and r.stdout == "payloadrelative to workdir", r
        assert await sb.download("/out/f") == b"made\n"
        r = await sb.exec(["printf", "%s|", "a b", "c"])
        assert r.stdout == "a b|c|"
        with pytest.raises(FileNotFoundError):
            await sb.download("/nope.txt")
        with pytest.raises(SandboxSpecError, match="timeout_s"):
            await sb.exec("true", timeout_s=-1)
        with pytest.raises(SandboxSpecError, match="/usr/x"):
            await sb.upload("/usr/x", b"")
        big = await sb.exec("head -c 3000000 /dev/zero | tr '\\0' a")
        assert big.truncated and len(big.stdout) == host_backend.max_output_bytes
    with pytest.raises(SandboxClosedError):
        await sb.exec("true")


async def test_symlinks_planted_by_the_sandbox_are_never_followed(host_backend):
    needs_jail(host_backend)
    async with await host_backend.create(SandboxSpec(ttl_s=60)) as sb:
        r = await sb.exec("mkdir -p /logs && ln -s /etc/hostname /logs/reward.txt && "
                          "ln -s / /escape")
        assert r.ok, r
        with pytest.raises(SandboxError, match="symlink"):
            await sb.download("/logs/reward.txt")
        with pytest.raises(SandboxError, match="symlink"):
            await sb.upload("/escape/tmp/owned", b"x")
        assert not os.path.exists("/tmp/owned")


async def test_no_network_even_to_host_loopback(host_backend, loopback_server):
    socket.create_connection(("127.0.0.1", loopback_server), timeout=2).close()  # host: reachable
    probe = ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
             f"{loopback_server}), timeout=2); print('connected')\"")
    async with await host_backend.create(SandboxSpec(ttl_s=60)) as sb:
        r = await sb.exec(probe, timeout_s=10)
    assert r.exit_code != 0 and "connected" not in r.stdout
    assert "Error" in r.stderr  # ConnectionRefused / NetworkUnreachable, never a timeout
    assert not r.timed_out


async def test_no_view_of_another_episode(host_backend):
    needs_jail(host_backend)
    spec = SandboxSpec(ttl_s=60)
    async with await host_backend.create(spec) as a, await host_backend.create(spec) as b:
        await a.upload("/workspace/secret.txt", b"episode-a-secret")
        # Keep a process alive in A, so B can also try A's files through /proc/<pid>/root.
        holder = asyncio.create_task(a.exec("sleep 3", timeout_s=10))
        await asyncio.sleep(0.3)
        probe = (f"cat {a.root}/workspace/secret.txt; ls {a.backend.base_dir}; "
                 "cat /proc/*/root/workspace/secret.txt; "
                 "find / -xdev -name secret.txt 2>/dev/null; echo done")
        r = await b.exec(probe, timeout_s=20)
        holder.cancel()
        assert "episode-a-secret" not in r.stdout and "secret.txt" not in r.stdout, r
        assert r.stdout.rstrip().endswith("done")


async def test_memory_limit_stops_a_hog(host_backend):
    async with await host_backend.create(SandboxSpec(memory_mb=200, ttl_s=60)) as sb:
        r = await sb.exec("python3 -c \"x = bytearray(1 << 30); print('allocated')\"",
                          timeout_s=20)
        small = await sb.exec("python3 -c \"x = bytearray(32 << 20); print('fine')\"")
    assert r.exit_code != 0 and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr
    assert small.ok and small.stdout == "fine\n"


async def test_timeout_kills_the_whole_process_tree(host_backend):
    if not host_backend.privileged:
        pytest.skip("needs root: processes are found by the sandbox's own uid")
    busy = "python3 -c 'while True: pass'"
    async with await host_backend.create(SandboxSpec(ttl_s=60)) as sb:
        started = time.monotonic()
        task = asyncio.create_task(sb.exec(f"{busy} & {busy} & sleep 30 & wait", timeout_s=1.0))
        assert await wait_until(lambda: len(processes_of_uid(sb.uid)) >= 4, timeout_s=5)
        tree = processes_of_uid(sb.uid)
        r = await task
        elapsed = time.monotonic() - started
        assert r.timed_out and r.exit_code in (124, 137), r
        assert elapsed < 1.0 + host_backend.kill_after_s + 2
        assert await wait_until(lambda: not any(p.is_running() and p.status() != "zombie"
                                                for p in tree), timeout_s=3)
        assert processes_of_uid(sb.uid) == []


async def test_fork_bomb_is_contained(host_backend):
    if not host_backend.privileged:
        pytest.skip("needs root: RLIMIT_NPROC must count a sandbox uid of its own")
    limit = 24
    spec = SandboxSpec(max_processes=limit, memory_mb=256, ttl_s=60)
    async with await host_backend.create(spec) as sb:
        task = asyncio.create_task(sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2",
                                           timeout_s=1.2))
        peak = 0
        while not task.done():
            peak = max(peak, len(processes_of_uid(sb.uid)))
            await asyncio.sleep(0.05)
        r = await task
        # It forked until the kernel refused ("Cannot fork"), and never beyond the limit.
        assert "Cannot fork" in r.stderr and peak <= limit, (peak, r)
    assert processes_of_uid(sb.uid) == []
