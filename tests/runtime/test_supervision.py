"""The node daemon's supervision rules as real processes: no line is too long for a child's output,
start failures and crash loops end the job within seconds with one message and the log tail, a
hung actor is named when it is killed, Ctrl-C ends with one line saying where to resume."""

import json
import os
import re
import signal
import time

import pytest

HEAD = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
heartbeat_interval_s = 0.5
liveness_timeout_s = 3
shutdown_grace_s = 3
'''


def _finish(proc, log, timeout_s):
    try:
        proc.wait(timeout_s)
    except Exception:
        raise AssertionError(f"still running after {timeout_s}s:\n{log.read_text()[-4000:]}")
    return proc.returncode, log.read_text(errors="replace")


def test_a_1mb_line_reaches_the_log_file_whole_and_the_child_stays_alive(node_launcher, tmp_path):
    recipe = HEAD + '''
[actors.driver]
class = "supervision_actors:LongLineDriver"
main = true
options = { stay_s = 5.0 }
'''
    (proc,), _, (log,) = node_launcher(recipe)
    code, text = _finish(proc, log, 60)
    assert code == 0, text[-3000:]
    assert "[driver] still alive after the long line" in text  # not killed for missed heartbeats
    lines = (tmp_path / "run" / "logs" / "driver.log").read_text().splitlines()
    assert "A" * 1_000_000 + "|end" in lines
    console = [line for line in text.splitlines() if line.startswith("[driver] A")]
    assert sum(len(line) - len("[driver] ") for line in console) == 1_000_000 + len("|end")
    assert max(len(line) for line in console) <= 64 * 1024 + len("[driver] ")


@pytest.mark.parametrize("cls, cause", [
    ("supervision_actors:FailsOnStart", "RuntimeError: the reward module is missing"),
    ("child_only_import_error:Sink", "No module named 'no_such_module_in_actor_processes'"),
])
def test_a_start_failure_ends_the_job_in_seconds_with_one_message(node_launcher, cls, cause):
    recipe = HEAD + f'''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.sink]
class = "{cls}"
'''
    started = time.monotonic()
    (proc,), _, (log,) = node_launcher(recipe)
    code, text = _finish(proc, log, 60)
    assert code == 1, text[-3000:]
    assert time.monotonic() - started < 30, text[-3000:]
    failed = [line for line in text.splitlines() if "actor sink failed:" in line]
    assert len(failed) == 1, text[-3000:]
    assert "before it registered" in failed[0] and cause in failed[0]
    assert "a crash loop: not restarted" in failed[0]
    assert "last lines of its log" in failed[0]
    assert text.count("sink exited with 1; restarting") == 1  # one retry, not a loop
    assert "[driver] Traceback" not in text and "[driver] error" not in text  # stopped quietly


def test_an_actor_out_of_restarts_ends_the_job(node_launcher):
    recipe = HEAD + '''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.sink]
class = "supervision_actors:CrashesLater"
restart = { max_restarts = 1, backoff_s = 0.1 }
'''
    (proc,), _, (log,) = node_launcher(recipe)
    code, text = _finish(proc, log, 60)
    assert code == 1, text[-3000:]
    assert "sink exited with 10; restarting" in text      # different exits: not a crash loop
    (failed,) = [line for line in text.splitlines() if "actor sink failed:" in line]
    assert "incarnation 1 exited with code 11" in failed
    assert "restart budget (restart.max_restarts = 1) used up" in failed
    assert "crashing, incarnation 1" in text.split(failed, 1)[1]  # the log tail


def test_a_frozen_actor_is_killed_naming_its_incarnation_heartbeat_age_and_log(node_launcher):
    recipe = HEAD + '''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.freezer]
class = "supervision_actors:Freezes"
restart = { max_restarts = 0 }
'''
    (proc,), _, (log,) = node_launcher(recipe)
    code, text = _finish(proc, log, 60)
    assert code == 1, text[-3000:]
    m = re.search(r"freezer \(incarnation 0, pid \d+\) sent no heartbeat for ([\d.]+)s "
                  r"\(cluster.liveness_timeout_s = 3.0\): killing it; last lines of its log "
                  r"\(\S+freezer.log\):\n    about to block the event loop", text)
    assert m and float(m.group(1)) >= 3.0, text[-3000:]
    assert "actor freezer failed: incarnation 0 was killed by SIGKILL" in text


def test_ctrl_c_prints_one_line_with_where_to_resume_and_no_traceback(node_launcher, tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000004").mkdir(parents=True)
    (ckpts / "step_000004" / "loop_state.json").write_text(json.dumps({"step": 4}))
    (ckpts / "step_000006").mkdir()  # no loop_state.json: an incomplete checkpoint
    recipe = HEAD + '''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.sink]
class = "miles.demo:Sink"
'''
    (proc,), _, (log,) = node_launcher(recipe)
    deadline = time.monotonic() + 30
    while "[driver] waiting" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the sink is serving too
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends its foreground group
    code, text = _finish(proc, log, 30)
    assert code == 130, text[-3000:]
    stopped = [line for line in text.splitlines() if "stopped" in line]
    assert stopped == [f"[node/0] shutting down: signal SIGINT; stopped at step 4 (checkpoint "
                       f"{ckpts / 'step_000004'}); run the same command again to resume"], text
    assert "Traceback" not in text and "Error" not in text, text


def test_ctrl_c_in_an_actor_process_during_its_imports_prints_no_traceback(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    plugins = Path(__file__).parent / "plugins"
    env = {**os.environ, "MILES_ACTOR_NAME": "slow", "MILES_ACTOR_CLASS": "slow_import_actor:Slow",
           "PYTHONPATH": f"{plugins}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "miles.runtime.host"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline() == b"importing\n"
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 130 and "Traceback" not in out, out


def test_a_start_failure_on_another_node_ends_the_job_from_the_head(node_launcher):
    recipe = HEAD + '''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
node = 0
[actors.sink]
class = "supervision_actors:FailsOnStart"
node = 1
'''
    procs, _, logs = node_launcher(recipe, nnodes=2)
    codes = [_finish(p, log, 60)[0] for p, log in zip(procs, logs)]
    head, other = logs[0].read_text(), logs[1].read_text()
    assert codes == [1, 1], head + other
    assert "[node/0] shutting down: actor sink failed: incarnation 1 exited with code 1" in head
    assert "RuntimeError: the reward module is missing" in head.split("actor sink failed", 1)[1]


def test_sigterm_during_a_long_on_start_stops_the_actor_at_once_and_quietly(node_launcher):
    recipe = HEAD.replace("shutdown_grace_s = 3", "shutdown_grace_s = 20") + '''
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.slow]
class = "supervision_actors:SlowStart"
'''
    (proc,), _, (log,) = node_launcher(recipe)
    deadline = time.monotonic() + 30
    while "[slow] waiting in on_start" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code, text = _finish(proc, log, 30)
    assert code == 128 + signal.SIGTERM, text
    assert time.monotonic() - started < 10, text  # not the 20 s grace, then a SIGKILL
    assert "Traceback" not in text and "did not exit" not in text, text
