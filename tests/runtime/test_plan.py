"""`miles plan`: the CLI's output and errors, and the simulator's limits (sync is the sum of its
parts, fully-async with fast training approaches the generation bound, staleness stays bounded)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from miles.plan import Deployment, plan, simulate
from miles.plan_inputs import Figure, Lengths, PlanError
from miles.plan_inputs import model_sizes

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["step_s", "trainer_idle_frac", "engine_idle_frac", "staleness_mean", "staleness_max",
          "engines", "train_gpus", "inputs", "lengths"]


def miles(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_prints_the_documented_fields():
    out = miles("plan", "recipes/quickstart.toml")
    assert out.returncode == 0, out.stderr
    for label in ("mode", "step time", "trainer idle", "engine idle", "staleness", "inputs:",
                  "response lengths"):
        assert f"  {label}" in out.stdout, (label, out.stdout)
    line = miles("plan", "recipes/quickstart.toml", "--json", "--set", 'loop.mode="sync"')
    assert line.returncode == 0, line.stderr
    p = json.loads(line.stdout)
    assert all(k in p for k in FIELDS), sorted(p)
    assert p["mode"] == "sync" and p["staleness_max"] == 0 and p["step_s"] > 0
    assert all(f["source"] for f in p["inputs"].values())   # every figure says where it comes from


def test_cli_projection_on_gpus():
    out = miles("plan", "recipes/grpo_h200.toml", "--model-size", "744b-a40b", "--gpus", "64", "--json",
                "--set", "loop.groups_per_step=16", "--set", "rollout.max_inflight_samples=1024")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["engines"] == 4 and p["gpus_per_engine"] == 8 and p["train_gpus"] == 32
    assert p["step_s"] > 10      # minutes-scale steps for a 744B model, not the tiny one's
    out = miles("plan", "recipes/grpo_h200.toml")
    assert out.returncode == 2 and "--model-size: required" in out.stderr and "cuda:0" in out.stderr


@pytest.mark.parametrize("args, words", [
    (["--model-size", "99b"], ["--model-size", "99b", "744b-a40b"]),
    (["--model-size", "744b-a40b", "--gpus", "16"], ["--gpus", "16", "at least 40"]),
    (["--gpus", "0"], ["--gpus", "0"]),
    (["--set", "loop.groups_per_step=0"], ["loop.groups_per_step", "0"]),
])
def test_cli_bad_input_names_the_field(args, words):
    out = miles("plan", "recipes/quickstart.toml", *args)
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith("miles plan: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_inputs_file_overrides_and_bad_figures(tmp_path):
    from miles.config import load_recipe
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml")
    fast = plan(recipe, "tiny", inputs_json={"decode_fixed_s": {"value": 1e-4, "source": "my bench"}})
    slow = plan(recipe, "tiny", inputs_json={"decode_fixed_s": 0.1}, inputs_source="slow.json")
    assert fast["inputs"]["decode_fixed_s"]["source"] == "my bench"
    assert slow["inputs"]["decode_fixed_s"]["source"] == "slow.json"
    assert slow["step_s"] > 1.2 * fast["step_s"]
    with pytest.raises(PlanError, match=r"decode_speed = 3: not an input figure"):
        plan(recipe, "tiny", inputs_json={"decode_speed": 3}, inputs_source="x.json")
    with pytest.raises(PlanError, match=r"prefill_s = -1: expected a finite number >= 0"):
        plan(recipe, "tiny", inputs_json={"prefill_s": -1}, inputs_source="x.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    out = miles("plan", "recipes/quickstart.toml", "--inputs", str(bad))
    assert out.returncode == 2 and "--inputs" in out.stderr and "JSON object" in out.stderr


# ----- the simulator's limits --------------------------------------------------------------------

def _inputs(**changes):
    base = model_sizes()["tiny"].inputs
    changes = {"decode_per_ctx_token_s": 0.0, **changes}  # the closed forms below leave it out
    return replace(base, **{k: Figure(v, "test") for k, v in changes.items()})


def _dep(mode="sync", staleness=0, groups=4, n=4, lengths=Lengths(20, 0.0, 20, "test"), inflight=256,
         engines=1):
    return Deployment(mode=mode, max_staleness=staleness, groups_per_step=groups, n_samples=n,
                      max_inflight_samples=inflight, capacity_groups=64, num_engines=engines,
                      max_running=256, gpus_per_engine=1, train_gpus=1, lengths=lengths)


def test_sync_step_is_generation_plus_training_plus_stall():
    inp = _inputs(decode_fixed_s=2e-3, decode_per_seq_s=1e-4, prefill_s=1e-3, group_overhead_s=5e-3,
                  train_tokens_per_s=5000.0, train_fixed_s=0.02, publish_fixed_s=0.03,
                  publish_s_per_gb=0.0, step_overhead_s=0.01, prompt_tokens=6.0,
                  train_overlap_slowdown=1.0, engine_overlap_slowdown=1.0, keep_fraction=1.0)
    G, n, L = 4, 4, 20
    res = simulate(_dep(groups=G, n=n), inp, steps=6)
    N = G * n
    gen = N * 1e-3 + L * (2e-3 + 1e-4 * N) + 5e-3   # prefills, L decode steps of the batch, rewards
    train = 0.02 + N * (L + 6) / 5000.0 + 0.01
    assert res.step_s == pytest.approx(gen + train + 0.03, rel=1e-6)
    assert res.staleness_max == 0
    assert res.trainer_idle_frac == pytest.approx(gen / (gen + train + 0.03), rel=1e-6)


def test_decode_steps_grow_with_the_batchs_context():
    """With a per-context-token cost, each step reads every running sequence's prompt and the
    tokens made so far: L steps of N sequences cost L x (fixed + N x per_seq + c x N x prompt)
    + c x N x L^2 / 2 (the context grows by N tokens a step)."""
    c = 2e-6
    inp = _inputs(decode_fixed_s=2e-3, decode_per_seq_s=1e-4, prefill_s=1e-3, group_overhead_s=5e-3,
                  train_tokens_per_s=5000.0, train_fixed_s=0.02, publish_fixed_s=0.03,
                  publish_s_per_gb=0.0, step_overhead_s=0.01, prompt_tokens=6.0,
                  train_overlap_slowdown=1.0, engine_overlap_slowdown=1.0, keep_fraction=1.0,
                  decode_per_ctx_token_s=c)
    G, n, L = 4, 4, 200
    res = simulate(_dep(groups=G, n=n, lengths=Lengths(L, 0.0, 4 * L, "fixed")), inp, steps=6)
    N = G * n
    decode = L * (2e-3 + 1e-4 * N + c * N * 6.0) + c * N * L * L / 2
    gen = N * 1e-3 + decode + 5e-3
    train = 0.02 + N * (L + 6) / 5000.0 + 0.01
    assert res.step_s == pytest.approx(gen + train + 0.03, rel=1e-6)
    flat = simulate(_dep(groups=G, n=n, lengths=Lengths(L, 0.0, 4 * L, "fixed")),
                    replace(inp, decode_per_ctx_token_s=Figure(0.0, "off")), steps=6)
    assert res.step_s - flat.step_s == pytest.approx(c * N * (6.0 * L + L * L / 2), rel=1e-6)


def test_fully_async_with_fast_training_approaches_the_generation_bound():
    inp = _inputs(decode_fixed_s=2e-3, decode_per_seq_s=1e-4, prefill_s=0.0, group_overhead_s=0.0,
                  train_tokens_per_s=1e9, train_fixed_s=0.0, publish_fixed_s=0.0, step_overhead_s=0.0,
                  train_overlap_slowdown=1.0, engine_overlap_slowdown=1.0, keep_fraction=1.0)
    G, n, L = 4, 4, 20
    B = G * n   # the semaphore keeps one step's samples in flight; admission allows 3 steps' worth
    res = simulate(_dep("fully_async", 2, G, n, inflight=B), inp, steps=40)
    bound = G * n * L * (2e-3 + 1e-4 * B) / B       # tokens per step / the engine's tokens/s at B
    assert res.step_s == pytest.approx(bound, rel=0.05)
    assert res.trainer_idle_frac > 0.95 and res.engine_idle_frac < 0.05
    sync = simulate(_dep("sync", 0, G, n, inflight=B), inp, steps=10)
    assert sync.step_s >= res.step_s * 0.99


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("one_step_off", 1), ("fully_async", 2),
                                             ("fully_async", 3)])
def test_staleness_is_bounded_as_the_buffer_bounds_it(mode, staleness):
    """Rule A bounds where a group is due, rule B how far faster groups overtake a slow one, and
    the buffer's backstop hands back a group more than max_staleness + 1 versions late (the real
    buffer trains lag max_staleness + 1: a fully-async run at 2 logged buffer/staleness_max 3).
    Sync is exactly on-policy; the async modes' mean stays within max_staleness."""
    inp = _inputs(train_tokens_per_s=3000.0, keep_fraction=0.7)  # slow trainer, dropped groups
    heavy = Lengths(24, 1.0, 240, "test")
    worst = 0
    for seed in range(3):
        res = simulate(_dep(mode, staleness, groups=8, lengths=heavy, engines=2), inp, steps=15, seed=seed)
        assert res.staleness_max <= staleness + (1 if staleness else 0)
        assert 0 <= res.staleness_mean <= staleness
        worst = max(worst, res.staleness_max)
    assert worst >= min(1, staleness)      # the async modes do train late groups


