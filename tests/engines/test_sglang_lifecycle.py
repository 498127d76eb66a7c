"""Launcher lifecycle with stand-in commands (SGLang itself needs a GPU): health wait, early
death with the log tail, timeout, SIGTERM then SIGKILL, the whole process tree, parent death.

The stand-in for `python -m sglang.launch_server` is the embedded engine, which accepts the
flags the launcher sets for a single-rank engine and serves the same `/health`."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time

import aiohttp
import psutil
import pytest

from miles.engines.procs import ServerProcess, ServerStartError, free_port
from miles.engines.sglang import SGLangServer, SGLangServerArgs, launch_sglang

EMBEDDED = [sys.executable, "-m", "miles.engines.embedded"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_launch_waits_for_health_and_stops_cleanly(tiny_qwen3, tmp_path):
    args = SGLangServerArgs(model_path=str(tiny_qwen3), port=free_port(), weight_version="v7",
                            extra_args={"torch_threads": 1, "random_seed": 0})
    server = await launch_sglang(args, launcher=EMBEDDED, log_path=tmp_path / "engine.log",
                                 timeout_s=120)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/model_info") as resp:
                assert (await resp.json())["weight_version"] == "v7"
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}
            async with session.post(server.url + "/generate", json=body) as resp:
                assert len((await resp.json())["output_ids"]) == 3
        assert server.command[:3] == EMBEDDED and "--torch-threads" in server.command
    finally:
        pid = server.process.pid
        # SIGTERM was enough: a clean exit, not the SIGKILL fallback.
        assert server.stop(grace_s=10) in (0, -signal.SIGTERM)
    assert _gone(pid)


async def test_death_before_healthy_reports_exit_code_and_log_tail():
    # A stand-in that dies the way SGLang does on a bad GPU setup.
    dies = "import sys; print('RuntimeError: CUDA out of memory', flush=True); sys.exit(3)"
    args = SGLangServerArgs(model_path="m", port=free_port())
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        await launch_sglang(args, launcher=[sys.executable, "-c", dies], timeout_s=120)
    assert time.monotonic() - started < 30, "a dead server must fail fast, not at the timeout"


async def test_never_healthy_times_out_and_is_stopped():
    # A stand-in that ignores its flags and never opens the port.
    server = SGLangServer(SGLangServerArgs(model_path="m", port=free_port()),
                          launcher=[sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(ServerStartError, match=r"not healthy at .*/health after timeout_s=1"):
        try:
            await server.start().wait_ready(timeout_s=1)
        finally:
            pid = server.process.pid
            server.stop(grace_s=2)
    assert _gone(pid)


STUBBORN_TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    in_group = subprocess.Popen([sys.executable, "-c", sleeper])
    own_session = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
    print(in_group.pid, own_session.pid, flush=True)
    time.sleep(600)
""")


async def test_stop_escalates_to_sigkill_for_the_whole_tree(tmp_path):
    log = tmp_path / "tree.log"
    server = ServerProcess("stubborn", [sys.executable, "-c", STUBBORN_TREE], log_path=log).start()
    for _ in range(100):
        if log.read_text().strip():
            break
        await asyncio.sleep(0.1)
    children = [int(p) for p in log.read_text().split()]
    pids = [server.pid, *children]
    assert all(psutil.pid_exists(p) for p in pids)
    started = time.monotonic()
    assert server.stop(grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    assert not server.alive
    server.stop()  # idempotent


PARENT = textwrap.dedent("""
    import sys, time
    from miles.engines.procs import ServerProcess
    child = ServerProcess("orphan-candidate", [sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.start().pid, flush=True)
    time.sleep(600)
""")


async def test_child_dies_with_a_sigkilled_parent():
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", PARENT,
                                                  stdout=asyncio.subprocess.PIPE)
    child_pid = int(await asyncio.wait_for(parent.stdout.readline(), timeout=30))
    assert psutil.pid_exists(child_pid)
    parent.kill()
    await parent.wait()
    for _ in range(50):
        if _gone(child_pid):
            break
        await asyncio.sleep(0.1)
    assert _gone(child_pid), "the server outlived its SIGKILLed parent"


async def test_the_child_sees_the_logprob_switch_off(monkeypatch):
    """The real child process's environment, not just the launcher's dict."""
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    show = ("import os, sys; print('SWITCH=' + os.environ['SGLANG_RETURN_ORIGINAL_LOGPROB'], "
            "flush=True); sys.exit(3)")
    with pytest.raises(ServerStartError, match=r"SWITCH=false"):
        await launch_sglang(SGLangServerArgs(model_path="m", port=free_port()),
                            launcher=[sys.executable, "-c", show], timeout_s=60)
