"""Low-precision rollout: quantizer costs and the train/rollout mismatch per format.

Two modes, one JSON line per format (and per run):

  .venv/bin/python bench/quant.py [--dim 2048] [--device cpu|cuda] [--model-path DIR]
      {"bench": "quant", "fmt", "machine", "dequant_rel_err", "quantize_s_per_gb",
       "dequantize_s_per_gb", "bytes_per_param", "kl_vs_bf16", "logprob_abs_diff_vs_bf16"}
  .venv/bin/python bench/quant.py --runs [--seeds 0 1 2] [--steps 40] [--formats ...]
      {"bench": "quant_run", "fmt", "seed", "eval_reward": [[step, reward], ...],
       "train_rollout_kl", "train_rollout_logprob_abs_diff", "s_per_step", "publishes_checked"}
      then {"bench": "quant_runs_summary", "fmt", "final_eval_mean", "final_eval_std", ...}

- Micro: an N(0, 0.02) bf16 matrix of `--dim` x `--dim`: relative L2 error of
  dequantize(quantize(w)), quantize / dequantize seconds per GB of bf16 input (median of 3).
  Mismatch: the model (`--model-path`, default the tiny qwen3 perturbed as the tests do) with
  every quantizable weight replaced by its dequantize(quantize(w)) - exactly what the engine
  holds, by the bit-exact contract - against the same model in BF16, teacher-forced on random
  token sequences: mean per-token KL(p_bf16 || p_fmt) over the vocabulary, and mean |log p|
  difference of the next tokens.
- Runs: recipes/quant/quickstart.toml per format (`int4_qat` = rollout int4 + train int4_qat),
  loop.mode = sync (so the trainer and the rollout hold the same version and
  train/train_rollout_* measure the format alone, not staleness), check_weights on every publish.
  The trainer's `train/train_rollout_kl` (k3 estimate) and `..._logprob_abs_diff` are averaged
  over steps; held-out greedy reward every 10 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from miles.quant.formats import FORMATS, dequantize, quantize  # noqa: E402
from miles.quant.keep import KeepList  # noqa: E402
from miles.hostinfo import machine

RUN_FORMATS = ["bf16", "fp8", "mxfp8", "mxfp4", "nvfp4", "int4", "int4_qat"]


def _median_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _lm(model_path: str | None, device):
    from transformers import AutoModelForCausalLM
    from miles.tiny import build_tiny_model
    path = model_path or str(build_tiny_model(arch="qwen3"))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    if model_path is None:  # random init is nearly uniform; perturb as the tests do
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(device))
    return lm


def _fake_quant_copy(lm, fmt: str):
    import copy
    q = copy.deepcopy(lm)
    keep = KeepList()
    with torch.no_grad():
        for name, p in q.named_parameters():
            if keep.quantizes(name, p):
                w = p.to(torch.bfloat16)
                p.copy_(dequantize(quantize(w, fmt, group_size=32), p.dtype))
    return q


def _mismatch(ref, lm, ids: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        lp_ref = torch.log_softmax(ref(ids).logits.float(), -1)
        lp = torch.log_softmax(lm(ids).logits.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    nxt = ids[:, 1:, None]
    diff = (lp_ref[:, :-1].gather(-1, nxt) - lp[:, :-1].gather(-1, nxt)).abs().mean().item()
    return kl, diff


def micro(args) -> None:
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.dim, args.dim, generator=g) * 0.02).to(torch.bfloat16).to(device)
    gb = w.numel() * 2 / 1e9
    ref = _lm(args.model_path, device)
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (8, 64), generator=g).to(device)
    base = {"bench": "quant", "machine": machine(), "device": str(device), "dim": args.dim,
            "model": args.model_path or "tiny qwen3 (perturbed)"}
    print(json.dumps({**base, "fmt": "bf16", "dequant_rel_err": 0.0, "bytes_per_param": 2.0,
                      "kl_vs_bf16": 0.0, "logprob_abs_diff_vs_bf16": 0.0}), flush=True)
    for fmt in FORMATS:
        q = quantize(w, fmt, group_size=32)
        err = ((dequantize(q).float() - w.float()).norm() / w.float().norm()).item()
        qs = _median_s(lambda: quantize(w, fmt, group_size=32))
        ds = _median_s(lambda: dequantize(q, torch.bfloat16))
        kl, diff = _mismatch(ref, _fake_quant_copy(ref, fmt), ids)
        print(json.dumps({**base, "fmt": fmt, "dequant_rel_err": round(err, 5),
                          "quantize_s_per_gb": round(qs / gb, 3), "dequantize_s_per_gb": round(ds / gb, 3),
                          "bytes_per_param": round(q.nbytes() / w.numel(), 4),
                          "kl_vs_bf16": kl, "logprob_abs_diff_vs_bf16": diff}), flush=True)


def _run_one(fmt: str, seed: int, steps: int, out: Path) -> dict:
    name = f"quant_bench_{fmt}_s{seed}"
    run_dir = REPO / "runs" / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    import socket
    with socket.socket() as sock:  # a free head port: other runs may be using the default
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sets = {"run.name": name, "run.seed": str(seed), "loop.mode": '"sync"', "cluster.head_port": str(port),
            "loop.num_steps": str(steps), "loop.eval_every": "10", "loop.save_every": "0"}
    if fmt == "int4_qat":
        sets.update({"quant.rollout": '"int4"', "quant.train": '"int4_qat"'})
    else:
        sets["quant.rollout"] = f'"{fmt}"'
    cmd = [sys.executable, "-m", "miles.cli", "run", "recipes/quant/quickstart.toml"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    t = time.perf_counter()
    log = out.with_name(f"{name}.log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=1200).returncode
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")] if rc == 0 else []
    evals = [[r["step"], r["eval/reward"]] for r in rows if "eval/reward" in r]
    train = [r for r in rows if "train/train_rollout_kl" in r]
    mean = lambda key: statistics.fmean(r[key] for r in train) if train else None  # noqa: E731
    steps_s = [r["perf/step_s"] for r in rows if "perf/step_s" in r]
    checked = sum(1 for line in open(run_dir / "logs" / "trainer_0.log") if "published version" in line) \
        if (run_dir / "logs" / "trainer_0.log").exists() else 0
    return {"bench": "quant_run", "fmt": fmt, "seed": seed, "steps": steps, "rc": rc,
            "wall_s": round(wall, 1), "eval_reward": evals,
            "train_rollout_kl": mean("train/train_rollout_kl"),
            "train_rollout_logprob_abs_diff": mean("train/train_rollout_logprob_abs_diff"),
            "s_per_step": round(statistics.median(steps_s), 3) if steps_s else None,
            "publishes_checked": checked, "machine": machine()}


def runs(args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for fmt in args.formats:
            r = _run_one(fmt, seed, args.steps, out)
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(r) + "\n")
    for fmt in args.formats:
        mine = [r for r in results if r["fmt"] == fmt and r["eval_reward"]]
        finals = [r["eval_reward"][-1][1] for r in mine]
        print(json.dumps({"bench": "quant_runs_summary", "fmt": fmt, "seeds": [r["seed"] for r in mine],
                          "final_eval_mean": statistics.fmean(finals) if finals else None,
                          "final_eval_std": statistics.stdev(finals) if len(finals) > 1 else None,
                          "train_rollout_kl_mean": statistics.fmean(r["train_rollout_kl"] for r in mine)
                          if mine else None, "machine": machine()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--model-path", default=None)
    p.add_argument("--runs", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--formats", nargs="+", default=RUN_FORMATS, choices=RUN_FORMATS)
    p.add_argument("--out", default=str(REPO / "runs" / "quant_bench" / "results.jsonl"))
    args = p.parse_args()
    runs(args) if args.runs else micro(args)


if __name__ == "__main__":
    main()
