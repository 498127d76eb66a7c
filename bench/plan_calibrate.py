"""Calibrate `miles plan` on real runs and validate its step-time predictions.

    .venv/bin/python bench/plan_calibrate.py [--steps 10] [--only NAME,...] [--write-inputs FILE]
        [--inputs FILE] [--log-dir DIR] [--device cpu|cuda]

1. Calibration: two real `miles run`s of the quickstart with bench/async_rl.py's heavy-tail rollout
   plug-in (log-normal lengths, median 24, sigma 1, cap 240), sync and fully-async, 8 groups x 4.
   From them only component figures are read, each from the component's own timer: the engine's
   periodic stats lines (ms per decode step against the decode batch, fitted a + b x batch;
   prefill ms per request), the trainer's `train/step_s` against `train/tokens`, the weight stall
   `weights/stall_s`, the driver's remainder per step, and how much the two slow each other down
   when they share the cores (the fully-async run against the sync one).
2. Validation: other configurations (loop modes, batch sizes, response lengths, engine counts),
   each a real run, predicted three ways, never from its own step time:
   - `strict`: the calibrated figures as they are;
   - `predicted` (the headline): the calibrated figures scaled by a speed probe (a fixed
     forward/backward workload on the quickstart's model, one thread, timed just before and after
     the run against the same probe around the calibration runs): the 2-core CPU is shared with
     other jobs, and its speed moves by 2-3x within minutes;
   - `own_components`: the figures read from the validation run's own component timers (engine
     stats, trainer step, weight stall), which tests the loop model alone: admission, batching,
     stragglers, overlap.
   `--device cuda` does the same on 2 GPUs (trainer on 0, engine on 1, the 0.2B model, model size
   "small"), without the probe.

Prints one JSON line per configuration ({"bench": "plan_calibrate", "config", "measured",
"predicted", "step_err", "strict_step_err", "own_components_step_err", "speed_ratio",
"load_avg_1m"}), then a summary ({"max_abs_err", "mean_abs_err", "within_15pct", and the same for
the other two}).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from async_rl import MODELS, _port, engine_summary, run_recipe, stats_windows  # noqa: E402

CALIBRATION = [("cal_sync", "sync", 0, 8, 24, 1), ("cal_async_s2", "fully_async", 2, 8, 24, 1)]
VALIDATION = [
    ("sync_g4", "sync", 0, 4, 24, 1),
    ("sync_m48", "sync", 0, 8, 48, 1),
    ("one_step_off", "one_step_off", 1, 8, 24, 1),
    ("async_s3", "fully_async", 3, 8, 24, 1),
    ("async_g16", "fully_async", 2, 16, 24, 1),
    ("sync_e2", "sync", 0, 8, 24, 2),
    ("async_m12", "fully_async", 2, 8, 12, 1),
]


def gpu_machine(args: argparse.Namespace) -> str:
    """What the figures were measured on, in words."""
    if args.device == "cpu":
        return f"{os.cpu_count()}-core CPU"
    return "1 GPU, trainer and engine sharing it" if args.engine_device == "cuda:0" else "2 GPUs"


def recipe_sets(mode: str, staleness: int, groups: int, median: int, engines: int, steps: int,
                out: Path, device: str = "cpu", engine_device: str = "cuda:1") -> dict[str, str]:
    """bench/async_rl.py's configuration of the quickstart (its heavy-tail plug-in), varied. On
    CUDA, as `bench/async_rl.py --device cuda --engine-device cuda:1 --model small`: the trainer
    on GPU 0, the engine on GPU 1 (`engine_device`; "cuda:0" shares the trainer's GPU, both
    running at once), bf16, the ~0.2B model."""
    gpu = {} if device == "cpu" else {
        "engine.device": json.dumps(engine_device), "engine.dtype": json.dumps("bfloat16"),
        "train.param_dtype": json.dumps("bfloat16"),
        "model.tiny_overrides": "{%s}" % ", ".join(f"{k} = {v}" for k, v in MODELS["small"].items()),
        # one GPU for both: NCCL refuses two ranks on one device, so weights go by CUDA IPC
        **({"weights.transport": json.dumps("colocated")} if engine_device == "cuda:0" else {})}
    return {**_cpu_sets(mode, staleness, groups, median, engines, steps, out), **gpu}


def _cpu_sets(mode, staleness, groups, median, engines, steps, out) -> dict[str, str]:
    return {
        "run.output_dir": json.dumps(str(out)), "run.name": json.dumps(f"plan_{mode}"),
        "loop.mode": json.dumps(mode), "loop.num_steps": str(steps),
        "loop.groups_per_step": str(groups), "loop.eval_every": "0", "loop.save_every": "0",
        "loop.resume": "false", "rollout.n_samples_per_prompt": "4",
        "rollout.max_new_tokens": str(median * 10), "rollout.max_inflight_samples": "256",
        "buffer.filter": json.dumps("none"), "buffer.capacity_groups": str(max(32, 4 * groups)),
        "sft.steps": "0", "engine.device": json.dumps("cpu"), "engine.max_running_requests": "256",
        "engine.num_engines": str(engines), "engine.context_length": "4096",
        "logging.progress": "false", "logging.plot": "false", "eval.mode": json.dumps("off"),
        "weights.check_weights": "false", "engine.extra_args": '["--log-stats-interval-s", "1"]',
        "actors.rollout": '{class = "async_rl:HeavyTailWorker", options = {median_tokens = %d}}' % median,
        **({} if mode != "fully_async" else {"loop.max_staleness": str(staleness)}),
    }


def speed_probe_s(reps: int = 3) -> float:
    """Seconds for a fixed workload on the quickstart's model (a train-sized forward + backward
    and 8 decode-sized forwards), median of `reps`: how fast the shared machine is right now."""
    import torch
    from transformers import AutoModelForCausalLM
    from miles.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(arch="qwen3"))
    torch.set_num_threads(1)               # many threads on a loaded 2-core machine thrash
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (32, 40), generator=g)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids).logits.float().mean().backward()
        with torch.no_grad():
            for _ in range(8):
                model(ids[:, :8])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(name: str, sets: dict, out: Path, args) -> dict:
    """Run the configuration (unless `--from-logs`), then read its figures back from its files."""
    if args.from_logs:
        return read_run(name, Path(args.from_logs))
    sets = {**sets, "cluster.head_port": str(_port())}
    ns = argparse.Namespace(log_dir=args.log_dir, timeout_s=args.timeout_s)
    load = os.getloadavg()[0]
    gpu = args.device != "cpu"
    probe_before = 1.0 if gpu else speed_probe_s()  # GPUs are not shared: no probe
    _, wall, _ = run_recipe(sets, name, out, ns)
    probe = 1.0 if gpu else (probe_before + speed_probe_s()) / 2   # the machine's speed around the run
    (Path(args.log_dir) / f"plan_{name}.json").write_text(json.dumps(
        {"probe_s": probe, "load_avg_1m": round(load, 2), "wall_s": wall}))
    return read_run(name, Path(args.log_dir))


def read_run(name: str, log_dir: Path) -> dict:
    """A run's figures from what `--log-dir` kept: its metrics, its engine log, the probe."""
    rows = [json.loads(line) for line in (log_dir / f"async_rl_{name}_metrics.jsonl").read_text().splitlines()]
    engine_log = log_dir / f"async_rl_{name}_engine0.log"
    train = [r for r in rows if r["kind"] == "train"]
    actors = [r for r in rows if r["kind"] == "actors"]
    span = train[-1]["time_s"] - train[0]["time_s"]
    first, last = actors[0], actors[-1]
    windows = stats_windows(engine_log.read_text(errors="replace"))
    # The first two windows that decode are the warm-up (first shapes, allocator growth), as
    # step 1 is left out of the measured span.
    decoding = [w for w in windows if w[1] > 0]
    return {"rows": train, "windows": decoding[2:] if len(decoding) > 4 else decoding,
            "step_s": span / (len(train) - 1),
            "trainer_idle_frac": min(1.0, (last["buffer/trainer_wait_s"] - first["buffer/trainer_wait_s"]) / span),
            "engine_idle_frac": min(1.0, (last["rollout/engine_idle_s"] - first["rollout/engine_idle_s"]) / span),
            "staleness_mean": float(np.mean([r["batch/staleness_avg"] for r in train])),
            **json.loads((log_dir / f"plan_{name}.json").read_text()), **engine_summary(engine_log)}


