"""Low-precision rollout: quantizer costs and the train/rollout mismatch per format.

Two modes, one JSON line per format (and per run):

  .venv/bin/python bench/quant.py [--dim 2048] [--device cpu|cuda] [--model-path DIR]
      {"bench": "quant", "fmt", "machine", "dequant_rel_err", "quantize_s_per_gb",
       "dequantize_s_per_gb", "bytes_per_param", "kl_vs_bf16", "logprob_abs_diff_vs_bf16"}
  .venv/bin/python bench/quant.py --runs [--seeds 0 1 2] [--steps 40] [--formats ...]
      {"bench": "quant_run", "fmt", "seed", "eval_reward": [[step, reward], ...],
       "train_rollout_kl", "train_rollout_logprob_abs_diff", "s_per_step", "publishes_checked"}
      then {"bench": "quant_runs_summary", "fmt", "final_eval_mean", "final_eval_std", ...}
  .venv/bin/python bench/quant.py --engine [--device cuda|cpu] [--models qwen2-0.5b qwen2-1.5b]
      {"bench": "quant_engine", "machine", "tok_per_s": {model: {"bf16": {batch: tok/s},
       "fp8_gemm": {batch: tok/s}}}, "fp8_speedup": {model: {batch: x}}, "weights_bytes", ...}
  .venv/bin/python bench/quant.py --train [bench/train.py's arguments]
      bench/train.py --backend fsdp --quant-train bf16,fp8,fp8-rowwise: one RL training step of
      the Qwen2-1.5B-shaped model, BF16 against torchao FP8 (tensorwise, rowwise), same batch,
      same process: {"bench": "train", "backends": {"fsdp": {...}, "fsdp+fp8": {...}, ...}}

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
- Engine: embedded-engine decode tok/s at batch 1 and 64 (bench/engine.py's in-process scheduler
  runs and its differencing of a short and a long run), BF16 (no quantization) against
  `--quantization fp8 --fp8-gemm on` (FP8 weights, FP8 block-wise GEMMs for the dense linears),
  for random qwen2-0.5b- and qwen2-1.5b-shaped models: config.json only, `--load-format dummy`,
  then random N(0, 0.02) weights written on the device through the engine's own copy_in (the FP8
  engine quantizes them on arrival), so nothing is built or read from disk. On CPU a tiny smoke
  run measures BF16 only and says why the FP8 part is skipped (the FP8 GEMM needs CUDA).
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


QWEN2_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                 tie_word_embeddings=True)
TINY_QWEN2 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                  tie_word_embeddings=True)


def _config_dir(name: str, dims: dict) -> Path:
    """A model directory with config.json only (the engine starts with --load-format dummy)."""
    import tempfile
    from transformers import Qwen2Config
    out = Path(tempfile.mkdtemp(prefix=f"quant-engine-{name}-"))
    Qwen2Config(**dims).save_pretrained(out)
    return out


def _random_weights(weights, seed: int) -> None:
    """N(0, 0.02) everywhere (norms 1), through copy_in: FP8-held linears quantize on arrival."""
    g = torch.Generator(device=weights.device).manual_seed(seed)
    with torch.no_grad():
        for name in list(weights.names):
            shape = weights.full_shape(name)
            if name.endswith("norm.weight"):
                t = torch.ones(shape, device=weights.device, dtype=weights.dtype)
            else:
                t = torch.randn(shape, generator=g, device=weights.device).mul_(0.02).to(weights.dtype)
            weights.copy_in(name, t)
    if weights.device.type == "cuda":
        torch.cuda.synchronize(weights.device)


async def _engine_decode(path: Path, device, mode: str, args) -> tuple[dict, int]:
    """{batch: decode tok/s} of one engine (mode bf16 | fp8_gemm), and its weight bytes."""
    from engine import engine_run  # bench/engine.py
    from miles.engines.embedded import build_parser, build_server
    max_bs = max(args.batches)
    flags = ["--model-path", str(path), "--skip-tokenizer-init", "--device", str(device),
             "--dtype", "bfloat16", "--load-format", "dummy", "--random-seed", "0",
             "--max-running-requests", str(max_bs), "--cuda-graph-max-bs", str(max_bs),
             "--max-total-tokens", str(max_bs * (args.prompt_len + args.n_long) + 1024),
             "--context-length", str(args.prompt_len + args.n_long + 64),
             "--cuda-graph-precapture-kv", "0", "--torch-threads", str(torch.get_num_threads())]
    if mode == "fp8_gemm":
        flags += ["--quantization", "fp8", "--fp8-gemm", "on"]
    server = build_server(build_parser().parse_args(flags))
    weights = server.runner.model.weights
    _random_weights(weights, seed=0)
    server.scheduler.start()
    out = {}
    try:
        for b in args.batches:
            await engine_run(server, b, args.prompt_len, args.n_long, seed=1)  # warm-up, graph capture
            t_short = await engine_run(server, b, args.prompt_len, args.n_short, seed=2)
            t_long = await engine_run(server, b, args.prompt_len, args.n_long, seed=3)
            out[b] = round(b * (args.n_long - args.n_short) / (t_long - t_short), 1)
    finally:
        await server.scheduler.close()
    nbytes = weights.nbytes()
    del server, weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, nbytes


def engine(args) -> None:
    import asyncio
    sys.path.insert(0, str(REPO / "bench"))
    from engine import QWEN2_05B  # bench/engine.py's 0.5B shape
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shapes = {"qwen2-0.5b": QWEN2_05B, "qwen2-1.5b": QWEN2_15B, "tiny": TINY_QWEN2}
    models = args.models or (["qwen2-0.5b", "qwen2-1.5b"] if cuda else ["tiny"])
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else \
        ([1, 64] if cuda else [1, 4])
    args.prompt_len, args.n_short, args.n_long = (64, 16, 80) if cuda else (8, 4, 12)
    modes = ["bf16", "fp8_gemm"]
    skipped = None
    if not cuda:
        skipped = "FP8 GEMM needs CUDA (an H100/H200-class GPU): CPU smoke run, bf16 only"
        modes = ["bf16"]
        print(f"bench/quant.py --engine: {skipped}", file=sys.stderr, flush=True)
        torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.perf_counter()
    tok_s, nbytes = {}, {}
    for name in models:
        path = _config_dir(name, shapes[name])
        for mode in modes:
            try:
                tok_s.setdefault(name, {})[mode], nbytes.setdefault(name, {})[mode] = \
                    asyncio.run(_engine_decode(path, device, mode, args))
            except ValueError as e:  # --fp8-gemm on refused to start: say why, keep the rest
                if mode != "fp8_gemm":
                    raise
                skipped = str(e)
                print(f"bench/quant.py --engine: {name} {mode}: {e}", file=sys.stderr, flush=True)
    speedup = {n: {b: round(r["fp8_gemm"][b] / r["bf16"][b], 3) for b in args.batches}
               for n, r in tok_s.items() if "fp8_gemm" in r}
    print(json.dumps({"bench": "quant_engine", "machine": machine(device), "device": str(device),
                      "dtype": "bfloat16", "batches": args.batches, "prompt_len": args.prompt_len,
                      "new_tokens": [args.n_short, args.n_long], "tok_per_s": tok_s,
                      "fp8_speedup": speedup, "weights_bytes": nbytes, "fp8_skipped": skipped,
                      "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--model-path", default=None)
    p.add_argument("--runs", action="store_true")
    p.add_argument("--engine", action="store_true",
                   help="embedded-engine decode tok/s, FP8 GEMM against BF16 (CPU: smoke, bf16 only)")
    p.add_argument("--models", nargs="+", default=None, choices=["qwen2-0.5b", "qwen2-1.5b", "tiny"])
    p.add_argument("--batches", default=None, help="--engine: comma-separated batch sizes")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--formats", nargs="+", default=RUN_FORMATS, choices=RUN_FORMATS)
    p.add_argument("--out", default=str(REPO / "runs" / "quant_bench" / "results.jsonl"))
    p.add_argument("--train", action="store_true",
                   help="FP8 against BF16 training (bench/train.py --quant-train); every argument "
                        "this script does not know goes to bench/train.py")
    args, rest = p.parse_known_args()
    if args.train:
        sys.exit(subprocess.call([sys.executable, str(REPO / "bench" / "train.py"), "--backend", "fsdp",
                                  "--quant-train", "bf16,fp8,fp8-rowwise", *rest]))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.engine:
        engine(args)
    elif args.runs:
        runs(args)
    else:
        micro(args)


if __name__ == "__main__":
    main()
