"""The Megatron backend with real processes on gloo: TP=2 (with and without sequence parallelism;
Qwen3-MoE with it), PP=2, EP=2 (Qwen3-MoE) and context parallelism (CP=2; with EP=2 over the CP
ranks; and TP=2 x SP x CP=2 on four ranks) each train one
step whose loss, grad norm and every gradient equal one unsharded, unpacked step of the plain HF
model (fp32; tolerance below), refuse bad batches on every rank, stream the same tensors as their
HF export, resume bit-exactly after save -> sleep/wake; weights reach an embedded engine checked
by sha256; the quickstart learns with `train.backend = "megatron"`.

megatron_worker.py runs each layout's whole list in one process pair and asserts as it goes; the
figures it reports are checked again here so a failure names what broke.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from backend_helpers import REPO, run_ranks

from miles.tiny import build_tiny_model
from tests.ports import cluster_port

WORKER = Path(__file__).with_name("megatron_worker.py")
# fp32 on gloo: only the summation order differs from the unsharded step (measured 4.8e-7 - 7.7e-7).
GRAD_RTOL = 1e-5


# tp2, ep2_moe, tp2_sp, tp2_sp_moe and cp2 are each covered axis by axis by cp2_ep2_moe and
# tp2_sp_cp2_moe (1-2 min each on 2 cores): `extended`, run with MILES_TEST_EXTENDED=1.
EXT = pytest.mark.extended


@pytest.mark.parametrize("arch,sizes,world", [
    pytest.param("qwen3", "2,1,1", 2, id="tp2", marks=EXT),
    pytest.param("qwen3", "1,2,1", 2, id="pp2"),
    pytest.param("qwen3_moe", "1,1,2", 2, id="ep2_moe", marks=EXT),
    pytest.param("qwen3", "2,1,1,sp", 2, id="tp2_sp", marks=EXT),
    pytest.param("qwen3_moe", "2,1,1,sp", 2, id="tp2_sp_moe", marks=EXT),
    pytest.param("qwen3", "1,1,1,cp2", 2, id="cp2", marks=EXT),
    pytest.param("qwen3_moe", "1,1,2,cp2", 2, id="cp2_ep2_moe"),
    pytest.param("qwen3_moe", "2,1,1,sp,cp2", 4, id="tp2_sp_cp2_moe")])
def test_megatron_layout_matches_the_unsharded_step(arch, sizes, world, tmp_path):
    ranks = run_ranks(f"layout:{arch}:{sizes}", tmp_path, world_size=world, timeout_s=400, worker=WORKER)
    zero = ranks[0]
    assert zero["grad_rel_err_max"] < GRAD_RTOL, (zero["grad_rel_err_worst"], zero["grad_rel_err_max"])
    assert zero["grad_norm_rel_err"] < GRAD_RTOL
    assert zero["loss_abs_err"] < 1e-6
    # every rank returns the same metrics, with the FSDP backend's keys
    assert all(r["metrics"] == ranks[0]["metrics"] for r in ranks)
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "lr", "tokens",
                "train_rollout_logprob_abs_diff", "train_rollout_kl", "skipped_steps", "samples"):
        assert key in zero["metrics"], key
    assert zero["metrics"]["tokens"] > 0
    assert "sample 5" in zero["error_nan_reward"] and "reward" in zero["error_nan_reward"]
    assert "loss_mask" in ranks[1]["error_mask"]
    assert "differs between trainer ranks" in ranks[1]["error_ranks"]
    assert zero["update_buckets"] > 2 and zero["update_tensors"] >= 20
    losses = zero["sft_losses"]
    assert losses[0] > losses[1] > losses[2] > losses[3], losses
    opts = zero["options"]
    assert opts["kl"][1] > opts["kl"][0] >= 0
    assert opts["bf16_losses"][2] < opts["bf16_losses"][0]
    none, full = opts["recompute_grad_norms"]
    assert abs(none - full) <= 1e-6 * none


def test_megatron_weights_reach_an_embedded_engine_checked(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "weights"))
    from weights_helpers import start_engines, stop_engines

    path = build_tiny_model(arch="qwen3")

    async def scenario():
        engines = await start_engines(path, 1, tmp_path)
        try:
            os.environ["ENGINE_URL"] = engines[0].url
            return await asyncio.to_thread(run_ranks, "engine:qwen3:2,1,1", tmp_path, world_size=2,
                                           timeout_s=280, worker=WORKER)
        finally:
            os.environ.pop("ENGINE_URL", None)
            await stop_engines(engines)

    zero = asyncio.run(scenario())[0]
    assert zero["report"]["checked"] and zero["report"]["tensors"] >= 20, zero["report"]
    assert zero["version"] == "1"
    assert zero["checksums_equal_export"]
    assert zero["greedy_published"] == zero["greedy_export"] and len(zero["greedy_export"]) == 16


def test_megatron_layout_must_fit_the_trainer_ranks(tmp_path):
    from miles.config import RecipeError, load_recipe

    recipe = REPO / "recipes" / "quickstart.toml"
    with pytest.raises(RecipeError, match=r"tp\*pp\*cp = 2\*1\*1 = 2 does not divide the 1 trainer ranks"):
        load_recipe(recipe, ['train.backend="megatron"', "train.megatron.tp=2"])
    load_recipe(recipe, ['train.backend="megatron"'])  # one rank, TP=1: fits


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_learns_with_megatron(tmp_path):
    """The quickstart, shortened, with only the backend switched: held-out reward rises. 60 steps:
    since the seeded sampler and the reshuffled warm start (2026-12-07) the quickstart's held-out
    moves little in its first 40 steps (FSDP: 0.47, 0.48 at 20, 0.52 at 40, 0.61 at 60; Megatron
    0.47 -> 0.51-0.54 at 40), so 40 steps could not show the +0.1."""
    out = tmp_path / "qs"
    args = [sys.executable, "-m", "miles.cli", "run", str(REPO / "recipes" / "quickstart.toml"),
            "--set", 'train.backend="megatron"', "--set", "loop.num_steps=60", "--set", "loop.eval_every=30",
            "--set", "loop.save_every=0", "--set", f"run.output_dir={json.dumps(str(out))}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={cluster_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(x) for x in lines if '"kind": "eval"' in x]
    train = [json.loads(x) for x in lines if '"kind": "train"' in x]
    assert [e["step"] for e in evals] == [0, 30, 60]
    assert [r["step"] for r in train] == list(range(1, 61))
    assert max(e["eval/reward"] for e in evals[1:]) >= evals[0]["eval/reward"] + 0.1, evals
    print(json.dumps({"megatron_quickstart_eval": [(e["step"], e["eval/reward"]) for e in evals]}))
