"""About 200 agent episodes with random faults, and the rollout actor SIGKILLed once in the middle
(issue 16, Show): the run trains all its steps, and leaves nothing behind.

The agent (`agentic_plugins.faulty_agent`, by import path) raises, sleeps past
`agent.episode_timeout_s`, hits a sandbox exec failure (a user backend registered by import,
wrapping the subprocess one) or finishes normally, per episode at random (seeded). Proof of
"nothing left":
- sessions: the driver (a `LoopDriver` subclass, `actors.driver.class`) asks the session server
  `GET /sessions` with the job's token once the loop is done and before the job ends (the fleet
  stops the session server with the job), and writes what it found to `leak_check.json`;
- sandboxes: the same check counts the backend's records labelled with the run and the TTL reaper
  processes of sandboxes under the run's own `base_dir`, before the worker's own exit sweep could
  hide a leak; after the job the process list has no reaper there and the backend's `sweep` of
  the run label finds 0;
- the failed and truncated episodes show in the step metrics (`episode/failed`,
  `episode/truncated`, `episode/tool_errors`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from chaos_harness import ROOT, PYTHON, find_target, last_train_step, read_rows
from tests.ports import cluster_port

HERE = Path(__file__).resolve().parent
STEPS, GROUPS, SAMPLES, KILL_AT = 12, 8, 2, 4


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        digits = f"{(i * 37 + 101) % 900 + 100}"
        out.append({"prompt": f"sort {digits} =", "label": "".join(sorted(digits)),
                    "metadata": {"files": {"secret.txt": f"hint {i}\n"}}})
    return out


def segments_total(actors: list[dict], key: str) -> float:
    """A cumulative counter of the rollout worker summed over its incarnations (it restarts at 0)."""
    total, last = 0.0, 0.0
    for r in actors:
        v = r.get(key)
        if v is None:
            continue
        if v < last:
            total += last
        last = v
    return total + last


@pytest.mark.slow
def test_faulty_episodes_and_a_killed_rollout_leave_no_sandbox_and_no_session(tmp_path):
    name = f"agentic-faults-{uuid.uuid4().hex[:6]}"
    out = tmp_path / name
    base_dir = tempfile.mkdtemp(prefix="miles-faults-")   # sandboxes of this run only
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows(400)))
    sets = [f"run.output_dir={json.dumps(str(out))}", f"run.name={json.dumps(name)}",
            f"cluster.head_port={cluster_port()}", "logging.progress=false",
            f"loop.num_steps={STEPS}", f"loop.groups_per_step={GROUPS}", "loop.eval_every=0",
            "loop.save_every=0", "loop.timeout_s=120", 'eval.mode="off"', "sft.steps=0",
            'data.task=""', f"data.path={json.dumps(str(train))}",
            f"rollout.n_samples_per_prompt={SAMPLES}", "rollout.max_new_tokens=4",
            'rollout.reward="first_answer"', 'buffer.filter="none"',
            'rollout.agent="agentic_plugins:faulty_agent"', "agent.episode_timeout_s=3",
            'sandbox.backend="faulty_subprocess"', f"sandbox.options.base_dir={json.dumps(base_dir)}",
            'actors.driver.class="agentic_plugins:LeakCheckingDriver"', "actors.driver.main=true"]
    args = [str(PYTHON), "-m", "miles.cli", "run", str(ROOT / "recipes" / "chaos_cpu.toml")]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    try:
        log_path = tmp_path / "run.log"
        metrics = out / "metrics.jsonl"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while last_train_step(metrics) < KILL_AT:
                assert proc.poll() is None, f"the run ended before step {KILL_AT}:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"no training step {KILL_AT} within 400 s"
                time.sleep(0.2)
            found, deadline = [], time.monotonic() + 10
            while not found and time.monotonic() < deadline:   # a child exiting mid-scan gives []
                found = find_target(psutil.Process(proc.pid), "rollout")
                time.sleep(0.1)
            assert len(found) == 1, f"the rollout actor's process among the run's: {found}"
            rollout = found[0]
            rollout.send_signal(signal.SIGKILL)
            print(f"killed the rollout actor (pid {rollout.pid}) at {time.time():.1f}")
            try:
                code = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the run did not end within 600 s of the kill:\n"
                                     f"{log_path.read_text()[-4000:]}") from None
        finally:
            if proc.poll() is None:   # stopped early: the run and every process it started
                kids = psutil.Process(proc.pid).children(recursive=True)
                os.killpg(proc.pid, signal.SIGKILL)
                for kid in kids:
                    try:
                        kid.kill()
                    except psutil.Error:
                        pass
        check_the_run(name, out, metrics, log_path, code, base_dir)
    finally:   # whatever failed: nothing of this test may outlive it
        from agentic_plugins import reapers
        from miles.sandboxes.local import SubprocessBackend
        asyncio.run(SubprocessBackend(base_dir=base_dir).sweep({"miles.run": name}))
        for pid in reapers(base_dir):   # a reaper whose record is gone: the sweep cannot see it
            os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(base_dir, ignore_errors=True)


def check_the_run(name, out, metrics, log_path, code, base_dir):
    log = log_path.read_text()
    assert code == 0, log[-4000:]
    rows_ = read_rows(metrics)
    assert [r["step"] for r in rows_ if r.get("kind") == "train"] == list(range(1, STEPS + 1))
    rollout_log = (out / "logs" / "rollout.log").read_text()
    assert "incarnation 1 resumes from the buffer's journal" in rollout_log, rollout_log[-3000:]

    # nothing left before the job ended (the driver's check), nor after it
    check = json.loads((out / "leak_check.json").read_text())
    assert check["sessions"]["last"] == 0, check
    destroy_errors = [l for l in rollout_log.splitlines()
                      if "destroy_record(" in l or "destroying sandbox" in l or l.startswith("OSError")]
    assert check["sandboxes"]["last"] == 0 and not check["sandboxes"]["records"], (check, destroy_errors)
    from agentic_plugins import reapers
    from miles.sandboxes.local import SubprocessBackend
    assert reapers(base_dir) == []
    backend = SubprocessBackend(base_dir=base_dir)
    assert asyncio.run(backend.sweep({"miles.run": name})) == 0

    # the faults happened, and show in the step metrics
    actors = [r for r in rows_ if r.get("kind") == "actors"]
    episodes = segments_total(actors, "episode/count")
    failed, truncated = segments_total(actors, "episode/failed"), segments_total(actors, "episode/truncated")
    print(json.dumps({"episodes": episodes, "failed": failed, "truncated": truncated,
                      "leak_check": check}))
    assert episodes >= 180, episodes
    assert failed >= 0.1 * episodes and truncated >= 0.05 * episodes, (episodes, failed, truncated)
    assert max(r.get("episode/tool_errors", 0) for r in actors) > 0


def test_a_run_cancelled_while_its_session_is_created_leaves_no_session():
    """The race the fault test found: StopRollout cancelled agent runs inside `create_session`,
    after the server had made the session; nobody knew its id, so it stayed open."""
    from miles.envs.agent import _COLLECTS, run_agent

    class SlowServer:   # the session server's answer arrives after the caller was cancelled
        token = "t"

        def __init__(self):
            self.open: set[str] = set()

        async def create_session(self, rollout_id, metadata, return_routed_experts=False):
            self.open.add(rollout_id)
            await asyncio.sleep(0.2)
            return {"session_id": rollout_id, "base_url": "http://unused"}

        async def delete(self, session_id):
            self.open.discard(session_id)

    async def agent(base_url, task):
        raise AssertionError("the run was cancelled before the agent started")

    async def main():
        server = SlowServer()
        run = asyncio.ensure_future(run_agent(agent, {}, server, group_id="g", rollout_id="g-0"))
        await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert server.open == {"g-0"}          # the server has it; the caller is gone
        await asyncio.wait_for(asyncio.gather(*_COLLECTS), 5)
        return server.open

    assert asyncio.run(main()) == set()


def test_a_controller_killed_before_recording_its_reaper_leaves_no_reaper_after_the_sweep(tmp_path):
    """The other leftover the fault test found: a worker SIGKILLed inside `create`, after the
    TTL reaper was started and before the record named its pid; the next incarnation's sweep
    deleted the record and the reaper slept on (an hour, the TTL)."""
    import msgspec
    from agentic_plugins import reapers
    from miles.sandboxes.base import SandboxSpec
    from miles.sandboxes.local import SubprocessBackend
    base_dir = tempfile.mkdtemp(prefix="miles-faults-")
    try:
        async def crash_then_sweep():
            dead = SubprocessBackend(base_dir=base_dir)
            sandbox = await dead.create(SandboxSpec(labels={"miles.run": "crashed"}))
            record = msgspec.structs.replace(sandbox.record, reaper_pid=0)   # as first written
            dead._write_record(record)
            assert len(reapers(base_dir)) == 1
            swept = await SubprocessBackend(base_dir=base_dir).sweep({"miles.run": "crashed"})
            return swept, sandbox
        swept, sandbox = asyncio.run(crash_then_sweep())
        assert swept == 1
        for _ in range(50):
            if not reapers(base_dir):
                break
            time.sleep(0.1)
        assert reapers(base_dir) == []
        sandbox._reaper.wait(timeout=5)      # reap our zombie child
    finally:
        for pid in reapers(base_dir):
            os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(base_dir, ignore_errors=True)
