"""recipes/quant/quickstart.toml: every format checks, and a real run trains INT4-QAT with every
publish checked bit for bit and the trainer agreeing with the INT4 rollout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "quant" / "quickstart.toml"


def _cli(*args, timeout_s=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("rollout", ["bf16", "fp8", "mxfp8", "mxfp4", "nvfp4", "int4"])
def test_every_format_checks(rollout):
    r = _cli("check", str(RECIPE), "--set", f'quant.rollout="{rollout}"')
    assert r.returncode == 0 and "recipe OK" in r.stdout, r.stdout + r.stderr


def test_bad_quant_settings_name_the_key():
    r = _cli("check", str(RECIPE), "--set", 'quant.train="int4_qat"')
    assert r.returncode != 0 and "quant.train" in r.stdout + r.stderr
    r = _cli("check", str(RECIPE), "--set", 'quant.rollout="fp6"')
    assert r.returncode != 0 and "quant.rollout" in r.stdout + r.stderr
    r = _cli("check", str(RECIPE), "--set", 'weights.transport="disk_delta"', "--set",
             'weights.disk_dir="versions"')
    assert r.returncode != 0 and "dequantized weights" in r.stdout + r.stderr


@pytest.mark.slow
def test_int4_qat_run_matches_its_rollout(tmp_path):
    port = cluster_port()
    sets = {"run.output_dir": json.dumps(str(tmp_path / "qat")), "run.name": '"qat"',
            "cluster.head_port": str(port), "logging.progress": "false", "loop.mode": '"sync"',
            "loop.num_steps": "3", "loop.save_every": "0", "loop.eval_every": "0", "sft.steps": "5",
            "buffer.filter": '"none"', "eval.mode": '"off"', "quant.rollout": '"int4"',
            "quant.train": '"int4_qat"'}
    args = ["run", str(RECIPE)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    r = _cli(*args, timeout_s=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "qat" / "metrics.jsonl")]
    kl = [row["train/train_rollout_kl"] for row in rows if "train/train_rollout_kl" in row]
    diff = [row["train/train_rollout_logprob_abs_diff"] for row in rows
            if "train/train_rollout_logprob_abs_diff" in row]
    assert len(kl) >= 3
    # fp32 on both sides, same version (sync): what is left is kernel rounding, not INT4 error
    assert max(kl) < 1e-6 and max(diff) < 1e-3, (kl, diff)
    log = (tmp_path / "qat" / "logs" / "trainer_0.log").read_text()
    assert log.count("published version") >= 4 and "in int4:" in log
