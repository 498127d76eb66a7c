"""Does an agentic recipe learn? RL after its warm start against the warm start alone, over seeds.

    .venv/bin/python bench/agentic_learning.py --recipe recipes/agent_quickstart.toml \\
        [--seeds 0,1,2] [--log-dir DIR] [--timeout-s 3600] [--set KEY=VALUE ...] [--rl-run SEED=DIR ...]

Prints one JSON line:
  {"bench": "agentic_learning", "recipe", "seeds", "runs": [one per seed: {"seed",
   "rl": {"curve": [[step, pass@1], ...], "start", "final", "gain", "warm_start_steps",
          "warm_start_stop", "rl_s", "wall_s", "reward_rise", "first_step_kl", ...},
   "sft_alone": {"curve": [[sft step, pass@1], ...], "start", "final", "gain", "steps",
                 "extra_s", "wall_s"}}],
   "mean": {"rl_start", "rl_final", "rl_gain", "sft_alone_gain", "rl_minus_sft_alone"},
   "min_rl_gain", "reward_rises" (every seed's), "eval", "loadavg_1m", "machine"}

Design decisions:
- Arm `rl` is the recipe as it ships, with `run.seed` = the seed: its warm start (to its held-out
  target `sft.until_heldout`, where the recipe sets one), then RL. Its curve is the run's own
  evaluations (`eval/pass@1` at each eval step); `gain` = the last one - the step-0 one.
- Arm `sft_alone` is the same recipe and seed with `loop.num_steps = 0`, whose warm start does not
  stop at the target (`sft.until_heldout = 1.0`; the held-out checks go on every
  `sft.check_every` steps and are its curve) and runs on for as long as the `rl` arm's RL took:
  `rl_s` (from the step-0 evaluation's start to the last evaluation's end, in the run's
  metrics.jsonl) divided by the `rl` arm's warm-start seconds per step (its checks included,
  at the same cadence), added to the `rl` arm's warm-start steps. With the same seed its first
  steps are the `rl` arm's warm start (the rows' order and the weights' start are the seed's). Its
  `start` is its check at the `rl` arm's last warm-start step (the `rl` arm's step-0 pass@1
  where that check did not run), its `final` the evaluation after its last step, and both arms
  report their wall times, so a reader sees they had the same budget.
- Both arms evaluate with the recipe's `[eval]` (samples per prompt, temperature, prompts): the
  same in both by construction; the line names them.
- `reward_rise`: the sampled training reward (`rollout/reward`, one value per step) rises when the
  mean of the last 5 steps exceeds the first 5 by at least 2 standard errors of that difference
  (sqrt(var_first / 5 + var_last / 5), sample variances).
- `first_step_kl`: the trainer's `ref_kl` at step 2, KL(policy || warm start) after exactly one
  RL update (logged where the recipe sets `train.use_ref_model`), beside the first steps'
  `ppo_kl`.
- `--rl-run SEED=DIR` takes a finished run of the recipe as it ships (e.g. `./run.sh RECIPE` with
  run.seed = SEED) as that seed's `rl` arm instead of running it again; the line names it
  (`reused_run`), and its wall time is the span of its run directory's files.
- Runs go one after another: on a 2-core machine two runs side by side slow each other unevenly,
  and the arms are compared by wall time. Each run has a deadline (`--timeout-s`), after which it
  is killed and the bench fails naming it; its log stays in `--log-dir`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.hostinfo import machine  # noqa: E402

RISE_STEPS = 5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(recipe: Path, sets: dict, tag: str, work: Path, timeout_s: float) -> tuple[list[dict], float]:
    """One `miles run`; its metrics rows and wall time. The log streams to WORK/<tag>.log."""
    out = work / tag
    sets = {"run.output_dir": json.dumps(str(out)), "run.name": json.dumps(tag), "loop.resume": "false",
            "logging.progress": "false", "cluster.head_port": str(_port()), **sets}
    cmd = [sys.executable, "-m", "miles.cli", "run", str(recipe)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    log_path = work / f"{tag}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{tag}: no result within --timeout-s={timeout_s:.0f} (log {log_path})") from None
    wall = time.monotonic() - t0
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{tag}: miles run exited {code} (log {log_path}):\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall


def reward_rise(rewards: list[float], n: int = RISE_STEPS) -> dict:
    """Mean of the last n steps' sampled reward against the first n, in standard errors."""
    if len(rewards) < 2 * n:
        return {"first": None, "last": None, "se": None, "rises": False, "steps": len(rewards)}
    first, last = rewards[:n], rewards[-n:]
    se = math.sqrt(statistics.variance(first) / n + statistics.variance(last) / n)
    diff = statistics.fmean(last) - statistics.fmean(first)
    return {"first": round(statistics.fmean(first), 4), "last": round(statistics.fmean(last), 4),
            "se": round(se, 4), "rises": diff >= 2 * se and diff > 0, "steps": len(rewards)}