def decode_fit(windows) -> tuple[float, float, float]:
    """ms per decode step = a + b x batch + c x context tokens (summed over the batch: the
    attention's KV read grows with it), least squares weighted by each window's step count;
    without the context column (older logs) or where the three-term fit is not physical, a + b x
    batch (c = 0), and with too little spread a flat cost."""
    if not windows:
        raise ValueError("no engine stats window decoded anything: the run was shorter than the "
                         "engine's stats interval (engine.extra_args --log-stats-interval-s)")
    b = np.array([w[2] for w in windows])
    ms = np.array([w[3] for w in windows])
    ctx = np.array([w[11] if len(w) > 11 else 0.0 for w in windows])
    wt = np.sqrt(np.array([w[1] for w in windows]))
    one = np.ones_like(b)
    if len(windows) >= 4 and np.ptp(b) > 2 and ctx.any():
        a, slope, per_ctx = np.linalg.lstsq(np.stack([one, b, ctx], 1) * wt[:, None], ms * wt,
                                            rcond=None)[0]
        if a > 0 and slope >= 0 and per_ctx >= 0:
            return float(a), float(slope), float(per_ctx)
    if len(windows) >= 3 and np.ptp(b) > 2:
        a, slope = np.linalg.lstsq(np.stack([one, b], 1) * wt[:, None], ms * wt, rcond=None)[0]
        if a > 0 and slope >= 0:
            return float(a), float(slope), 0.0
    mean_ms = float(np.average(ms, weights=wt ** 2))
    return mean_ms, 0.0, 0.0                  # too little spread: a flat step cost


