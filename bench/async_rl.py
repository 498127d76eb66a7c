"""Sync vs fully-async RL with heavy-tailed response lengths, same hardware and samples per step.

Prints one JSON line per mode:
  {"bench": "async_rl", "mode", "step_s", "trainer_idle_frac", "engine_idle_frac", "avg_staleness",
   "speedup_vs_sync", "final_reward", "machine", ...}

Each run is the real loop (`miles run`, the quickstart recipe with overrides): embedded engines
behind smg, FSDP2, weights published after every step. Response lengths are drawn per sample from
a log-normal (median `--median-tokens`, sigma 1, capped at 10x the median) by a rollout-worker
plug-in that sets `max_new_tokens` and `ignore_eos`, so a few samples are ~10x longer than most:
the straggler pattern of agentic and reasoning rollouts.

  .venv/bin/python bench/async_rl.py [--steps 8] [--median-tokens 24] [--device cpu|cuda]
      [--engine-device cuda:1] [--model tiny|small] [--max-staleness 2[,3]] [--log-dir DIR]
      [--set KEY=VALUE ...]

Beside the loop's figures each line carries the engine's own view, parsed from its periodic stats
lines (`engine_decode_batch`, `engine_ms_per_decode`, `engine_prefill_frac`, `engine_paused_frac`),
and the same decode and prefill times measured on the engine's compute thread alone
(`engine_ms_per_decode_compute`, `engine_prefill_compute_frac`). `cpu_util` is the share of all
the machine's cores busy over the same steady-state window (Linux /proc/stat): on a CPU-only
machine, where engine and trainer share the cores, it says how close a mode runs to the hardware.

`--reward-curve` instead runs the quickstart recipe as it ships (its task learns) in both modes
for each of `--seeds`, and compares their held-out reward curves against seed-to-seed noise
(one line per mode, then a `reward_curve_compare` line; a PNG of the curves in `--log-dir`).

Design decisions:
- The answer is scored on the response up to its first special token (EOS, `<|im_end|>`): the
  forced tail after it is what the length distribution adds, not what the model answered, so
  `final_reward` stays meaningful (it is the quickstart's task) while every sample still costs its
  drawn length in the engine and the trainer. The tail is kept in the sample with loss mask 0, so
  training time counts it but the policy is not pushed towards or away from it.
- `weights.check_weights` is off (its default; the quickstart turns it on to show the proof): the
  engine's sha256 of every parameter holds its step lock, so in fully-async mode it stalls
  generation once per step, which is a verification cost, not the loop's.
- Each mode's stdout/stderr stream into a log file while it runs (`--log-dir`, else the run's
  temporary directory), so a run killed by a timeout still leaves its log; a failure quotes its
  tail. On timeout the run gets SIGTERM (the node daemon then stops its children), SIGKILL later.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from miles.actors.rollout import RolloutWorker

ROOT = Path(__file__).resolve().parents[1]


class HeavyTailWorker(RolloutWorker):
    """Draws each sample's length from a log-normal; generation ignores EOS to reach it.

    The reward sees the answer up to the first special token; the forced tail has loss mask 0.
    """

    async def generate_sample(self, sample, seed):
        opts = self.recipe.actors["rollout"].options
        median, cap = int(opts.get("median_tokens", 24)), int(opts.get("cap_factor", 10))
        rng = np.random.default_rng(seed)
        length = int(min(median * cap, max(1, round(median * rng.lognormal(0.0, 1.0)))))
        saved = self.cfg
        self.cfg = _with(saved, max_new_tokens=length, ignore_eos=True)
        try:
            sample = await super().generate_sample(sample, seed)
        finally:
            self.cfg = saved
        if sample.response_length:
            response = sample.tokens[len(sample.tokens) - sample.response_length:]
            ends = np.flatnonzero(np.isin(response, list(self._answer_ends())))
            if len(ends):
                cut = int(ends[0]) + 1  # the stop token is part of the answer, as without ignore_eos
                sample.response = self.tokenizer.decode(response[:cut].tolist(), skip_special_tokens=True)
                sample.loss_mask[cut:] = 0
        return sample

    def _answer_ends(self) -> set[int]:
        if not hasattr(self, "_ends"):
            self._ends = set(self.tokenizer.all_special_ids) | set(self.cfg.stop_token_ids or ())
        return self._ends


# Model shapes on top of the quickstart's tiny Qwen3 (its 512-token vocabulary stays). "small" is
# ~0.2B parameters: on a GPU its decode step costs about the same at batch 1 and at batch 64, as
# for real models, where the tiny model's step is launch-bound Python.
MODELS = {
    "tiny": {},
    "small": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64, intermediate_size=3072),
}


def _with(cfg, **changes):
    import msgspec
    return msgspec.structs.replace(cfg, **changes)


def _tail(path: Path, n_bytes: int = 3000) -> str:
    data = path.read_bytes()
    return data[-n_bytes:].decode(errors="replace")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(sets: dict, tag: str, out: Path, args) -> tuple[list[dict], float, dict]:
    """`miles run` the quickstart recipe with `sets` overrides; returns its metrics rows, wall time
    and the machine's CPU counters (/proc/stat, Linux) read as each training step was logged.

    Output streams into DIR/async_rl_<tag>.log (`--log-dir`, else `out`) while it runs; the engine
    log and the metrics are copied beside it."""
    cmd = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    log_path = Path(args.log_dir or out) / f"async_rl_{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            cpu_at_step = _watch_steps(proc, out / "metrics.jsonl", t0 + args.timeout_s)
            returncode = proc.wait(timeout=max(1.0, t0 + args.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"{tag} run timed out after {args.timeout_s:.0f} s (log: {log_path}):\n"
                               f"{_tail(log_path)}") from None
    wall = time.monotonic() - t0
    for name in ("logs/engine0.log", "metrics.jsonl"):  # kept beside the run's log, for diagnosis
        if (out / name).exists() and args.log_dir:
            shutil.copy(out / name, Path(args.log_dir) / f"async_rl_{tag}_{Path(name).name}")
    if returncode != 0:
        raise RuntimeError(f"{tag} run failed ({returncode}, log: {log_path}):\n{_tail(log_path)}")
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()], wall, cpu_at_step


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def _watch_steps(proc, metrics: Path, deadline: float) -> dict:
    """Poll the run's metrics every 50 ms until it exits; at each newly logged training step read
    the CPU counters. Returns {step index (0-based, in log order): (busy, total)}."""
    seen, offset, buf = {}, 0, b""
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        if metrics.exists():
            with open(metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            now = _cpu_jiffies()
            for line in lines:
                if line and json.loads(line).get("kind") == "train" and now is not None:
                    seen[len(seen)] = now
        time.sleep(0.05)
    return seen


def _cpu_util(cpu_at_step: dict, first: int, last: int) -> float | None:
    """Fraction of all cores busy between two logged training steps (the whole machine: on a
    dedicated one, that is the run's processes)."""
    if first not in cpu_at_step or last not in cpu_at_step:
        return None
    (b0, t0), (b1, t1) = cpu_at_step[first], cpu_at_step[last]
    return round((b1 - b0) / (t1 - t0), 3) if t1 > t0 else None


def run_mode(mode: str, args, out: Path, max_staleness: int) -> dict:
    sets = {
        "run.output_dir": json.dumps(str(out)), "run.name": json.dumps(f"async_rl_{mode}"),
        "loop.mode": json.dumps(mode), "loop.num_steps": args.steps,
        # sync means staleness 0; the recipe refuses a contradicting explicit value
        "loop.max_staleness": 0 if mode == "sync" else max_staleness,
        "loop.groups_per_step": args.groups, "loop.eval_every": 0, "loop.save_every": 0, "loop.resume": "false",
        "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": args.median_tokens * 10,
        "rollout.max_inflight_samples": 256, "buffer.filter": json.dumps("none"), "sft.steps": args.sft_steps,
        "engine.device": json.dumps(args.engine_device or args.device), "engine.max_running_requests": 256,
        "engine.context_length": 4096, "cluster.head_port": _port(), "logging.progress": "false",
        "eval.mode": json.dumps("off"), "weights.check_weights": "false",
        "engine.extra_args": '["--log-stats-interval-s", "2"]',
        "actors.rollout": '{class = "async_rl:HeavyTailWorker", options = {median_tokens = %d}}' % args.median_tokens,
    }
    if args.device == "cuda":
        sets.update({"engine.dtype": json.dumps("bfloat16"), "train.param_dtype": json.dumps("bfloat16")})
    for item in args.set:  # --set KEY=VALUE: any other recipe override, last
        key, _, value = item.partition("=")
        sets[key] = value
    if args.model != "tiny":
        sets["model.tiny_overrides"] = "{%s}" % ", ".join(f"{k} = {v}" for k, v in MODELS[args.model].items())
    tag = mode if mode == "sync" else f"{mode}_s{max_staleness}"
    rows, wall, cpu_at_step = run_recipe(sets, tag, out, args)
    train = [r for r in rows if r["kind"] == "train"]
    actors = [r for r in rows if r["kind"] == "actors"]
    # Steady state: from the end of step 1 to the end of the last step (start-up and the first
    # batch, identical for both modes, are excluded).
    span = train[-1]["time_s"] - train[0]["time_s"]
    steps = len(train) - 1
    last, first = actors[-1], actors[0]
    trainer_idle = last["buffer/trainer_wait_s"] - first["buffer/trainer_wait_s"]
    engine_idle = last["rollout/engine_idle_s"] - first["rollout/engine_idle_s"]
    engine = engine_summary(out / "logs" / "engine0.log")
    return {"bench": "async_rl", "mode": mode, "step_s": round(span / steps, 3),
            "trainer_idle_frac": round(min(1.0, trainer_idle / span), 3),
            "engine_idle_frac": round(min(1.0, engine_idle / span), 3),
            "avg_staleness": round(float(np.mean([r["batch/staleness_avg"] for r in train])), 3),
            "final_reward": round(float(np.mean([r["rollout/reward"] for r in train[-3:]])), 3),
            "train_s": round(float(np.mean([r["perf/train_s"] for r in train[1:]])), 3),
            "publish_s": round(float(np.mean([r["perf/step_s"] - r["perf/train_s"] for r in train[1:]])), 3),
            "response_len": round(float(np.mean([r["rollout/response_len"] for r in train])), 1),
            "samples_per_step": args.groups * 4, "steps": len(train), "wall_s": round(wall, 1),
            "cpu_util": _cpu_util(cpu_at_step, 0, min(len(train) - 1, max(cpu_at_step, default=0))), **engine}


STATS = re.compile(r"engine stats over ([\d.]+) s: decode (\d+) steps, batch ([\d.]+), ([\d.]+) ms/step "
                   r"\| prefill (\d+) \((\d+) requests, ([\d.]+) ms\) \| paused ([\d.]+) ms, idle ([\d.]+) ms"
                   r".*? compute thread: decode ([\d.]+) ms/step, prefill ([\d.]+) ms"
                   r"(?: \| context ([\d.]+) tokens/step)?")


def stats_windows(text: str) -> list[tuple[float, ...]]:
    """The engine's stats lines as tuples: seconds, decode steps, batch, ms/step, prefills,
    prefill requests, prefill ms, paused ms, idle ms, compute ms/step, compute prefill ms, and
    the context tokens summed over the batch per decode step (0 in logs from before it)."""
    return [tuple(float(x or 0.0) for x in m.groups()) for m in STATS.finditer(text)]


def engine_summary(log_path: Path) -> dict:
    """The engine's own view from its periodic stats lines (every 2 s; windows that decoded
    nothing, like the warm-up, are skipped): mean decode batch, ms per decode step, and the share
    of its time in prefill, paused and idle."""
    if not log_path.exists():
        return {}
    rows = stats_windows(log_path.read_text(errors="replace"))
    rows = [r for r in rows if r[1] > 0]
    if not rows:
        return {}
    secs, steps = sum(r[0] for r in rows), sum(r[1] for r in rows)
    return {"engine_decode_batch": round(sum(r[1] * r[2] for r in rows) / steps, 1),
            "engine_ms_per_decode": round(sum(r[1] * r[3] for r in rows) / steps, 2),
            "engine_prefill_frac": round(sum(r[6] for r in rows) / 1e3 / secs, 3),
            "engine_paused_frac": round(sum(r[7] for r in rows) / 1e3 / secs, 3),
            "engine_idle_frac_log": round(sum(r[8] for r in rows) / 1e3 / secs, 3),
            # the same steps' forward and sampling alone: the rest of a step's wall time is the
            # scheduler's bookkeeping and, where steps run on the compute thread (CUDA), the hop
            "engine_ms_per_decode_compute": round(sum(r[1] * r[9] for r in rows) / steps, 2),
            "engine_prefill_compute_frac": round(sum(r[10] for r in rows) / 1e3 / secs, 3)}


def reward_curves(args, machine: str) -> list[dict]:
    """The quickstart as it ships (a task that learns: held-out reward ~0.4 -> ~0.8 in 150 steps)
    in sync and in fully-async mode, once per seed; its eval (100 held-out prompts, greedy, every
    10 steps) is the curve. Returns one line per mode and a comparison line."""
    seeds = [int(x) for x in str(args.seeds).split(",")]
    bound = int(str(args.max_staleness).split(",")[0])
    curves: dict[str, list[dict[int, float]]] = {"sync": [], "fully_async": []}
    walls: dict[str, list[float]] = {"sync": [], "fully_async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for mode in curves:
                out = Path(tmp) / f"curve_{mode}_seed{seed}"
                sets = {"run.output_dir": json.dumps(str(out)), "run.seed": seed, "loop.mode": json.dumps(mode),
                        "loop.num_steps": args.curve_steps,
                        "loop.max_staleness": 0 if mode == "sync" else bound, "loop.resume": "false",
                        "loop.save_every": 0, "cluster.head_port": _port(), "logging.progress": "false",
                        "logging.plot": "false", "weights.check_weights": "false"}
                sets.update(item.partition("=")[::2] for item in args.set)  # --set: last, as above
                rows, wall, _ = run_recipe(sets, f"curve_{mode}_seed{seed}", out, args)
                curves[mode].append({r["step"]: r["eval/reward"] for r in rows if r["kind"] == "eval"})
                walls[mode].append(wall)
    steps = sorted(set.intersection(*(set(c) for runs in curves.values() for c in runs)))
    table = {m: np.array([[c[s] for s in steps] for c in runs]) for m, runs in curves.items()}  # [seed, step]
    last = max(1, len(steps) // 3)  # "final": the mean of the last third of the curve
    lines = []
    for mode, t in table.items():
        lines.append({"bench": "async_rl", "part": "reward_curve", "mode": mode,
                      "max_staleness": 0 if mode == "sync" else bound, "seeds": seeds, "eval_steps": steps,
                      "eval_reward_mean": [round(float(x), 3) for x in t.mean(0)],
                      "eval_reward_per_seed": [[round(float(x), 3) for x in row] for row in t],
                      "start_eval_reward": round(float(t[:, 0].mean()), 3),
                      "final_eval_reward": round(float(t[:, -last:].mean()), 3),
                      "wall_s": round(float(np.mean(walls[mode])), 1), "machine": machine})
    lines.append({"bench": "async_rl", "part": "reward_curve_compare", "max_staleness": bound, "seeds": seeds,
                  **compare_curves(table["sync"], table["fully_async"], last), "machine": machine})
    if args.log_dir:
        _plot_curves(steps, table, Path(args.log_dir) / "async_rl_reward_curves.png")
    return lines


def compare_curves(sync: np.ndarray, fully_async: np.ndarray, last: int) -> dict:
    """Two modes' reward curves, each [seed, eval point], over their last `last` points.

    Noise is how far two runs of the same mode land apart: the seed-to-seed standard deviation of
    each run's final reward, pooled over both modes, gives the standard error of the difference
    of the two modes' means; "within noise" is a difference under two of those (None with one
    seed, where there is no noise estimate)."""
    finals = [sync[:, -last:].mean(1), fully_async[:, -last:].mean(1)]
    diff = float(finals[1].mean() - finals[0].mean())
    n = len(finals[0])
    out = {"final_diff": round(diff, 3), "curve_mean_diff": round(float(fully_async.mean() - sync.mean()), 3),
           "seed_sd": None, "diff_se": None, "within_noise": None}
    if n > 1:
        sd = float(np.sqrt((finals[0].var(ddof=1) + finals[1].var(ddof=1)) / 2))
        se = sd * float(np.sqrt(2 / n))
        out.update(seed_sd=round(sd, 3), diff_se=round(se, 3), within_noise=bool(abs(diff) <= 2 * se))
    return out


def _plot_curves(steps, table, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (mode, t), color in zip(table.items(), ("tab:blue", "tab:orange")):
        for row in t:
            ax.plot(steps, row, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, t.mean(0), color=color, linewidth=2, label=f"{mode} (mean of {len(t)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward (greedy)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--max-staleness", default="2",
                    help="fully-async's bound; a comma list (e.g. 2,3) runs fully-async once per value")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: the quickstart model; small: ~0.2B (for GPUs)")
    ap.add_argument("--median-tokens", type=int, default=24)
    ap.add_argument("--sft-steps", type=int, default=50,
                    help="supervised warm-start (the quickstart's 50 teach the answer format)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-device", default=None, help="e.g. cuda:1 (NCCL needs distinct GPUs)")
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another recipe override for both modes (TOML value), e.g. train.compile=false")
    ap.add_argument("--log-dir", default=None,
                    help="stream each mode's output to DIR/async_rl_<mode>.log while it runs")
    ap.add_argument("--reward-curve", action="store_true",
                    help="instead: the quickstart's held-out reward curve, sync vs fully-async, per seed")
    ap.add_argument("--seeds", default="0,1,2", help="--reward-curve: one run per mode and seed")
    ap.add_argument("--curve-steps", type=int, default=150, help="--reward-curve: steps per run")
    args = ap.parse_args()
    machine = f"{platform.machine()} {os.cpu_count()} cpu" + (
        f", {args.device}" if args.device != "cpu" else "")
    if args.reward_curve:
        for line in reward_curves(args, machine):
            print(json.dumps(line), flush=True)
        return
    bounds = [int(b) for b in str(args.max_staleness).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_mode("sync", args, Path(tmp) / "sync", bounds[0])
        runs = [(0, sync)] + [(b, run_mode("fully_async", args, Path(tmp) / f"fully_async_s{b}", b)) for b in bounds]
    for bound, res in runs:
        res["speedup_vs_sync"] = round(sync["step_s"] / res["step_s"], 2)
        res["machine"] = machine
        res["model"] = args.model
        res["max_staleness"] = bound
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
