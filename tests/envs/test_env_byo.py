"""Bring your own environment: examples/envs/my_env.py (a task set, an agent on the episode's
OpenAI endpoint, a verifier: about 30 lines) in a real `miles run` of recipes/envs/byo.toml.
The rewards in the trained samples are the example's verifier's, each episode's turns are what its
agent says it made, and nothing of the run is left afterwards."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("my_env", ROOT / "examples" / "envs" / "my_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leftovers(out: Path) -> list[str]:
    """Processes of the run (an actor knows its run by MILES_RECIPE, and its children inherit it)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("MILES_RECIPE", "").startswith(str(out)) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
        except psutil.Error:
            continue
    return found


def test_the_example_task_set_splits_by_seed_and_the_verifier_reads_the_answer():
    from types import SimpleNamespace
    my_env = load_example()
    splits = my_env.tasks(seed=0, test_frac=0.25)
    assert (len(splits["train"]), len(splits["test"])) == (75, 25)
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["test"]}
    assert my_env.tasks(seed=0, test_frac=0.25) == splits
    assert my_env.reward(SimpleNamespace(label="7", metadata={"agent": {"answer": " 7."}})) == 1.0
    assert my_env.reward(SimpleNamespace(label="7", metadata={"agent": {"answer": "8"}})) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_miles_run_of_the_example_environment(tmp_path):
    from miles.engines.procs import free_port
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    my_env = load_example()
    out = tmp_path / f"byo-{int(time.time())}"
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "envs" / "byo.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={free_port()}",
            "--set", "loop.num_steps=3", "--set", "logging.record_wire=true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=850)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    log = log.decode(errors="replace")
    assert proc.returncode == 0, log[-4000:]

    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) == 3 * 2 * 4, len(samples)
    for s in samples:
        assert s.status in ("completed", "truncated"), s.metadata
        assert s.reward == my_env.reward(s)            # the example's own verifier, once per episode
        turns = int(np.count_nonzero(np.diff(np.concatenate([[0], s.loss_mask.astype(np.int8)])) == 1))
        assert turns == s.metadata["session_stats"]["turns"] and 1 <= turns <= 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in rows if r["kind"] == "actors"]
    assert actors[-1]["episode/count"] >= 24 and 1.0 <= actors[-1]["episode/attempts"] <= 2.0
    assert sorted(r["step"] for r in rows if r["kind"] == "eval") == [0, 3]
    assert "sessions of this run open: 0" in (out / "logs" / "rollout.log").read_text()
    assert leftovers(out) == []