def train_fit(rows: list[dict]) -> tuple[float, float]:
    """train/step_s = fixed + tokens x per_token, least squares over the steps (their token counts
    vary with the heavy-tailed lengths), both >= 0: on a CPU the step is proportional to its
    tokens; a small model on a GPU is launch-bound, a flat ~0.2 s whatever its 400-4,000 tokens."""
    t = np.array([r["train/tokens"] for r in rows], float)
    s = np.array([r["train/step_s"] for r in rows], float)
    if len(t) >= 3 and np.ptp(t) > 0:
        fixed, per_tok = np.linalg.lstsq(np.stack([np.ones_like(t), t], 1), s, rcond=None)[0]
        if fixed >= 0 and per_tok > 0:
            return float(fixed), float(per_tok)
        if per_tok <= 0:
            return float(s.mean()), 0.0
    return 0.0, float(s.sum() / t.sum())


def _fig(value: float, source: str) -> dict:
    return {"value": round(float(value), 7), "source": source}


def component_figures(runs: list[dict], label: str) -> dict:
    """Each component's own timers in `runs` (the first step, with its warm-up, left out): the
    engine's stats lines, the trainer's train/step_s per token, the weight stall, the driver's
    remainder per step, the prompt tokens per sample."""
    windows = [w for r in runs for w in r["windows"]]
    a_ms, b_ms, c_ms = decode_fit(windows)
    pre = [w for w in windows if w[5] > 0]
    prefill_ms = sum(w[6] for w in pre) / max(1.0, sum(w[5] for w in pre))
    # The part of a window that is neither decode, prefill, paused nor idle is the engine's
    # event loop serving HTTP and scheduling between steps, while it has work: it stretches
    # each decode step and prefill by the same share.
    work = sum(w[1] * w[3] + w[6] for w in windows)
    other = sum(max(0.0, 1e3 * w[0] - w[1] * w[3] - w[6] - w[7] - w[8]) for w in windows)
    stretch = 1.0 + other / max(work, 1e-9)
    a_ms, b_ms, c_ms, prefill_ms = a_ms * stretch, b_ms * stretch, c_ms * stretch, prefill_ms * stretch
    rows = [row for r in runs for row in r["rows"][1:]]
    fixed, per_tok = train_fit(rows)
    return {
        "decode_fixed_s": _fig(a_ms / 1e3, f"{label}: engine stats, ms/decode step vs batch fit, "
                                           f"x {stretch:.3f} for the engine's time between steps"),
        "decode_per_seq_s": _fig(b_ms / 1e3, f"{label}: engine stats, ms/decode step vs batch fit, x {stretch:.3f}"),
        "decode_per_ctx_token_s": _fig(c_ms / 1e3, f"{label}: engine stats, ms/decode step vs context "
                                                   f"tokens fit, x {stretch:.3f}"),
        "prefill_s": _fig(prefill_ms / 1e3, f"{label}: engine stats, prefill ms per request, x {stretch:.3f}"),
        "train_tokens_per_s": _fig(1.0 / max(per_tok, 1e-12),
                                   f"{label}: trainer train/step_s = fixed + tokens / this, fit over its steps"),
        "train_fixed_s": _fig(fixed, f"{label}: trainer train/step_s = this + tokens / rate, fit over its steps"),
        "publish_fixed_s": _fig(np.mean([r["weights/stall_s"] for r in rows]), f"{label}: weights/stall_s"),
        "step_overhead_s": _fig(np.mean([r["perf/step_s"] - r["train/step_s"] - r["weights/stall_s"] for r in rows]),
                                f"{label}: perf/step_s - train/step_s - weights/stall_s"),
        "prompt_tokens": _fig(np.mean([r["train/tokens"] / r["train/samples"] - r["rollout/response_len"]
                                       for r in rows]), f"{label}: train tokens per sample - response"),
        "train_overlap_slowdown": _fig(1.0, f"{label}: measured as it ran (overlap included)"),
        "engine_overlap_slowdown": _fig(1.0, f"{label}: measured as it ran (overlap included)"),
    }


