"""R3 costs: engine decode with and without routing capture, trainer step with and without replay,
routing bytes per sample on the wire. Prints one JSON line:

  {"bench": "r3", "model", "machine", "engine": {"decode_ms_per_step_off", "..._on", "overhead"},
   "trainer": {"step_s_off", "step_s_on", "overhead", "routing_agreement_on"},
   "wire": {"tokens", "int32_bytes", "base64_bytes", "ours_bytes", "ours_dtype"}}

- Model: `tiny` (miles.tiny qwen3_moe: 2 layers, 8 experts, top-2; the CPU default) or `small`
  (Qwen3-MoE-shaped: hidden 1024, 16 layers, 64 experts, top-8, moe_intermediate 256; the GPU
  default). Random weights, built once offline.
- Engine: the embedded engine in this process (its own CLI parser for real defaults), a batch of
  `--batch` requests, `--new-tokens` decoded each; decode time per step from the moment every
  request has its first token (the prefill made it) to the last token, over the new_tokens - 1
  decode steps between; capture off/on alternated `--repeats` times, medians. One short warm-up
  run per mode. (An earlier version timed a long and a short run and took the difference so the
  prefill cancelled: the same figure for 25% more decode steps; the small MoE decodes eagerly,
  an expert loop per layer, and that bench outran its 110 s limit on an H200.)
- Trainer: a one-rank FSDP backend (`--backend megatron`: the Megatron backend, whose replay is
  megatron-core's RouterReplay per MoE layer), lr 0 (the same weights every step), old log-probs
  recomputed (the no-grad pass replays too), the same GRPO batch with routing on every sample; off = the
  batch without routing (nothing patched runs but the router's own top-k), on = replay. Medians of
  `--steps` steps after one warm-up, alternated.
- Wire: one sample of `--wire-tokens` tokens with the model's (layers, top_k): SGLang's int32, its
  base64 in JSON, and our uint8/uint16 frame as encoded by miles.wire.codec.
- Output as it is measured: a `"part": "engine"` line as soon as the engine part is done, then the
  whole line. `--budget-s` (default 90; 0: none) bounds the run: a part stops repeating once the
  next repeat (its slowest so far) would end past its share of the budget (engine: the first 55%),
  never before one repeat of each mode; `repeats_done` / `steps_done` say how many ran. Progress
  with timings goes to stderr.

Usage: .venv/bin/python bench/r3.py [--device cpu|cuda] [--model tiny|small] [--batch 16]
       [--new-tokens 64] [--steps 5] [--repeats 3] [--budget-s 90] [--backend fsdp|megatron]
GPU:   .venv/bin/python bench/r3.py --device cuda --model small --batch 64 --new-tokens 256 --steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from miles.hostinfo import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, intermediate_size=2816, moe_intermediate_size=256, num_experts=64,
             num_experts_per_tok=8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


T0 = time.perf_counter()


def progress(msg: str) -> None:
    """Where the time goes, on stderr (stdout carries only the JSON lines)."""
    print(f"[r3 {time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class Budget:
    """`--budget-s` split by fractions: a part may start another repeat only if it would end
    before its share (`frac` of the budget since the bench started) runs out."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s

    def fits(self, next_s: float, frac: float) -> bool:
        return self.budget_s <= 0 or time.perf_counter() + next_s <= T0 + frac * self.budget_s


