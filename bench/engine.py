"""Embedded engine decode throughput vs transformers `generate`, one JSON line per batch size.

    python bench/engine.py                       # CUDA: 0.5B Qwen2 shape, bf16, batch 1,16,64,256
    python bench/engine.py --device cpu          # CPU smoke run: tiny Qwen2, fp32, batch 1,4

Each line: {"bench": "engine", "model", "batch", "tok_per_s", "ms_per_step", "prefill_ms",
"hf_generate_tok_per_s", "hbm_bound_tok_per_s", "machine", ...}. `--profile` adds a cProfile of
one run per batch on stderr (the host-side cost of a step).

Design decisions:
- The engine is driven in-process through its real scheduler (continuous batching loop, KV pool,
  sampling at temperature 1, CUDA graphs), without HTTP: HTTP costs per request, not per token.
- Decode cost is isolated by differencing two runs of the same batch with `n_short` and `n_long`
  new tokens (prefill and request setup cancel out): ms_per_step = (T_long - T_short) / (n_long -
  n_short). A warm-up run first captures every CUDA graph the timed runs need. transformers
  `generate` (sampling, dynamic cache, sdpa) is measured the same way, in the same process.
- `hbm_bound_tok_per_s` is the roofline: batch / (bytes read per step / HBM bandwidth), where a step
  reads every weight once plus each request's KV so far; `hbm_fraction` is the step's share of it.
  The bandwidth is measured on the card at start (a 1 GiB device-to-device copy, bytes read plus
  written: ~3.0 TB/s on an H100, ~4.3 on an H200), or `--hbm-gbps`; null on CPU.
- `--baseline-tree DIR` (a `git archive` of main's tree): DIR's own bench/engine.py runs first in a
  child process on the same card and shapes, and each line carries its `baseline_ms_per_step` and
  `speedup_vs_baseline`: the same-run baseline the engine's speed is judged against.
- The 0.5B model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936)
  has random weights, built once with miles.tiny and cached.
- `prefill_ms` is the best of 5 runs of the batch with one new token: one prefill of all its prompts
  plus the first sampled token and the request bookkeeping.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from miles.hostinfo import machine

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                 tie_word_embeddings=True)


# bench/async_rl.py's "small" model: ~0.2B, Qwen3, the quickstart's 512-token vocabulary.
QWEN3_SMALL = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=64, intermediate_size=3072)


def build_model(name: str):
    from miles.tiny import build_tiny_model
    if name == "qwen2-0.5b":
        return build_tiny_model(arch="qwen2", **QWEN2_05B)
    if name == "small":
        return build_tiny_model(arch="qwen3", **QWEN3_SMALL)
    return build_tiny_model(arch="qwen2")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def engine_run(server, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.request import Request
    sch = server.scheduler
    g = torch.Generator().manual_seed(seed)
    V = server.runner.shape.vocab_size
    reqs = [Request(rid=f"b{seed}-{i}", input_ids=torch.randint(0, V, (prompt_len,), generator=g).tolist(),
                    params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True),
                    seed=seed * 100003 + i, max_new_tokens=new_tokens) for i in range(batch)]
    sync(server.runner.device)
    t0 = time.perf_counter()
    for r in reqs:
        sch.submit(r)
    await asyncio.gather(*(r.done.wait() for r in reqs))
    sync(server.runner.device)
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    return time.perf_counter() - t0


async def profile_run(server, batch: int, args) -> None:
    """cProfile over one long run of `batch` requests on the engine's compute thread (where a
    step's host-side cost is, which is what a small model's step is made of on a GPU), then over 5
    prefill-only runs (one new token); the top functions by own time go to stderr. On Python 3.12
    the profiler sees every thread (and only one may be active at a time)."""
    import cProfile
    import io
    import pstats
    sch = server.scheduler
    for what, new_tokens, runs in (("decode", args.n_long, 1), ("prefill", 1, 5)):
        prof = cProfile.Profile()
        await sch.run_compute(prof.enable)
        t = sum([await engine_run(server, batch, args.prompt_len, new_tokens, seed=9 + k) for k in range(runs)])
        await sch.run_compute(prof.disable)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"== profile ({what}, compute thread): batch {batch}, {runs} run(s) of {new_tokens} tokens, "
              f"{1e3 * t / runs:.3f} ms/run under the profiler\n{text.getvalue()}", file=sys.stderr, flush=True)


async def torch_profile_run(server, batch: int, args) -> None:
    """torch.profiler over one run of `batch` requests (64 new tokens), entered and left on the
    compute thread: host time per op (what a host-bound step is made of) and device time per
    kernel, on stderr, with the device's busy share of the run's wall time."""
    from torch.profiler import ProfilerActivity, profile
    sch = server.scheduler
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    await sch.run_compute(prof.__enter__)
    t = await engine_run(server, batch, args.prompt_len, 64, seed=21)
    await sch.run_compute(prof.__exit__, None, None, None)
    avg = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"== torch profile: batch {batch}, 64 tokens, {1e3 * t:.1f} ms wall, device busy "
          f"{busy_us / 1e3:.1f} ms ({100 * busy_us / 1e6 / t:.0f}%)\n"
          f"{avg.table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=60)}\n"
          f"{avg.table(sort_by='self_device_time_total', row_limit=15, max_name_column_width=60)}",
          file=sys.stderr, flush=True)


def hbm_gbps(device) -> float:
    """The card's memory bandwidth, measured: a 1 GiB device-to-device copy, bytes read plus
    written, best of 10 (the roofline then fits whichever card the bench ran on)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(12):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / best / 1e9


