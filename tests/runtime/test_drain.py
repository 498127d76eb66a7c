"""Preemption drain (issue 38, item 4): SIGTERM or SIGUSR1 to `launch/miles.sh` on two loopback
nodes, as Slurm sends them (`--signal=B:USR1@120` to the head's launcher, `scancel`'s SIGTERM to
every node). Within `cluster.drain_timeout_s` the step in progress finishes or is abandoned, a
checkpoint is written, both nodes exit 0 and the head says in one line that the run is
resumable; the same command then resumes it from that checkpoint, and the prompt ledger proves
that nothing was lost or trained twice across the two jobs."""

import json
import os
import signal

import pytest
from test_multinode import RECIPE, _common, _records, _until, _wait

from miles.actors.ledger import check_run


@pytest.mark.slow
@pytest.mark.timeout(900)   # its own waits: 300 s to step 2, 60 s for the drain, 400 s for the resume
def test_sigusr1_drains_both_nodes_to_a_checkpoint_and_the_same_command_resumes(tmp_path, cluster_launcher):
    out = tmp_path / "drain"
    overrides = [*_common(tmp_path, "drain"), "loop.num_steps=6", "loop.save_every=0",
                 "loop.eval_every=0", 'eval.mode="off"', 'buffer.filter="none"', "sft.steps=5"]
    procs, logs = cluster_launcher(RECIPE, 2, overrides)
    _until(lambda: len(_records(out, "train")) >= 2, 300, "training step 2", procs)
    os.kill(procs[0].pid, signal.SIGUSR1)   # the head's launcher: Slurm's --signal=B:USR1@...
    os.kill(procs[1].pid, signal.SIGTERM)   # every other node: scancel's SIGTERM
    codes = _wait(procs, 25 + 35, "the drain (cluster.drain_timeout_s = 25, then the stop)")
    head = logs[0].read_text()
    assert codes == [0, 0], head[-4000:] + logs[1].read_text()[-2000:]
    drained = [json.loads(line.split("] ", 1)[1]) for line in head.splitlines() if '"drained": true' in line]
    assert len(drained) == 1, head[-4000:]
    step = drained[0]["step"]
    assert any("resumable from the checkpoint" in line and "run the same command again" in line
               for line in head.splitlines()), head[-3000:]
    assert "waiting up to 25.0 s for the head to drain the job" in logs[1].read_text()
    assert (out / "checkpoints" / f"step_{step:06d}" / "loop_state.json").exists()
    steps = [r["step"] for r in _records(out, "train")]
    assert steps == list(range(1, step + 1)), steps   # the step in progress finished, or none began
    first = check_run(out)
    assert first.ok, first.line()

    procs, logs = cluster_launcher(RECIPE, 2, overrides)   # the same command again
    codes = _wait(procs, 400, "the resumed 2-node run")
    head = logs[0].read_text()
    assert codes == [0, 0], head[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:06d}'} at step {step}" in head, head[-3000:]
    steps = [r["step"] for r in _records(out, "train")]
    assert steps == list(range(1, 7)), steps   # each step once: the drain lost none, redid none
    ledger = check_run(out)
    assert ledger.ok and ledger.jobs == 2 and ledger.trained == 6 * 8, ledger.line()
