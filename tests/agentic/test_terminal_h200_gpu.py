"""recipes/terminal_h200.toml on one GPU, shortened (skipped without CUDA): the 0.5B-shaped model's SFT
warm-start on the oracle transcripts, 3 RL steps of the terminal agent in fresh subprocess sandboxes
with the Harbor verifier's rewards, and the held-out pass@8.

    .venv/bin/pytest -q tests/agentic/test_terminal_h200_gpu.py     (one H200, a few minutes)
    miles run recipes/terminal_h200.toml                            (the full run: 40 steps)
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_terminal_h200_recipe_trains_three_steps_with_the_verifiers_rewards(tmp_path):
    from test_terminal_recipes import closed_cleanly, run_recipe

    out = tmp_path / "terminal-h200"
    code, log = run_recipe(out, ["loop.num_steps=3", "sft.steps=20", "loop.eval_every=3"], timeout_s=1700,
                           recipe="h200")
    assert code == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(0.0 <= r["rollout/reward"] <= 1.0 for r in train)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all((r["eval/k"], r["eval/n"]) == (8.0, 12.0) for r in evals), evals
    assert [r for r in rows if r["kind"] == "actors"][-1]["episode/failed"] == 0
    closed_cleanly(out)
