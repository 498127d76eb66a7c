"""The terminal recipes: all three pass `miles check` (the cluster one with a stand-in checkpoint, on a
two-node placement), in every eval mode; the CPU recipe runs 3 RL steps in a real `miles run` with
the rewards of the Harbor verifier arriving at the trainer, pass@k on the held-out split, and no
session or sandbox left open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import RecipeError, load_recipe
from miles.recipe_checks import check_placement, check_recipe
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {name: ROOT / "recipes" / f"terminal_{name}.toml" for name in ("cpu", "h200", "cluster")}
EVAL_COMMAND = "eval.command='python -m miles.agentic.terminal.evaluate --checkpoint {checkpoint} --step {step}'"
EVAL_MODES = [["eval.mode='shared'"], ["eval.mode='fleet'"], ["eval.mode='external'", EVAL_COMMAND]]


def stand_in_model() -> str:
    from miles.tiny import build_tiny_model
    return str(build_tiny_model(arch="qwen2"))


@pytest.mark.parametrize("mode", EVAL_MODES, ids=lambda m: m[0])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_terminal_recipes_pass_miles_check_in_every_eval_mode(name, mode):
    overrides = [f"model.path={stand_in_model()!r}"] if name == "cluster" else []
    if name == "cpu" and mode[0] != "eval.mode='shared'":
        overrides.append("sft.until_heldout=0")   # its held-out checks run on the rollout engines
    recipe = load_recipe(RECIPES[name], overrides=overrides + mode)
    assert check_recipe(recipe, str(RECIPES[name])) == []
    assert recipe.rollout.agent == "miles.agentic.terminal.agent:agent"
    assert recipe.rollout.reward == "miles.agentic.terminal.agent:verify"
    assert recipe.data.task.startswith("miles.agentic.terminal.tasks:terminal_tasks")
    assert recipe.eval.samples_per_prompt > 1 and recipe.eval.temperature > 0   # pass@k, k > 1
    if name == "cluster":
        assert (recipe.engine.kind, recipe.train.backend) == ("sglang", "fsdp")
        check_placement(recipe, nnodes=2, source=str(RECIPES[name]))
        with pytest.raises(RecipeError, match="this job has 1 node"):
            check_placement(recipe, nnodes=1, source=str(RECIPES[name]))
    if name == "h200":
        assert recipe.engine.device.startswith("cuda") and recipe.model.tiny_overrides["num_hidden_layers"] == 24


def test_miles_check_accepts_the_cluster_recipe_and_refuses_a_broken_one():
    base = [sys.executable, "-m", "miles.cli", "check", str(RECIPES["cluster"]), "--set",
            f"model.path={stand_in_model()!r}"]
    out = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "recipe OK" in out.stdout and "nodes [1]" in out.stdout, out.stderr[-2000:]
    bad = subprocess.run(base + ["--set", "rollout.reward='miles.agentic.terminal.agent:nope'"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "rollout.reward = 'miles.agentic.terminal.agent:nope'" in bad.stderr


def run_recipe(out: Path, overrides: list[str], timeout_s: float, recipe: str = "cpu") -> tuple[int, str]:
    port = cluster_port()
    args = [sys.executable, "-m", "miles.cli", "run", str(RECIPES[recipe]),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={port}"]
    for o in overrides:
        args += ["--set", o]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    env["MILES_TERMINAL_TASKS"] = str(out.parent / "terminal-tasks")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, log.decode(errors="replace")


def closed_cleanly(out: Path) -> None:
    """The rollout worker and the evaluator freed every sandbox, no session of the run is open."""
    logs = out / "logs"
    rollout = (logs / "rollout.log").read_text().splitlines()
    closing = [ln for ln in rollout if ln.startswith("[rollout] episodes closed:")]
    assert closing and "live at close 0" in closing[-1] and "swept 0" in closing[-1], closing
    settled = [ln for ln in rollout if "episodes settled:" in ln]
    assert settled and "sessions of this run open: 0" in settled[-1] and "sandboxes live: 0" in settled[-1], settled
    evals = [ln for ln in (logs / "evaluator.log").read_text().splitlines() if "episodes closed:" in ln]
    assert evals and all("live at close 0" in ln for ln in evals), evals


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_terminal_cpu_runs_three_rl_steps_with_verifier_rewards(tmp_path):
    out = tmp_path / "terminal-cpu"
    # a short warm-start: the tool-call format starts to show; rewards are mostly 0 at 3 steps
    # buffer.filter none: after 20 warm-start steps every group's rewards are 0 (no std to keep)
    code, log = run_recipe(out, ["loop.num_steps=3", "loop.eval_every=3", "sft.steps=20", "sft.batch_size=8",
                                 "sft.until_heldout=0", "eval.samples_per_prompt=2", "eval.n_prompts=12",
                                 "loop.groups_per_step=2", "rollout.n_samples_per_prompt=4",
                                 "buffer.filter='none'"],
                           timeout_s=850)
    assert code == 0, log[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0.0 <= r["rollout/reward"] <= 1.0 for r in train), train   # the verifier's 0/1, averaged
    # KL to the warm start: 0 before the first update, logged with entropy and ppo_kl
    assert abs(train[0]["train/ref_kl"]) < 1e-4 and all("train/entropy" in r and "train/ppo_kl" in r for r in train)
    actors = [r for r in rows if r["kind"] == "actors"]
    last = actors[-1]
    assert last["episode/count"] >= 3 * 2 * 4 and last["episode/failed"] == 0, last   # no verifier error
    assert last["sandbox/created"] == last["sandbox/destroyed"] + last["sandbox/live"]
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, 3], evals
    for r in evals.values():
        assert (r["eval/n"], r["eval/k"]) == (12.0, 2.0) and 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0, r
    data = out / "data"
    assert sum(1 for _ in open(data / "train.jsonl")) == 1500 and sum(1 for _ in open(data / "test.jsonl")) == 500
    # the brief set's prompts: system prompt and task in ~100 tokens (the first turn's prompt)
    from miles.tiny import build_tokenizer
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(build_tokenizer()))
    sft = [json.loads(line) for line in open(data / "sft.jsonl")]
    first = [len(tok(r["prompt"])["input_ids"]) for r in sft if r["prompt"].count("<|im_start|>") == 3]
    assert max(first) < 128 and sum(first) / len(first) < 100, (max(first), sum(first) / len(first))
    closed_cleanly(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
# fleet: the evaluator's own engine, a mode that is not the task's (tests/agentic/test_swe_eval.py
# scores an oracle through it); `extended`, run with MILES_TEST_EXTENDED=1
@pytest.mark.parametrize("mode", ["shared", pytest.param("fleet", marks=pytest.mark.extended),
                                  "external"])
def test_held_out_pass_at_k_in_every_eval_mode_with_the_oracle(tmp_path, mode):
    """The CPU recipe with the oracle as its `rollout.agent`: every training reward and the held-out
    pass@k are 1.0 in each eval mode (shared: the rollout engines; fleet: an engine of the
    evaluator's own on the step's checkpoint; external: `miles.agentic.terminal.evaluate`)."""
    out = tmp_path / f"terminal-oracle-{mode}"
    oracle = "miles.agentic.terminal.agent:oracle_agent"
    overrides = [f"rollout.agent={oracle!r}", "sft.steps=0", "sft.until_heldout=0", "eval.n_prompts=12",
                 "loop.num_steps=1", "loop.eval_every=1",
                 "loop.groups_per_step=2", "rollout.n_samples_per_prompt=2", "eval.samples_per_prompt=2",
                 'buffer.filter="none"',   # the oracle's groups all score 1: the recipe's filter drops them
                 f"eval.mode={mode!r}"]
    if mode == "external":
        command = (f"{sys.executable} -m miles.agentic.terminal.evaluate --checkpoint {{checkpoint}} "
                   f"--step {{step}} --k 2 --compact --agent {oracle} --task-set brief --n-tasks 12")
        overrides.append(f"eval.command={command!r}")
    code, log = run_recipe(out, overrides, timeout_s=850)
    assert code == 0, log[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["rollout/reward"] for r in train] == [1.0], train
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, 1], evals
    for r in evals.values():
        assert (r["eval/pass@1"], r["eval/pass@k"], r["eval/n"], r["eval/k"]) == (1.0, 1.0, 12.0, 2.0), r
    if mode != "external":
        closed_cleanly(out)