async def prefill_shapes(server, args) -> dict:
    """Prefill cost at shapes the engine has not seen, then at the same shapes again.

    An RL loop's prefills rarely repeat a shape (how many requests arrived, how long their prompts
    are), while `prefill_ms` above is the best of 5 runs of one shape; a large gap here is a cost
    paid per new shape (kernel selection, allocator growth)."""
    shapes = [(b, n) for b, n in zip((5, 9, 13, 17, 21, 25, 29, 33), (6, 7, 9, 11, 8, 10, 12, 14))]
    first, again = [], []
    for k, (b, n) in enumerate(shapes):
        first.append(await engine_run(server, b, n, 1, seed=100 + k))
    for k, (b, n) in enumerate(shapes):
        again.append(await engine_run(server, b, n, 1, seed=200 + k))
    ms = lambda xs: [round(x * 1e3, 2) for x in xs]  # noqa: E731
    return {"bench": "engine_prefill_shapes", "shapes": shapes, "first_ms": ms(first), "again_ms": ms(again),
            "first_median_ms": round(float(np.median(first)) * 1e3, 2),
            "again_median_ms": round(float(np.median(again)) * 1e3, 2)}


def hf_run(model, batch, prompt_len, new_tokens, device) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, pad_token_id=0)
    sync(device)
    assert out.shape[1] == prompt_len + new_tokens
    return time.perf_counter() - t0


async def bench_engine(args, path, device) -> dict[int, float]:
    from miles.engines.embedded import build_server
    max_bs = max(args.batches)
    from miles.engines.embedded import build_parser
    # The engine's own CLI parser, so every flag has its real default.
    ns = build_parser().parse_args([
        "--model-path", str(path), "--skip-tokenizer-init", "--device", str(device),
        "--dtype", args.dtype, "--max-running-requests", str(max_bs),
        "--max-total-tokens", str(max_bs * (args.prompt_len + args.n_long) + 1024),
        "--context-length", str(args.prompt_len + args.n_long + 64), "--random-seed", "0",
        "--cuda-graph-max-bs", str(max_bs), "--torch-threads", str(torch.get_num_threads()),
        "--prefill-attention", args.prefill_attention, "--decode-kernels", args.decode_kernels,
        *(["--disable-cuda-graph"] if args.disable_cuda_graph else [])])
    server = build_server(ns)
    server.scheduler.start()
    out = {}
    try:
        if args.prefill_shapes:
            info = await prefill_shapes(server, args)
            info.update(machine=machine(device))
            print(json.dumps(info), flush=True)
        for b in args.batches:
            await engine_run(server, b, args.prompt_len, args.n_long, seed=1)  # warm-up, graph capture
            t_short = await engine_run(server, b, args.prompt_len, args.n_short, seed=2)
            t_long = await engine_run(server, b, args.prompt_len, args.n_long, seed=3)
            # prefill: the batch's prompts in one forward, and its first token (best of 5)
            t_prefill = min([await engine_run(server, b, args.prompt_len, 1, seed=4 + k) for k in range(5)])
            out[b] = ((t_long - t_short) / (args.n_long - args.n_short), t_prefill)
            if args.profile:
                await profile_run(server, b, args)
            if args.torch_profile:
                await torch_profile_run(server, b, args)
    finally:
        await server.scheduler.close()
    info = {"weights_bytes": server.runner.model.weights.nbytes(),
            "kv_bytes_per_token": server.runner.kv.nbytes() // server.runner.kv.num_slots,
            "cuda_graph": server.runner.use_graphs,
            "prefill_attention": server.runner.prefill_attention,
            "decode_kernels": "triton" if server.runner.fused_decode else "torch"}
    del server
    return out, info