def calibrate(sync: dict, fasync: dict) -> dict:
    """Component figures (seconds) from the two calibration runs, as a `--inputs` JSON object:
    each component alone from the sync run, and how much they slow each other down when they
    run at once (the fully-async run against the sync one)."""
    src = "bench/plan_calibrate.py calibration run {} (8 groups x 4, median 24), load {}"
    s_src, a_src = src.format("cal_sync", sync["load_avg_1m"]), src.format("cal_async_s2", fasync["load_avg_1m"])
    alone = component_figures([sync], s_src)
    together = component_figures([fasync], a_src)
    a_ms, b_ms, c_ms = decode_fit(sync["windows"])
    # engine ms/step in the fully-async run against the sync fit at its batch and context,
    # charged to the share of the time the trainer was busy (when both compete for the cores)
    wa = fasync["windows"]
    ratio = float(np.mean([w[3] / (a_ms + b_ms * w[2] + c_ms * (w[11] if len(w) > 11 else 0.0))
                           for w in wa])) if wa else 1.0
    busy = max(0.1, 1.0 - fasync["trainer_idle_frac"])
    # the fully-async run's train steps against what the sync fit says they would take alone
    rows = fasync["rows"][1:]
    alone_s = sum(alone["train_fixed_s"]["value"] + r["train/tokens"] / alone["train_tokens_per_s"]["value"]
                  for r in rows)
    slow = sum(r["train/step_s"] for r in rows) / alone_s
    return {**alone, "probe_s": (sync["probe_s"] + fasync["probe_s"]) / 2,
            "train_overlap_slowdown": _fig(max(1.0, slow), f"{a_src}: train steps over the cal_sync fit at their tokens"),
            "engine_overlap_slowdown": _fig(max(1.0, 1.0 + (ratio - 1.0) / busy),
                                            f"{a_src}: engine ms/step over the sync fit, per trainer-busy share")}


TIMES = ("decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s", "prefill_s", "publish_fixed_s", "train_fixed_s",
         "step_overhead_s")


def at_speed(inputs: dict, probe_s: float) -> dict:
    """The calibrated figures scaled to the machine's speed now (`probe_s` against the
    calibration's): times x ratio, the trainer's tokens/s / ratio."""
    ratio = probe_s / inputs["probe_s"]
    out = {k: v for k, v in inputs.items() if k != "probe_s"}
    for k in TIMES:
        out[k] = {"value": out[k]["value"] * ratio, "source": out[k]["source"] + f", x speed probe {ratio:.2f}"}
    t = out["train_tokens_per_s"]
    out["train_tokens_per_s"] = {"value": t["value"] / ratio, "source": t["source"] + f", / speed probe {ratio:.2f}"}
    return out


