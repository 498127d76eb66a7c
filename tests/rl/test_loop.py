"""The whole loop as real processes: node daemon, driver, buffer, rollout, trainer (FSDP2 on gloo),
an embedded engine behind smg, weights published after every step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_recipe(tmp_path, name, overrides=(), timeout_s=600, stop_after_s=None):
    out = tmp_path / name
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={_free_port()}", *_sets(overrides)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        if stop_after_s is not None:
            time.sleep(stop_after_s)
            os.killpg(proc.pid, signal.SIGINT)
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log.decode(errors="replace"), out


def _sets(overrides):
    for o in overrides:
        yield "--set"
        yield o


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(out, kind):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if f'"kind": "{kind}"' in l]


@pytest.mark.slow
def test_quickstart_learns(tmp_path):
    code, log, out = run_recipe(tmp_path, "qs", ["loop.num_steps=12", "loop.eval_every=0", "loop.save_every=0"])
    assert code == 0, log[-3000:]
    evals = records(out, "eval")
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 12
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"] + 0.1, evals
    train = records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 13))
    assert all(r["version"] == r["step"] + 1 for r in train)      # SFT published version 1
    assert all(r["batch/staleness_avg"] <= 2 for r in train)
    assert (out / "reward_curve.png").stat().st_size > 1000
