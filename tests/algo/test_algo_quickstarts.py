"""The algorithm quickstarts as real `miles run`s (embedded engine behind smg, FSDP2 on gloo, weights
synced every step): PPO with a critic, on-policy distillation, LoRA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_recipe(tmp_path: Path, recipe: str, name: str, overrides: list[str], timeout_s: float = 900):
    """(exit code, log tail, rows of metrics.jsonl) of `miles run recipe` with `overrides`."""
    port = cluster_port()
    out = tmp_path / name
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / recipe),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={port}"]
    for o in overrides:
        args += ["--set", o]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log = proc.communicate()[0]
        raise AssertionError(f"miles run {recipe} still running after {timeout_s} s:\n"
                             f"{log.decode(errors='replace')[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc.returncode, log.decode(errors="replace")[-3000:], rows


def evals(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval/reward"] for r in rows if r.get("kind") == "eval"}


@pytest.mark.timeout(1000)
def test_ppo_quickstart_held_out_reward_rises(tmp_path):
    """PPO end to end. The critic's explained variance rises from 0 (a zero head); its value loss
    need not fall here: the return variance grows as the policy leaves ~0.2 success."""
    code, log, rows = run_recipe(tmp_path, "recipes/algos/ppo_quickstart.toml", "ppo",
                                 ["loop.num_steps=60", "loop.save_every=30"])
    assert code == 0, log
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 60
    assert all(k in r for r in train for k in ("train/value_loss", "train/explained_variance",
                                                 "train/value_clipfrac")), train[0]
    ev = [r["train/explained_variance"] for r in train]
    assert ev[0] == 0.0
    assert sum(ev[-10:]) / 10 > max(0.02, sum(ev[:10]) / 10), ev
    e = evals(rows)
    assert e[max(e)] > e[0] + 0.1, e
    assert list((tmp_path / "ppo").rglob("critic/COMPLETE")), "no checkpoint carried the critic"


@pytest.mark.timeout(1800)
def test_opd_quickstart_reverse_kl_falls_and_held_out_reward_rises(tmp_path):
    """Pure distillation from bench/opd_teacher.py's 4-layer teacher (held-out 0.8): the reward is
    never trained on, yet as the student's reverse KL to the teacher falls (measured 1.52 -> 0.53,
    first vs last 10 of 150 steps) its held-out reward rises (0.41 -> ~0.58 over the last 5 evals)."""
    teacher = tmp_path / "teacher"
    made = subprocess.run([sys.executable, str(ROOT / "bench" / "opd_teacher.py"), "--out", str(teacher)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    summary = json.loads(made.stdout.strip().splitlines()[-1])
    assert summary["held_out_greedy_accuracy"] > 0.6, summary
    code, log, rows = run_recipe(tmp_path, "recipes/algos/opd_quickstart.toml", "opd",
                                 ["loop.save_every=0",
                                  f"train.teacher_model_path={json.dumps(str(teacher))}"])
    assert code == 0, log
    kl = [r["train/teacher_reverse_kl"] for r in rows if r.get("kind") == "train"]
    assert len(kl) == 150
    # first vs last 10 steps: measured 1.52 -> 0.53 (0.35x) and, in a fresh-clone suite, 1.51 -> 0.83
    # (0.55x; fully async, so the run is not deterministic); a student that does not distil stays ~1x
    assert sum(kl[-10:]) / 10 < 0.65 * sum(kl[:10]) / 10, kl
    e = evals(rows)
    late = [e[s] for s in sorted(e)[-5:]]
    # measured 0.41 -> 0.58, and in a two-stream fresh-clone suite 0.41 -> 0.49 and 0.60 (two runs);
    # a single evaluation swings by +-0.1, the mean of five by about +-0.04
    assert sum(late) / len(late) > e[0] + 0.05, e


@pytest.mark.timeout(1000)
def test_lora_quickstart_held_out_reward_rises(tmp_path):
    """Adapters only (rank 16: 65,536 of the model's 361,216 parameters); every publish sends merged
    weights and is checked by checksum on the engine (weights.check_weights, a failure ends the run)."""
    base = tmp_path / "base"
    made = subprocess.run([sys.executable, str(ROOT / "bench" / "opd_teacher.py"), "--out", str(base),
                           "--layers", "2", "--steps", "60"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    code, log, rows = run_recipe(tmp_path, "recipes/algos/lora_quickstart.toml", "lora",
                                 ["loop.num_steps=60", "loop.save_every=30",
                                  f"model.path={json.dumps(str(base))}"])
    assert code == 0, log
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 60
    assert {r["train/trainable_params"] for r in train} == {2 * 16 * 2048}
    # Adam's two fp32 moments per adapter element, plus one step counter per adapter tensor
    assert train[-1]["train/optimizer_bytes"] == 2 * 4 * 2 * 16 * 2048 + 4 * 2 * 7 * 2
    e = evals(rows)
    assert e[max(e)] > e[0] + 0.1, e
    assert list((tmp_path / "lora").rglob("adapter/adapter_model.safetensors"))
