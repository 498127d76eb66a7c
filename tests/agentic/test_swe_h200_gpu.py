"""recipes/swe_h200.toml on one GPU, shortened (skipped without CUDA): the 0.5B-shaped model's SFT
warm-start, 3 RL steps of the SWE harness in real sandboxes and the held-out pass@k.

    .venv/bin/pytest -q tests/agentic/test_swe_h200_gpu.py          (one H200, a few minutes)
    miles run recipes/swe_h200.toml                                 (the full run: 30 steps)
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_swe_h200_recipe_trains_three_steps_with_the_verifiers_rewards(tmp_path):
    from test_swe_recipes import miles_run

    out = tmp_path / "swe-h200"
    code, log = miles_run("swe_h200.toml", out, ["loop.num_steps=3", "sft.steps=20", "loop.eval_every=3"],
                          timeout_s=1700)
    assert code == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all("rollout/reward" in r for r in train)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(r["eval/k"] == 4 and r["eval/n"] == 16 for r in evals), evals
    assert "live at close 0" in (out / "logs" / "rollout.log").read_text()
