"""Held-out evaluation of the SWE recipe with pass@k in the fleet and external modes: the external
command (`python -m miles.agentic.swe.evaluate`, the evaluator's fleet mode in its own process: its
own engine on the snapshot, its own session server, the episode runner with sandboxes and the
verifier) scores the oracle agent pass@1 = pass@k = 1 and the null agent 0, and its output is what
the evaluator's external mode reads. (The shared mode runs in test_swe_recipes.py.)"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles.actors.evaluator import Evaluator
from miles.config import RunConfig, Recipe
from miles.rl.config import EvalConfig
from miles.wire.messages import Evaluate

ROOT = Path(__file__).resolve().parents[2]


def external_eval(tmp_path: Path, agent: str, model: Path) -> str:
    sets = {"run.output_dir": json.dumps(str(tmp_path / agent)),
            "rollout.agent": json.dumps(f"miles.agentic.swe.scripted:{agent}"),
            "eval.n_prompts": "2", "eval.samples_per_prompt": "2"}
    return shlex.join([sys.executable, "-m", "miles.agentic.swe.evaluate", "--checkpoint", str(model),
                       "--recipe", str(ROOT / "recipes" / "swe_cpu.toml"),
                       *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]) + " --step {step}"


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_external_and_fleet_modes_score_the_oracle_one_and_the_null_agent_zero(tmp_path):
    from miles.tiny import build_tiny_model

    model = build_tiny_model(arch="qwen3")   # stands in for a run's eval/step_N snapshot
    results = {}
    for agent in ("oracle_agent", "null_agent"):
        ev = Evaluator()
        ev.recipe = Recipe(run=RunConfig(output_dir=str(tmp_path / "run")),
                           eval=EvalConfig(mode="external", command=external_eval(tmp_path, agent, model),
                                           timeout_s=600))
        ev.cfg = ev.recipe.eval
        result = await ev.on_evaluate(Evaluate(step=7, version=7, checkpoint_dir=str(model)))
        assert result.ok, result.error
        results[agent] = result.metrics
    oracle, null = results["oracle_agent"], results["null_agent"]
    assert oracle["eval/n"] == 2 and oracle["eval/k"] == 2, oracle
    assert oracle["eval/pass@1"] == oracle["eval/pass@k"] == oracle["eval/reward"] == 1.0, oracle
    assert null["eval/pass@1"] == null["eval/pass@k"] == null["eval/reward"] == 0.0, null


def test_the_command_names_a_missing_run_recipe(tmp_path):
    out = subprocess.run([sys.executable, "-m", "miles.agentic.swe.evaluate", "--checkpoint",
                          str(tmp_path / "eval" / "step_000003")], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode != 0 and "recipe.resolved.node0.json" in out.stderr and "--recipe" in out.stderr