def test_staleness_within_max_staleness_without_stragglers():
    """Equal lengths: nothing overtakes, so rule A alone holds every group within max_staleness."""
    inp = _inputs(train_tokens_per_s=3000.0)
    for staleness in (1, 2, 3):
        res = simulate(_dep("fully_async", staleness, groups=8, engines=2), inp, steps=15)
        assert res.staleness_max <= staleness and res.stale_groups == 0


def test_heavy_tails_make_sync_wait_and_async_hide_it():
    inp = _inputs(train_tokens_per_s=20000.0)
    heavy = Lengths(24, 1.0, 240, "test")
    sync = simulate(_dep("sync", 0, groups=8, lengths=heavy), inp, steps=12)
    fasync = simulate(_dep("fully_async", 2, groups=8, lengths=heavy), inp, steps=12)
    assert fasync.step_s < sync.step_s / 1.5
    assert sync.engine_idle_frac > fasync.engine_idle_frac


def test_lengths_fitted_from_a_runs_metrics(tmp_path):
    from miles.plan import lengths_from_metrics
    rng = np.random.default_rng(0)
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for step in range(300):  # 32 samples per step, log-normal median 24, sigma 1
            lengths = 24 * rng.lognormal(0.0, 1.0, 32)
            f.write(json.dumps({"kind": "train", "step": step + 1, "train/samples": 32.0,
                                "rollout/response_len": float(lengths.mean())}) + "\n")
            f.write(json.dumps({"kind": "actors", "step": step + 1}) + "\n")
    fit = lengths_from_metrics(str(path), cap=10_000)
    assert fit.sigma == pytest.approx(1.0, abs=0.15) and fit.median == pytest.approx(24, rel=0.2)
    assert str(path) in fit.source and fit.cap == 10_000
    out = miles("plan", "recipes/quickstart.toml", "--lengths-from", str(path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["lengths"]["source"] == fit.source
    path.write_text(json.dumps({"kind": "train", "rollout/response_len": 3.0}) + "\n")
    with pytest.raises(PlanError, match=r"--lengths-from = .*: expected at least 2 training steps"):
        lengths_from_metrics(str(path), cap=6)


def test_calibration_fits_the_trainers_fixed_cost_and_its_per_token_rate():
    """bench/plan_calibrate.py's trainer figure: a step proportional to its tokens (a CPU) has no
    fixed term; a flat one (a small model on a GPU) has no per-token term; a mix is split."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_calibrate", ROOT / "bench" / "plan_calibrate.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    tokens = [400, 900, 1500, 2200, 4100]
    rows = lambda f: [{"train/tokens": t, "train/step_s": f(t)} for t in tokens]  # noqa: E731
    fixed, per_tok = cal.train_fit(rows(lambda t: t / 9000))
    assert fixed == pytest.approx(0.0, abs=1e-9) and 1 / per_tok == pytest.approx(9000)
    fixed, per_tok = cal.train_fit(rows(lambda t: 0.24 - 1e-6 * (t % 7)))
    assert per_tok == 0.0 and fixed == pytest.approx(0.24, abs=1e-4)
    fixed, per_tok = cal.train_fit(rows(lambda t: 0.1 + t / 20000))
    assert fixed == pytest.approx(0.1) and 1 / per_tok == pytest.approx(20000)
