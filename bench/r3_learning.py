"""R3 and learning: the MoE quickstart (recipes/moe_quickstart.toml) with `rollout.r3` off and on,
over several seeds, run side by side; does replaying the rollout's routing keep (or improve) the
reward curve?

Prints one JSON line per run, then a summary line:
  {"bench": "r3_learning", "part": "run", "seed", "r3", "eval": {step: held-out reward},
   "final", "last3", "logprob_abs_diff", "train_rollout_kl", "routing_agreement", "wall_s"}
  {"bench": "r3_learning", "part": "summary", "off": {...}, "on": {...}, "diff_last3",
   "noise_last3", "within_noise", "machine"}

- Each arm's figure is the mean over seeds of `last3`: the mean held-out reward (64 prompts,
  greedy; `eval/reward`) of the run's last three evaluations, which damps one eval's wobble.
- Noise: the standard error of the difference of the two arms' means,
  sqrt(sd_off^2 / n + sd_on^2 / n) over seeds; `within_noise` = on >= off - 2 x that.
  The baseline is R3 off, measured in the same run with the same seeds.
- `logprob_abs_diff` / `train_rollout_kl` are the trainer's mean over the run's steps of
  `train/train_rollout_logprob_abs_diff` and `train/train_rollout_kl`, with and without replay;
  `routing_agreement` the trainer's routing against the rollout's (1.0 with replay).
- Runs go `--parallel` at a time, each with `--threads` torch threads (OMP_NUM_THREADS) and the
  engine on one thread; every run has a deadline (`--timeout-s`), past which it is killed and
  the bench fails naming it.

Usage: .venv/bin/python bench/r3_learning.py [--seeds 0,1,2] [--steps 150] [--parallel 6]
       [--threads 2] [--log-dir DIR] [--timeout-s 1500]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.hostinfo import machine  # noqa: E402

RECIPE = ROOT / "recipes" / "moe_quickstart.toml"


def run(seed: int, r3: bool, args: argparse.Namespace, work: Path) -> dict:
    """One `miles run` of the MoE quickstart; its per-run JSON line."""
    tag = f"seed{seed}_r3{'on' if r3 else 'off'}"
    out = work / tag
    sets = {"run.seed": str(seed), "rollout.r3": "true" if r3 else "false", "run.output_dir": json.dumps(str(out)),
            "loop.num_steps": str(args.steps), "loop.save_every": "0", "loop.resume": "false",
            "logging.progress": "false", "engine.torch_threads": "1",
            "cluster.head_port": str(20000 + 100 * seed + 50 * r3 + os.getpid() % 40)}
    cmd = [sys.executable, "-m", "miles.cli", "run", str(RECIPE)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    log_path = work / f"{tag}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{tag}: no result within --timeout-s={args.timeout_s} (log {log_path})") from None
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{tag}: miles run exited {code} (log {log_path}):\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {r["step"]: r["eval/reward"] for r in rows if r.get("kind") == "eval" and "eval/reward" in r}
    train = [r for r in rows if r.get("kind") == "train"]

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in train if key in r]
        return statistics.fmean(values) if values else None
    steps = sorted(evals)
    return {"bench": "r3_learning", "part": "run", "seed": seed, "r3": r3,
            "eval": {str(s): evals[s] for s in steps}, "final": evals[steps[-1]] if steps else None,
            "last3": statistics.fmean(evals[s] for s in steps[-3:]) if steps else None,
            "logprob_abs_diff": mean_of("train/train_rollout_logprob_abs_diff"),
            "train_rollout_kl": mean_of("train/train_rollout_kl"),
            "routing_agreement": mean_of("train/routing_agreement"),
            "wall_s": round(time.monotonic() - t0, 1)}


def arm(runs: list[dict]) -> dict:
    last3 = [r["last3"] for r in runs]
    keys = ("logprob_abs_diff", "train_rollout_kl", "routing_agreement")
    return {"seeds": [r["seed"] for r in runs], "last3": last3, "mean_last3": statistics.fmean(last3),
            "sd_last3": statistics.stdev(last3) if len(last3) > 1 else 0.0,
            "mean_final": statistics.fmean(r["final"] for r in runs),
            "start": statistics.fmean(r["eval"][min(r["eval"], key=int)] for r in runs),
            **{k: statistics.fmean(r[k] for r in runs if r[k] is not None)
               if any(r[k] is not None for r in runs) else None for k in keys}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--parallel", type=int, default=max(1, min(6, (os.cpu_count() or 2) // 2)))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=1500.0)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="r3_learning_"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(s, r3) for s in seeds for r3 in (False, True)]
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run, s, r3, args, work) for s, r3 in jobs]
        results = []
        for f in futures:
            results.append(f.result())
            print(json.dumps(results[-1]), flush=True)
    off = arm([r for r in results if not r["r3"]])
    on = arm([r for r in results if r["r3"]])
    noise = math.sqrt(off["sd_last3"] ** 2 / len(seeds) + on["sd_last3"] ** 2 / len(seeds))
    diff = on["mean_last3"] - off["mean_last3"]
    print(json.dumps({"bench": "r3_learning", "part": "summary", "steps": args.steps, "off": off, "on": on,
                      "diff_last3": diff, "noise_last3": noise, "within_noise": diff >= -2 * noise,
                      "parallel": args.parallel, "threads": args.threads, "machine": machine()}), flush=True)


if __name__ == "__main__":
    main()
