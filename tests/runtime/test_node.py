"""Node daemons as real processes on loopback: placement across two simulated nodes, bulk streams,
crash recovery, and shutdown without orphans."""

import json
import os
import signal
import time

import psutil
import pytest

TWO_NODES = '''
[run]
name = "t"
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
heartbeat_interval_s = 0.5
shutdown_grace_s = 3
[actors.driver]
class = "miles.demo:DemoDriver"
node = 1
main = true
options = { samples = 5462, tokens = 8192, batch = 64, retries = 2 }
[actors.sink]
class = "miles.demo:Sink"
node = 0
'''


def _wait(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.wait(max(0.1, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def _result(log):
    lines = [json.loads(l.split("] ", 1)[1]) for l in log.read_text().splitlines()
             if l.startswith("[driver] {")]
    return lines


def _tree(pid):
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def test_two_nodes_call_and_stream_256mb_intact(node_launcher):
    procs, _, logs = node_launcher(TWO_NODES, nnodes=2)
    seen = [set() for _ in procs]   # every child seen under each daemon (one may finish early)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(seen):
        for s, p in zip(seen, procs):
            s |= _tree(p.pid)
        time.sleep(0.05)
    children = set().union(*seen)
    assert all(seen), seen  # one actor process per node at least
    codes = _wait(procs, 120)
    text = logs[1].read_text()
    assert codes == [0, 0], text + logs[0].read_text()
    (result,) = _result(logs[1])
    assert result["demo"] == "ok" and result["checksum"] == result["expected"]
    assert result["samples"] == 5462 and result["MB"] >= 256
    assert not any(psutil.pid_exists(pid) for pid in children)


def test_kill_9_mid_stream_restarts_the_actor_and_the_caller_retries(node_launcher):
    recipe = TWO_NODES.replace("[actors.sink]\n", "[actors.sink]\noptions = { delay_s = 0.05 }\n")
    recipe = recipe.replace("samples = 5462, tokens = 8192", "samples = 4096, tokens = 1024")
    procs, port, logs = node_launcher(recipe, nnodes=2)
    deadline = time.monotonic() + 30
    sink_pid = None
    while time.monotonic() < deadline and sink_pid is None:
        for line in logs[0].read_text().splitlines():
            pass
        for c in psutil.Process(procs[0].pid).children(recursive=True):
            try:
                if c.environ().get("MILES_ACTOR_NAME") == "sink":
                    sink_pid = c.pid
            except psutil.Error:
                pass
        time.sleep(0.2)
    assert sink_pid, logs[0].read_text()
    time.sleep(2.5)  # the stream is under way (200 calls + a slow sink)
    os.kill(sink_pid, signal.SIGKILL)
    codes = _wait(procs, 120)
    log0, log1 = logs[0].read_text(), logs[1].read_text()
    assert codes == [0, 0], log0 + log1
    assert "sink exited with -9; restarting" in log0
    died, ok = _result(logs[1])
    assert died["demo"] == "sink died" and "died" in died["error"]
    assert ok["demo"] == "ok" and ok["retries"] == 1 and ok["samples"] == 4096
    assert not psutil.pid_exists(sink_pid)


def test_sigterm_and_sigkill_of_daemons_leave_no_orphans(node_launcher):
    recipe = TWO_NODES.replace("main = true\n", "main = true\n").replace(
        "samples = 5462, tokens = 8192", "samples = 100000, tokens = 64").replace(
        "[actors.sink]\n", "[actors.sink]\noptions = { delay_s = 1.0 }\n")
    procs, _, logs = node_launcher(recipe, nnodes=2)
    deadline = time.monotonic() + 60   # a loaded machine takes longer than 3 s to start the actors
    while not all(trees := [_tree(p.pid) for p in procs]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(trees), "actors not started within 60 s:\n" + logs[0].read_text() + logs[1].read_text()
    time.sleep(1.0)   # the actors' own children (started after the actor itself)
    trees = [_tree(p.pid) for p in procs]
    procs[0].send_signal(signal.SIGTERM)       # graceful on the head
    os.kill(procs[1].pid, signal.SIGKILL)      # brutal on node 1: children must die with it
    _wait(procs, 30)
    time.sleep(1.0)
    leftovers = [pid for pid in set().union(*trees) if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []
    assert "shutting down: signal SIGTERM" in logs[0].read_text()


def test_user_actor_subclass_loaded_from_import_path(node_launcher):
    recipe = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
[actors.driver]
class = "user_actors:GreetingDriver"
main = true
[actors.sink]
class = "user_actors:PoliteSink"
'''
    procs, _, logs = node_launcher(recipe)
    assert _wait(procs, 60) == [0], logs[0].read_text()
    assert "GREETING: hello driver from sink" in logs[0].read_text()


def test_bad_actor_class_is_reported_and_the_job_fails(node_launcher):
    recipe = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
[actors.driver]
class = "no_such_module:Driver"
main = true
'''
    procs, _, logs = node_launcher(recipe)
    codes = _wait(procs, 60)
    assert codes[0] != 0
    assert "cannot import module 'no_such_module'" in logs[0].read_text()


def test_a_process_group_port_in_the_ephemeral_range_is_warned_about_once():
    """MASTER_PORT = head_port + 10 + role index; inside the kernel's ephemeral range any outgoing
    connection may hold it when rank 0 binds it (EADDRINUSE), so the daemon says so."""
    from types import SimpleNamespace

    from miles.node import NodeDaemon, ephemeral_port_range

    low, high = ephemeral_port_range()
    lines: list[str] = []
    child = lambda port: SimpleNamespace(env={"MASTER_PORT": str(port)})  # noqa: E731
    fake = SimpleNamespace(children=[child(low + 10), child(low + 10), SimpleNamespace(env={})],
                           _log=lines.append)
    NodeDaemon._warn_ephemeral_master_ports(fake)
    assert len(lines) == 1 and f"[{low + 10}]" in lines[0] and f"below {low - 64}" in lines[0], lines
    fake.children = [child(low - 100)]
    NodeDaemon._warn_ephemeral_master_ports(fake)
    assert len(lines) == 1, lines