async def engine_bench(path: Path, device: torch.device, args, budget: Budget) -> dict:
    from miles.engines.embedded import build_parser, build_server
    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.request import Request

    prompt_len = 32
    ns = build_parser().parse_args([
        "--model-path", str(path), "--skip-tokenizer-init", "--device", str(device), "--dtype", args.dtype,
        "--max-running-requests", str(args.batch), "--enable-return-routed-experts",
        "--max-total-tokens", str(args.batch * (prompt_len + args.new_tokens) + 1024),
        "--context-length", str(prompt_len + args.new_tokens + 64), "--random-seed", "0",
        "--torch-threads", str(torch.get_num_threads())])
    server = build_server(ns)
    server.scheduler.start()
    V = server.runner.shape.vocab_size
    progress(f"engine up ({args.batch} x {args.new_tokens} tokens per run)")

    async def run(new_tokens: int, capture: bool, seed: int) -> float:
        """Seconds per decode step of one batch."""
        g = torch.Generator().manual_seed(seed)
        reqs = [Request(rid=f"r{seed}-{capture}-{i}", input_ids=torch.randint(0, V, (prompt_len,), generator=g).tolist(),
                        params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True),
                        seed=seed * 1000 + i, max_new_tokens=new_tokens, return_routed_experts=capture,
                        stream=True)  # stream: `progress` is set per token, so the first is seen
                for i in range(args.batch)]

        async def first_token(r: Request) -> None:
            while not r.output_ids and not r.done.is_set():
                await r.progress.wait()
                r.progress.clear()

        sync(device)
        for r in reqs:
            server.scheduler.submit(r)
        # the prefill gives every request its first token; the rest are decode steps
        await asyncio.gather(*(first_token(r) for r in reqs))
        t_first = time.perf_counter()
        await asyncio.gather(*(r.done.wait() for r in reqs))
        sync(device)
        t_end = time.perf_counter()
        assert all(len(r.output_ids) == new_tokens for r in reqs)
        assert all((r.routed is not None) == capture for r in reqs)
        return (t_end - t_first) / max(new_tokens - 1, 1)

    per_step: dict[bool, list[float]] = {False: [], True: []}
    slowest = 0.0
    try:
        for capture in (True, False):  # warm-up (kernels, allocator), a quarter of a run each
            await run(max(2, args.new_tokens // 4), capture, 1)
        progress("engine warmed up")
        for k in range(args.repeats):
            if k and not budget.fits(slowest, 0.55):
                progress(f"engine: budget reached after {k} of {args.repeats} repeats")
                break
            t = time.perf_counter()
            for capture in (False, True) if k % 2 == 0 else (True, False):
                per_step[capture].append(await run(args.new_tokens, capture, 10 + k))
            slowest = max(slowest, time.perf_counter() - t)
            progress(f"engine repeat {k + 1}: {slowest:.1f} s at most per repeat")
    finally:
        await server.scheduler.close()
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    # the best run of each as well: on a shared machine other processes only ever add time
    best_off, best_on = min(per_step[False]), min(per_step[True])
    return {"batch": args.batch, "decode_ms_per_step_off": round(off * 1e3, 3),
            "decode_ms_per_step_on": round(on * 1e3, 3), "overhead": round(on / off - 1, 4),
            "best_ms_off": round(best_off * 1e3, 3), "best_ms_on": round(best_on * 1e3, 3),
            "best_overhead": round(best_on / best_off - 1, 4), "repeats_done": len(per_step[False])}


def trainer_bench(path: Path, args, budget: Budget) -> dict:
    import msgspec

    from miles.algo import LossConfig
    from miles.algo.routing import pack_routing
    from miles.backends import RankInfo, TrainConfig, make_backend
    from miles.backends.base import TrainPhase
    from miles.wire.messages import Sample

    cfg = json.loads((path / "config.json").read_text())
    L, k, E = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg.get("num_experts") or cfg["num_local_experts"]
    tcfg = TrainConfig(backend=args.backend, model_path=str(path),
                       param_dtype="bfloat16" if args.device == "cuda" else "float32", lr=0.0,
                       old_logprobs="recompute", max_tokens_per_microbatch=args.microbatch_tokens)
    backend = make_backend(args.backend)
    backend.init(tcfg, RankInfo(), LossConfig())
    rng = np.random.default_rng(0)
    routed, plain = [], []
    for g in range(args.groups):
        for j in range(8):
            n, r = int(rng.integers(args.sample_tokens // 2, args.sample_tokens)), 0
            r = n * 3 // 4
            ids = np.stack([rng.permutation(E)[:k] for _ in range((n - 1) * L)]).reshape(n - 1, L, k)
            s = Sample(tokens=rng.integers(0, backend.vocab_size, n).astype(np.int32), response_length=r,
                       rollout_logprobs=np.full(r, -1.0, np.float32), reward=float(j % 2), group_id=f"g{g}",
                       status="completed", routed_experts=pack_routing(ids.astype(np.int32), E))
            routed.append(s)
            plain.append(msgspec.structs.replace(s, routed_experts=None))
    phases = {False: TrainPhase("rl", LossConfig(), tcfg),
              True: TrainPhase("rl", LossConfig(), msgspec.structs.replace(tcfg, router_replay=True))}
    times: dict[bool, list[float]] = {False: [], True: []}
    agreement = {}
    for on in (False, True):   # warm-up
        backend.train(routed if on else plain, phases[on])
    progress("trainer warmed up")
    slowest = 0.0
    for step in range(args.steps):
        if step and not budget.fits(slowest, 0.97):
            progress(f"trainer: budget reached after {step} of {args.steps} steps")
            break
        t = time.perf_counter()
        for on in (False, True) if step % 2 == 0 else (True, False):
            sync(backend.device)
            t0 = time.perf_counter()
            m = backend.train(routed if on else plain, phases[on])
            sync(backend.device)
            times[on].append(time.perf_counter() - t0)
            agreement[on] = m.get("routing_agreement")
        slowest = max(slowest, time.perf_counter() - t)
        progress(f"trainer step {step + 1}: {slowest:.1f} s at most per step pair")
    backend.close()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"backend": args.backend, "samples": len(routed), "tokens": int(sum(len(s.tokens) for s in routed)),
            "step_s_off": round(off, 4), "step_s_on": round(on, 4), "overhead": round(on / off - 1, 4),
            "routing_agreement_on": agreement[True], "steps_done": len(times[False])}


def wire_bench(path: Path, tokens: int) -> dict:
    from miles.algo.routing import pack_routing
    from miles.wire.codec import Codec
    from miles.wire.messages import Sample, TrainStep

    cfg = json.loads((path / "config.json").read_text())
    L, k, E = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg.get("num_experts") or cfg["num_local_experts"]
    rng = np.random.default_rng(0)
    wide = rng.integers(0, E, (tokens - 1, L, k)).astype(np.int32)
    ours = pack_routing(wide, E)
    codec = Codec()
    tok = np.zeros(tokens, np.int32)
    frames = lambda r: sum(len(memoryview(f)) for f in codec.encode("call", TrainStep(  # noqa: E731
        samples=[Sample(tokens=tok, routed_experts=r)])))
    return {"tokens": tokens, "layers": L, "top_k": k, "int32_bytes": int(wide.nbytes),
            "base64_bytes": len(base64.b64encode(wide.tobytes())), "ours_bytes": int(ours.nbytes),
            "ours_dtype": str(ours.dtype), "message_bytes_int32": frames(wide), "message_bytes_ours": frames(ours)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, choices=["tiny", "small"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"],
                   help="the trainer part's backend (one rank)")
    p.add_argument("--sample-tokens", type=int, default=256)
    p.add_argument("--microbatch-tokens", type=int, default=4096)
    p.add_argument("--wire-tokens", type=int, default=4096)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: engine,trainer")
    p.add_argument("--budget-s", type=float, default=90.0,
                   help="stop repeating a part once the next repeat would not fit (0: no limit)")
    args = p.parse_args()
    device = torch.device(args.device)
    args.model = args.model or ("small" if device.type == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from miles.tiny import build_tiny_model
    path = build_tiny_model(arch="qwen3_moe", **(SMALL if args.model == "small" else {}))
    progress(f"model {args.model} at {path}")
    skip = set(filter(None, args.skip.split(",")))
    budget = Budget(args.budget_s)
    out = {"bench": "r3", "model": args.model, "device": str(device), "machine": machine(device),
           "budget_s": args.budget_s}
    if "engine" not in skip:
        out["engine"] = asyncio.run(engine_bench(path, device, args, budget))
        print(json.dumps({"bench": "r3", "part": "engine", "model": args.model, "device": str(device),
                          "engine": out["engine"]}), flush=True)
    if "trainer" not in skip:
        out["trainer"] = trainer_bench(path, args, budget)
    out["wire"] = wire_bench(path, args.wire_tokens)
    out["seconds"] = round(time.perf_counter() - T0, 1)
    print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