def baseline_figures(args) -> dict[int, dict]:
    """Run the baseline tree's own bench/engine.py (its engine, same card, same shapes) in a child
    process and return its lines by batch."""
    tree = Path(args.baseline_tree).resolve()
    cmd = [sys.executable, str(tree / "bench" / "engine.py"), "--device", args.device, "--model", args.model,
           "--dtype", args.dtype, "--batches", ",".join(map(str, args.batches)),
           "--prompt-len", str(args.prompt_len), "--n-short", str(args.n_short),
           "--n-long", str(args.n_long), "--skip-hf", "--hbm-gbps", "1000"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"--baseline-tree {tree}: its bench failed:\n{proc.stderr[-3000:]}")
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"bench": "engine"' in line:
            row = json.loads(line)
            out[row["batch"]] = row
    print(json.dumps({"bench": "engine_baseline", "tree": tree.name, "lines": list(out.values())}), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="qwen2-0.5b (default on CUDA), small (0.2B Qwen3, "
                   "512-token vocabulary) or tiny (CPU)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--n-short", type=int, default=None)
    p.add_argument("--n-long", type=int, default=None)
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="HBM bandwidth for the roofline (default: measured by a device copy)")
    p.add_argument("--baseline-tree", default=None,
                   help="a checkout of the engine to compare against (e.g. `git archive` of main): its "
                        "own bench/engine.py runs first, same card, and each line gets its figures")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--prefill-attention", default="auto", choices=["auto", "varlen", "sdpa"],
                   help="the engine's prefill attention (varlen: FlashAttention, CUDA bf16/fp16)")
    p.add_argument("--decode-kernels", default=None, choices=["auto", "triton", "torch"],
                   help="the engine's decode path (triton, the default on CUDA: the fused kernels "
                        "of kernels.py; torch, the default on CPU: op by op)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--prefill-shapes", action="store_true",
                   help="first: prefill cost at 8 new (batch, prompt length) shapes, then again")
    p.add_argument("--profile", action="store_true", help="cProfile one run per batch (stderr)")
    p.add_argument("--torch-profile", action="store_true",
                   help="torch.profiler over one run per batch: host time per op, kernels (stderr)")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.model = args.model or ("qwen2-0.5b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.decode_kernels = args.decode_kernels or ("triton" if cuda else "torch")
    args.batches = [int(b) for b in (args.batches or ("1,16,64,256" if cuda else "1,4")).split(",")]
    args.prompt_len = args.prompt_len or (128 if cuda else 16)
    args.n_short = args.n_short or (32 if cuda else 8)
    args.n_long = args.n_long or (160 if cuda else 40)
    if not cuda:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    path = build_model(args.model)
    base = baseline_figures(args) if args.baseline_tree else {}
    if cuda and args.hbm_gbps is None:
        args.hbm_gbps = hbm_gbps(device)

    steps, info = asyncio.run(bench_engine(args, path, device))
    if cuda:
        torch.cuda.empty_cache()
    hf = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        from miles.engines.embedded_engine.runner import torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(args.dtype)).to(device).eval()
        for b in args.batches:
            hf_run(model, b, args.prompt_len, 4, device)  # warm-up
            t_short = hf_run(model, b, args.prompt_len, args.n_short, device)
            t_long = hf_run(model, b, args.prompt_len, args.n_long, device)
            hf[b] = (t_long - t_short) / (args.n_long - args.n_short)
        del model
    for b in args.batches:
        s, t_prefill = steps[b]
        avg_ctx = args.prompt_len + (args.n_short + args.n_long) / 2
        step_bytes = info["weights_bytes"] + b * avg_ctx * info["kv_bytes_per_token"]
        print(json.dumps({
            "bench": "engine", "model": f"{args.model} {args.dtype}", "batch": b,
            "tok_per_s": round(b / s, 1), "ms_per_step": round(s * 1000, 3),
            "prefill_ms": round(t_prefill * 1000, 2),
            "hf_generate_tok_per_s": round(b / hf[b], 1) if b in hf else None,
            "hf_ms_per_step": round(hf[b] * 1000, 3) if b in hf else None,
            "speedup_vs_hf": round(hf[b] / s, 2) if b in hf else None,
            "hbm_bound_tok_per_s": round(b * args.hbm_gbps * 1e9 / step_bytes, 1) if cuda else None,
            "hbm_fraction": round(step_bytes / (args.hbm_gbps * 1e9) / s, 4) if cuda else None,
            "hbm_gbps": round(args.hbm_gbps, 1) if cuda else None,
            "baseline_ms_per_step": base.get(b, {}).get("ms_per_step"),
            "baseline_prefill_ms": base.get(b, {}).get("prefill_ms"),
            "speedup_vs_baseline": round(base[b]["ms_per_step"] / (s * 1000), 2) if b in base else None,
            "baseline": args.baseline_tree and Path(args.baseline_tree).name,
            "machine": machine(device), "device": str(device), "cuda_graph": info["cuda_graph"],
            "prefill_attention": info["prefill_attention"], "decode_kernels": info["decode_kernels"],
            "prompt_len": args.prompt_len, "new_tokens": [args.n_short, args.n_long]}), flush=True)


if __name__ == "__main__":
    main()
