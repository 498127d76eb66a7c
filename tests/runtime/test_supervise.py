"""The one supervised-process helper (miles.supervise) and the Slurm host-list parser: real
processes, their groups, deadlines and logs."""

import asyncio
import os
import sys
import time

import psutil
import pytest

from miles.node import expand_nodelist, parse_nodelist
from miles.supervise import MAX_PIECE_BYTES, LogFollower, ProcessFailed, SupervisedProcess, run_command


@pytest.mark.parametrize("nodelist, hosts", [
    ("a,b", ["a", "b"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("rack1-[01-02]-gpu[3-4]", ["rack1-01-gpu3", "rack1-01-gpu4", "rack1-02-gpu3", "rack1-02-gpu4"]),
    ("n[1-2],m[5-6]", ["n1", "n2", "m5", "m6"]),
    ("head", ["head"]),
])
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


def test_parse_nodelist_names_a_bad_range():
    with pytest.raises(ValueError, match=r"host list 'n\[1-x\]': bad range '1-x'"):
        parse_nodelist("n[1-x]")


def test_expand_nodelist_asks_scontrol_when_it_is_installed(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "from-scontrol-1\\nfrom-scontrol-2\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert expand_nodelist("x[1-2]") == ["from-scontrol-1", "from-scontrol-2"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert expand_nodelist("x[1-2]") == ["x1", "x2"]


def test_log_follower_has_no_line_limit_and_flushes_long_partial_lines(tmp_path):
    log = tmp_path / "a.log"
    log.write_bytes(b"old run\n")
    got = []
    follower = LogFollower(log, b"[a] ", got.append)  # starts at the end: old runs are not replayed
    with open(log, "ab") as f:
        f.write(b"short\n" + b"x" * (MAX_PIECE_BYTES + 10))  # a long line, not finished yet
        f.flush()
        follower.pump()
        assert b"".join(got) == b"[a] short\n[a] " + b"x" * MAX_PIECE_BYTES + b"\n"
        f.write(b"y" * 3_000_000 + b"\ntail without newline")
        f.flush()
        follower.pump()
        follower.pump(flush_partial=True)
    out = b"".join(got).split(b"\n")
    assert all(len(line) <= MAX_PIECE_BYTES + 4 for line in out)
    assert all(line.startswith(b"[a] ") for line in out if line)
    body = b"".join(line[4:] for line in out[1:-2])
    assert body == b"x" * (MAX_PIECE_BYTES + 10) + b"y" * 3_000_000
    assert out[-2] == b"[a] tail without newline"


async def test_run_command_captures_output_and_exit_code(tmp_path):
    res = await run_command("eval.command", [sys.executable, "-c", "print('hi'); print('{\"acc\": 1}')"],
                            timeout_s=30, log_path=tmp_path / "eval.log")
    assert res.exit_code == 0 and res.output.splitlines() == ["hi", '{"acc": 1}']
    bad = await run_command("eval.command", [sys.executable, "-c", "import sys; print('boom'); sys.exit(4)"],
                            timeout_s=30, log_path=tmp_path / "eval.log")
    assert bad.output == "boom\n"  # this run's output only, though the log is shared
    with pytest.raises(ProcessFailed, match=r"(?s)eval.command exited with code 4.*boom"):
        bad.check("eval.command")


def _sleeper_with_a_grandchild(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pidfile}; echo started; wait"
    return ["/bin/sh", "-c", script], pidfile


def _wait_for(path, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(path.read_text())


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_run_command_timeout_kills_the_whole_group_and_names_the_wait(tmp_path):
    argv, pidfile = _sleeper_with_a_grandchild(tmp_path)
    started = time.monotonic()
    with pytest.raises(ProcessFailed, match=r"(?s)eval.command \(pid \d+\) still running after "
                                            r"timeout_s=1.0 \(waited for it to finish\).*started"):
        await run_command("eval.command", argv, timeout_s=1.0, log_path=tmp_path / "e.log")
    assert time.monotonic() - started < 10
    assert _gone(_wait_for(pidfile))


async def test_a_cancelled_run_command_kills_the_whole_group(tmp_path):
    argv, pidfile = _sleeper_with_a_grandchild(tmp_path)
    task = asyncio.create_task(run_command("eval.command", argv, timeout_s=300,
                                           log_path=tmp_path / "e.log"))
    grandchild = await asyncio.to_thread(_wait_for, pidfile)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _gone(grandchild)


async def test_wait_returns_the_exit_code_without_polling_threads(tmp_path):
    proc = SupervisedProcess("quick", [sys.executable, "-c", "import sys; sys.exit(7)"],
                             log_path=tmp_path / "q.log").start()
    assert await proc.wait(timeout_s=30) == 7
    assert proc.log_tail() == "(log is empty)"