def predict(recipe, size: str, inputs: dict, steps: int, seeds: int = 5) -> dict:
    """`miles plan` for as many steps as were measured, averaged over `seeds` draws of the
    lengths: a 10-step run's mean is itself one draw, the prediction is the expectation."""
    from miles.plan import plan
    runs = [plan(recipe, size, None, inputs, "calibration", steps=steps, seed=s) for s in range(seeds)]
    out = dict(runs[0])
    for k in ("step_s", "trainer_idle_frac", "engine_idle_frac", "staleness_mean"):
        out[k] = round(float(np.mean([r[k] for r in runs])), 4)
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="", help="validation configurations to run (comma list)")
    ap.add_argument("--write-inputs", default=None, help="write the calibrated figures here (JSON)")
    ap.add_argument("--inputs", default=None, help="skip calibration: use these figures")
    ap.add_argument("--log-dir", default=None, help="keep each run's metrics, engine log and probe here")
    ap.add_argument("--from-logs", default=None, help="run nothing: read the runs a previous --log-dir kept")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: 2 GPUs (trainer on 0, engine on 1), the 0.2B model (model size small)")
    ap.add_argument("--engine-device", default="cuda:1",
                    help="with --device cuda: the engine's GPU (cuda:0: one GPU the trainer and the "
                         "engine share, both running at once)")
    args = ap.parse_args()
    if not args.log_dir and not args.from_logs:
        args.log_dir = tempfile.mkdtemp(prefix="plan_calibrate_")
    from miles.config import load_recipe
    recipe_path = ROOT / "recipes" / "quickstart.toml"
    with tempfile.TemporaryDirectory() as tmp:
        if args.inputs:
            inputs = json.loads(Path(args.inputs).read_text())
        else:
            cal = {name: measure(name, recipe_sets(m, st, g, med, e, args.steps, Path(tmp) / name, args.device,
                                             args.engine_device),
                                 Path(tmp) / name, args) for name, m, st, g, med, e in CALIBRATION}
            inputs = calibrate(cal["cal_sync"], cal["cal_async_s2"])
            print(json.dumps({"bench": "plan_calibrate", "part": "inputs", "inputs": inputs}), flush=True)
            if args.write_inputs:
                Path(args.write_inputs).write_text(json.dumps(inputs, indent=1) + "\n")
        only = set(filter(None, args.only.split(",")))
        errors, strict_errors, own_errors = [], [], []
        for name, mode, st, groups, median, engines in VALIDATION:
            if only and name not in only:
                continue
            if args.device != "cpu" and engines > 1:
                continue                      # one engine GPU on the 2-GPU machine
            sets = recipe_sets(mode, st, groups, median, engines, args.steps, Path(tmp) / name, args.device,
                                             args.engine_device)
            recipe = load_recipe(recipe_path, [f"{k}={v}" for k, v in sets.items()])
            got = measure(name, sets, Path(tmp) / name, args)
            size = "tiny" if args.device == "cpu" else "small"
            strict = predict(recipe, size, {k: v for k, v in inputs.items() if k != "probe_s"}, args.steps)
            pred = predict(recipe, size, at_speed(inputs, got["probe_s"]), args.steps)
            own = predict(recipe, size, component_figures([got], name + " itself"), args.steps)
            err = pred["step_s"] / got["step_s"] - 1.0
            errors.append(err)
            own_errors.append(own["step_s"] / got["step_s"] - 1.0)
            strict_errors.append(strict["step_s"] / got["step_s"] - 1.0)
            print(json.dumps({
                "bench": "plan_calibrate", "config": name, "mode": mode, "max_staleness": st,
                "groups": groups, "samples_per_step": groups * 4, "median_tokens": median, "engines": engines,
                "measured": {k: round(got[k], 3) for k in ("step_s", "trainer_idle_frac", "engine_idle_frac",
                                                           "staleness_mean")},
                "predicted": {k: pred[k] for k in ("step_s", "trainer_idle_frac", "engine_idle_frac",
                                                   "staleness_mean", "staleness_max")},
                "step_err": round(err, 3), "strict_step_s": strict["step_s"],
                "strict_step_err": round(strict_errors[-1], 3),
                "own_components_step_s": own["step_s"], "own_components_step_err": round(own_errors[-1], 3), "speed_ratio": round(got["probe_s"] / inputs["probe_s"], 3),
                "load_avg_1m": got["load_avg_1m"], "wall_s": round(got["wall_s"], 1),
                "machine": gpu_machine(args)}), flush=True)
    if errors:
        abs_err = np.abs(errors)
        print(json.dumps({"bench": "plan_calibrate", "part": "summary", "configs": len(errors),
                          "max_abs_err": round(float(abs_err.max()), 3),
                          "mean_abs_err": round(float(abs_err.mean()), 3),
                          "within_15pct": int((abs_err <= 0.15).sum()),
                          "strict_max_abs_err": round(float(np.abs(strict_errors).max()), 3),
                          "strict_mean_abs_err": round(float(np.abs(strict_errors).mean()), 3),
                          "own_components_max_abs_err": round(float(np.abs(own_errors).max()), 3),
                          "own_components_mean_abs_err": round(float(np.abs(own_errors).mean()), 3)}),
              flush=True)


if __name__ == "__main__":
    main()