def rl_arm(rows: list[dict], wall: float) -> dict:
    evals = sorted((r["step"], r["eval/pass@1"], r["time_s"]) for r in rows if r["kind"] == "eval")
    if not evals:
        raise RuntimeError("the rl arm logged no evaluation")
    sft = [r for r in rows if r["kind"] == "sft"]
    end = next((r for r in sft if "sft/stop" in r), None)
    train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])
    # The RL phase: from the end of the warm start (its rows are written then, just before the
    # step-0 evaluation starts) to the end of the last evaluation.
    rl_s = evals[-1][2] - (sft[-1]["time_s"] if sft else 0.0)
    kl = {r["step"]: r.get("train/ref_kl") for r in train}
    return {"curve": [[s, round(p, 4)] for s, p, _ in evals], "start": evals[0][1], "final": evals[-1][1],
            "gain": round(evals[-1][1] - evals[0][1], 4),
            "warm_start_steps": int(end["sft/steps"]) if end else 0,
            "warm_start_stop": end["sft/stop"] if end else "", "warm_start_s": round(end["sft/s"], 1) if end else 0.0,
            "rl_steps": len(train), "rl_s": round(rl_s, 1), "wall_s": round(wall, 1),
            "reward_rise": reward_rise([r["rollout/reward"] for r in train]),
            "first_step_kl": kl.get(2), "ppo_kl_first_steps": [r.get("train/ppo_kl") for r in train[:3]],
            "ref_kl_final": train[-1].get("train/ref_kl") if train else None,
            "entropy_first_last": [train[0].get("train/entropy"), train[-1].get("train/entropy")] if train else None}


def sft_alone_arm(rows: list[dict], wall: float, rl: dict, warm_steps: int, extra_s: float) -> dict:
    checks = sorted((r["step"], r["sft/heldout_pass@1"]) for r in rows
                    if r["kind"] == "sft" and "sft/heldout_pass@1" in r)
    end = next(r for r in rows if r["kind"] == "sft" and "sft/stop" in r)
    final = next(r["eval/pass@1"] for r in rows if r["kind"] == "eval")
    steps = int(end["sft/steps"])
    start = next((p for s, p in checks if s == warm_steps), rl["start"])
    curve = [[s, round(p, 4)] for s, p in checks if s >= warm_steps] + [[steps, round(final, 4)]]
    return {"curve": curve, "start": start, "final": final, "gain": round(final - start, 4), "steps": steps,
            "extra_steps": steps - warm_steps, "extra_s": round(extra_s, 1),
            "sft_s": round(end["sft/s"], 1), "wall_s": round(wall, 1)}


def finished_run(path: Path) -> tuple[list[dict], float]:
    """`--rl-run`: a finished run's metrics rows and wall time (its console's first and last
    metrics rows do not bracket the warm start, so the wall time is its files' span)."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resolved = next(path.glob("recipe.resolved*.json"))
    wall = (path / "metrics.jsonl").stat().st_mtime - resolved.stat().st_mtime
    return rows, wall


def one_seed(recipe: Path, cfg: dict, seed: int, args, work: Path) -> dict:
    sets = dict(item.partition("=")[::2] for item in args.set)
    base = {"run.seed": str(seed), **sets}
    given = dict(item.split("=", 1) for item in args.rl_run)
    if str(seed) in given:
        rows, wall = finished_run(Path(given[str(seed)]))
    else:
        rows, wall = run(recipe, base, f"seed{seed}_rl", work, args.timeout_s)
    rl = rl_arm(rows, wall)
    rl["reused_run"] = given.get(str(seed), "")
    warm = rl["warm_start_steps"]
    step_s = rl["warm_start_s"] / max(warm, 1)   # seconds per warm-start step, its checks included
    extra = max(1, math.ceil(rl["rl_s"] / step_s))
    check_every = cfg.get("sft", {}).get("check_every") or max(1, (warm + extra) // 10)
    rows, wall = run(recipe, {**base, "loop.num_steps": "0", "sft.steps": str(warm + extra),
                              "sft.until_heldout": "1.0", "sft.check_every": str(check_every)},
                     f"seed{seed}_sft_alone", work, args.timeout_s)
    alone = sft_alone_arm(rows, wall, rl, warm, rl["rl_s"])
    line = {"seed": seed, "rl": rl, "sft_alone": alone}
    print(json.dumps({"bench": "agentic_learning", "part": "seed", **line}), file=sys.stderr, flush=True)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "agent_quickstart.toml"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--log-dir", default=None, help="runs and their logs (default: a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="each run's deadline")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE, a recipe override for both arms")
    p.add_argument("--rl-run", action="append", default=[], metavar="SEED=DIR",
                   help="the rl arm of this seed is this finished `miles run` of the recipe as it ships "
                        "(run.seed = SEED), not run again")
    args = p.parse_args()
    recipe = Path(args.recipe).resolve()
    cfg = tomllib.loads(recipe.read_text())
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="agentic_learning_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = [one_seed(recipe, cfg, seed, args, work) for seed in seeds]

    def mean(path: tuple[str, str]) -> float:
        return round(statistics.fmean(r[path[0]][path[1]] for r in runs), 4)
    rl_gain, alone_gain = mean(("rl", "gain")), mean(("sft_alone", "gain"))
    ev = cfg.get("eval", {})
    print(json.dumps({
        "bench": "agentic_learning", "recipe": str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT)
        else str(recipe), "seeds": seeds, "runs": runs,
        "mean": {"rl_start": mean(("rl", "start")), "rl_final": mean(("rl", "final")), "rl_gain": rl_gain,
                 "sft_alone_final": mean(("sft_alone", "final")), "sft_alone_gain": alone_gain,
                 "rl_minus_sft_alone": round(rl_gain - alone_gain, 4),
                 "rl_wall_s": mean(("rl", "wall_s")), "sft_alone_wall_s": mean(("sft_alone", "wall_s"))},
        "min_rl_gain": min(r["rl"]["gain"] for r in runs),
        "reward_rises": [r["rl"]["reward_rise"]["rises"] for r in runs],
        "eval": {"samples_per_prompt": ev.get("samples_per_prompt", 1), "temperature": ev.get("temperature", 0.0),
                 "n_prompts": ev.get("n_prompts", 0)},
        "overrides": args.set, "bench_s": round(time.monotonic() - t0, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2), "machine": machine()}), flush=True)


if __name__ == "__main__":
    main()
