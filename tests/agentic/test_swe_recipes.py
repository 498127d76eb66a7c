"""The SWE recipes: swe_cpu runs 3 RL steps in a real `miles run` (episodes in real sandboxes, the
verifier's rewards on every trained sample, pass@k in the held-out evaluations, nothing left
open); one step with the held-out pass@k in the external eval mode; swe_h200 and
swe_cluster are accepted by `miles check` (the cluster's placement on 2 nodes).

Measured on the 2-core CPU (shared, load ~18-24): this 3-step run 2m41s; the full recipe (20 steps)
11m47s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
MILES = [sys.executable, "-m", "miles.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    return {**env, **extra}


def miles_run(recipe: str, out: Path, overrides: list[str], timeout_s: float) -> tuple[int, str]:
    port = cluster_port()
    args = [*MILES, "run", str(ROOT / "recipes" / recipe), "--set", f"run.output_dir={json.dumps(str(out))}",
            "--set", f"run.name={json.dumps(out.name)}", "--set", "logging.progress=false",
            "--set", f"cluster.head_port={port}"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, log.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_swe_cpu_runs_three_rl_steps_with_the_verifiers_rewards(tmp_path):
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    out = tmp_path / "swe-cpu"
    code, log = miles_run("swe_cpu.toml", out, ["loop.num_steps=3", "sft.steps=2", "eval.n_prompts=2",
                                                "logging.record_wire=true"], timeout_s=1400)
    assert code == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all("rollout/reward" in r for r in train)
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, 3], sorted(evals)
    for r in evals.values():   # 2 held-out tasks x 4 samples, pass@k from the verifier's "resolved"
        assert r["eval/n"] == 2 and r["eval/k"] == 4 and 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0
        groups = [k for k in r if k.endswith("/pass@1") and k.count("/") == 2]   # eval/<group>/pass@1
        assert any(k.split("/")[1] in ("easy", "medium", "hard") for k in groups), sorted(r)
    samples = [s for rec in read_records(out / "wire" / "driver.mlw") if isinstance(rec.msg, Batch)
               for g in rec.msg.groups for s in g.samples]
    assert len(samples) >= 3 * 2 * 4, len(samples)
    for s in samples:   # the verifier ran the hidden tests on the episode's repository
        assert set(s.reward) == {"resolved", "pass_frac", "fail_to_pass", "format"}, \
            (s.reward, s.metadata.get("error"))
        assert s.metadata["task_id"].startswith("swe-0-train-") and s.metadata["hidden_tests"]
    # an untouched repository passes its PASS_TO_PASS tests: partial credit without "resolved"
    assert any(s.reward["pass_frac"] > 0 for s in samples)
    rollout = (out / "logs" / "rollout.log").read_text()
    assert "sessions of this run open: 0; sandboxes live: 0" in rollout
    closing = [line for line in rollout.splitlines() if line.startswith("[rollout] episodes closed:")]
    assert closing and "live at close 0" in closing[0] and "swept 0" in closing[0], closing
    evaluator = (out / "logs" / "evaluator.log").read_text()
    assert evaluator.count("[eval] episodes closed:") == 2 and evaluator.count("live at close 0") == 2, evaluator[-2000:]


def test_the_h200_and_cluster_recipes_pass_miles_check():
    from miles.tiny import build_tiny_model

    out = subprocess.run([*MILES, "check", str(ROOT / "recipes" / "swe_h200.toml")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert out.returncode == 0 and "recipe OK" in out.stdout and "warning" not in out.stderr, out.stderr
    # the cluster recipe names a model to be set with --set: any HF directory stands in for it
    model = build_tiny_model(arch="qwen3")
    out = subprocess.run([*MILES, "check", str(ROOT / "recipes" / "swe_cluster.toml"),
                          "--set", f"model.path={json.dumps(str(model))}"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=clean_env(NNODES="2"))
    assert out.returncode == 0 and "recipe OK" in out.stdout, out.stderr
    assert "warning" not in out.stderr, out.stderr
    placed = {line.split()[0]: line for line in out.stdout.splitlines() if "miles." in line}
    assert "nodes [1]" in placed["engines"] and "x8/node" in placed["trainer"], out.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["external"])
def test_swe_cpu_reports_pass_at_k_in_the_external_mode(tmp_path, mode):
    """The held-out evaluation from the step's HF snapshot by the eval command, which finds the
    run's resolved recipe beside `eval/step_N`. (The fleet mode, the evaluator's own engine on the
    snapshot, is test_swe_eval.py's; the shared mode is the 3-step run's above.)"""
    out = tmp_path / f"swe-{mode}"
    overrides = ["loop.num_steps=1", "sft.steps=1", f"eval.mode={json.dumps(mode)}", "eval.n_prompts=2"]
    if mode == "external":
        command = f"{sys.executable} -m miles.agentic.swe.evaluate --checkpoint {{checkpoint}} --step {{step}}"
        overrides.append(f"eval.command={json.dumps(command)}")
    code, log = miles_run("swe_cpu.toml", out, overrides, timeout_s=1100)
    assert code == 0, log[-3000:]
    evals = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"}
    assert sorted(evals) == [0, 1], evals
    for r in evals.values():
        assert r["eval/n"] == 2 and r["eval/k"] == 4 and 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0, r
    assert (out / "eval" / "step_000001" / "config.json").is_file()   # the snapshot it scored
