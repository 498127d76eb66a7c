"""The MoE quickstart as real processes (embedded engine behind smg, FSDP2 on gloo, weights synced
every step) with R3 on: the trainer routes every recorded (token, layer) pair as the rollout did."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_moe(tmp_path, name, overrides, timeout_s=800, recipe="moe_quickstart.toml"):
    port = cluster_port()
    out = tmp_path / name
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / recipe),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={port}",
            "--set", "loop.save_every=0", "--set", "loop.eval_every=0",
            # every group trains (the digit task's early groups are mostly all-0 rewards)
            "--set", 'buffer.filter="none"', "--set", 'eval.mode="off"']
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
        raise AssertionError(f"miles run {name} still running after {timeout_s} s:\n"
                             f"{log.decode(errors='replace')[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    train = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in l] \
        if (out / "metrics.jsonl").exists() else []
    return proc.returncode, log.decode(errors="replace"), train


@pytest.mark.timeout(900)
def test_r3_routes_every_recorded_pair_as_the_rollout_did(tmp_path):
    steps, layers = 5, 2
    code, log, train = run_moe(tmp_path, "r3", ["rollout.r3=true", f"loop.num_steps={steps}",
                                                'loop.mode="sync"'])
    assert code == 0, log[-3000:]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["train/routing_agreement"] == 1.0, r         # replayed: 100% of (token, layer) pairs
        # one sentinel row per sample and layer (its last token): every sample had T - 1 rows
        assert r["train/routing_replay_sentinel_rows"] == r["train/samples"] * layers, r
        # sync mode, fp32 engine and trainer: the trainer's own routing is the engine's (alignment)
        assert r["train/routing_native_agreement"] > 0.99, r


@pytest.mark.timeout(900)
def test_capture_only_measures_agreement_without_replaying(tmp_path):
    code, log, train = run_moe(tmp_path, "capture", ["rollout.return_routed_experts=true", "loop.num_steps=4"])
    assert code == 0, log[-3000:]
    assert len(train) == 4
    for r in train:
        assert r["train/routing_agreement"] == r["train/routing_native_agreement"] <= 1.0
        assert "train/routing_replay_sentinel_rows" not in r    # nothing replayed


@pytest.mark.timeout(900)
def test_r3_through_agent_sessions(tmp_path):
    """The agent quickstart on the tiny MoE: each episode's turns record routing incrementally in
    the session server (`routed_experts_start_len`), collect stitches it over prompt, model and
    tool tokens, and the trainer replays it (a sample without it would be refused)."""
    code, log, train = run_moe(tmp_path, "agent", [
        "rollout.r3=true", 'model.tiny="qwen3_moe"', "loop.num_steps=2", "sft.steps=20",
        "sft.until_heldout=0"],
        recipe="agent_quickstart.toml")
    assert code == 0, log[-3000:]
    assert len(train) == 2
    for r in train:
        assert r["train/routing_agreement"] == 1.0, r
        assert r["train/routing_replay_sentinel_rows"] == r["train/samples"] * 2, r
        assert r["train/routing_native_agreement"] > 0.95, r     # multi-turn alignment, fp32 both


@pytest.mark.timeout(900)
def test_r3_on_megatron_with_context_and_expert_parallel_ranks(tmp_path):
    """The MoE quickstart trained by Megatron on two ranks that split each row by context
    parallelism and the experts by EP (megatron_cp.py): engine -> driver -> both ranks, each
    replaying the routing of the tokens it holds; weights go back to the engine checked."""
    steps, layers = 4, 2
    code, log, train = run_moe(tmp_path, "megatron_cp", [
        "rollout.r3=true", f"loop.num_steps={steps}", 'loop.mode="sync"', 'train.backend="megatron"',
        "train.megatron.cp=2", "train.megatron.ep=2", 'actors.trainer.class="miles.actors.trainer:Trainer"',
        "actors.trainer.distributed=true", "actors.trainer.procs_per_node=2",
        'actors.trainer.env={OMP_NUM_THREADS="1"}'])
    assert code == 0, log[-3000:]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["train/routing_agreement"] == 1.0, r
        # each sample's last token, plus the padding that cuts a row into 2 x cp chunks
        assert r["train/routing_replay_sentinel_rows"] >= r["train/samples"] * layers, r
        assert r["train/routing_native_agreement"] > 0.99, r
        assert r["weights/stall_s"] > 0, r   # published (check_weights: the engine's checksums matched)
