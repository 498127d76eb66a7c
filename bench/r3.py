"""R3 costs: engine decode with and without routing capture, trainer step with and without replay,
routing bytes per sample on the wire. Prints one JSON line:

  {"bench": "r3", "model", "machine", "engine": {"decode_ms_per_step_off", "..._on", "overhead"},
   "trainer": {"step_s_off", "step_s_on", "overhead", "routing_agreement_on"},
   "wire": {"tokens", "int32_bytes", "base64_bytes", "ours_bytes", "ours_dtype"}}

- Model: `tiny` (miles.tiny qwen3_moe: 2 layers, 8 experts, top-2; the CPU default) or `small`
  (Qwen3-MoE-shaped: hidden 1024, 16 layers, 64 experts, top-8, moe_intermediate 256; the GPU
  default). Random weights, built once offline.
- Engine: the embedded engine in this process (its own CLI parser for real defaults), a batch of
  `--batch` requests, `--new-tokens` decoded each; decode time per step from a long and a short run
  (prefill cancels), capture off/on alternated `--repeats` times, medians.
- Trainer: a one-rank FSDP backend, lr 0 (the same weights every step), old log-probs recomputed
  (the no-grad pass replays too), the same GRPO batch with routing on every sample; off = the
  batch without routing (nothing patched runs but the router's own top-k), on = replay. Medians of
  `--steps` steps after one warm-up, alternated.
- Wire: one sample of `--wire-tokens` tokens with the model's (layers, top_k): SGLang's int32, its
  base64 in JSON, and our uint8/uint16 frame as encoded by miles.wire.codec.

Usage: .venv/bin/python bench/r3.py [--device cpu|cuda] [--model tiny|small] [--batch 16]
       [--new-tokens 64] [--steps 5] [--repeats 3]
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


async def engine_bench(path: Path, device: torch.device, args) -> dict:
    from miles.engines.embedded import build_parser, build_server
    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.scheduler import Request

    prompt_len, short = 32, max(2, args.new_tokens // 4)
    ns = build_parser().parse_args([
        "--model-path", str(path), "--skip-tokenizer-init", "--device", str(device), "--dtype", args.dtype,
        "--max-running-requests", str(args.batch), "--enable-return-routed-experts",
        "--max-total-tokens", str(args.batch * (prompt_len + args.new_tokens) + 1024),
        "--context-length", str(prompt_len + args.new_tokens + 64), "--random-seed", "0",
        "--torch-threads", str(torch.get_num_threads())])
    server = build_server(ns)
    server.scheduler.start()
    V = server.runner.shape.vocab_size

    async def run(new_tokens: int, capture: bool, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        reqs = [Request(rid=f"r{seed}-{capture}-{i}", input_ids=torch.randint(0, V, (prompt_len,), generator=g).tolist(),
                        params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True),
                        seed=seed * 1000 + i, max_new_tokens=new_tokens, return_routed_experts=capture)
                for i in range(args.batch)]
        sync(device)
        t0 = time.perf_counter()
        for r in reqs:
            server.scheduler.submit(r)
        await asyncio.gather(*(r.done.wait() for r in reqs))
        sync(device)
        assert all(len(r.output_ids) == new_tokens for r in reqs)
        assert all((r.routed is not None) == capture for r in reqs)
        return time.perf_counter() - t0

    per_step: dict[bool, list[float]] = {False: [], True: []}
    try:
        await run(args.new_tokens, True, 1)   # warm-up
        for k in range(args.repeats):
            for capture in (False, True) if k % 2 == 0 else (True, False):
                long = await run(args.new_tokens, capture, 10 + k)
                shrt = await run(short, capture, 50 + k)
                per_step[capture].append((long - shrt) / (args.new_tokens - short))
    finally:
        await server.scheduler.close()
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    # the best run of each as well: on a shared machine other processes only ever add time
    best_off, best_on = min(per_step[False]), min(per_step[True])
    return {"batch": args.batch, "decode_ms_per_step_off": round(off * 1e3, 3),
            "decode_ms_per_step_on": round(on * 1e3, 3), "overhead": round(on / off - 1, 4),
            "best_ms_off": round(best_off * 1e3, 3), "best_ms_on": round(best_on * 1e3, 3),
            "best_overhead": round(best_on / best_off - 1, 4)}


def trainer_bench(path: Path, args) -> dict:
    import msgspec

    from miles.algo import LossConfig
    from miles.algo.routing import pack_routing
    from miles.backends import RankInfo, TrainConfig, make_backend
    from miles.backends.base import TrainPhase
    from miles.wire.messages import Sample

    cfg = json.loads((path / "config.json").read_text())
    L, k, E = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg.get("num_experts") or cfg["num_local_experts"]
    tcfg = TrainConfig(model_path=str(path), param_dtype="bfloat16" if args.device == "cuda" else "float32",
                       lr=0.0, old_logprobs="recompute", max_tokens_per_microbatch=args.microbatch_tokens)
    backend = make_backend("fsdp")
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
    for step in range(args.steps):
        for on in (False, True) if step % 2 == 0 else (True, False):
            sync(backend.device)
            t0 = time.perf_counter()
            m = backend.train(routed if on else plain, phases[on])
            sync(backend.device)
            times[on].append(time.perf_counter() - t0)
            agreement[on] = m.get("routing_agreement")
    backend.close()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"samples": len(routed), "tokens": int(sum(len(s.tokens) for s in routed)),
            "step_s_off": round(off, 4), "step_s_on": round(on, 4), "overhead": round(on / off - 1, 4),
            "routing_agreement_on": agreement[True]}


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
    p.add_argument("--sample-tokens", type=int, default=256)
    p.add_argument("--microbatch-tokens", type=int, default=4096)
    p.add_argument("--wire-tokens", type=int, default=4096)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: engine,trainer")
    args = p.parse_args()
    device = torch.device(args.device)
    args.model = args.model or ("small" if device.type == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from miles.tiny import build_tiny_model
    path = build_tiny_model(arch="qwen3_moe", **(SMALL if args.model == "small" else {}))
    skip = set(filter(None, args.skip.split(",")))
    out = {"bench": "r3", "model": args.model, "device": str(device), "machine": machine(device)}
    if "engine" not in skip:
        out["engine"] = asyncio.run(engine_bench(path, device, args))
    if "trainer" not in skip:
        out["trainer"] = trainer_bench(path, args)
    out["wire"] = wire_bench(path, args.wire_tokens)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
