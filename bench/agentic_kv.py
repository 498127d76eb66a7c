"""Engine time per turn of one long agent session, with the prefix cache on and off.

    python bench/agentic_kv.py --device cpu      # tiny Qwen3, fp32, 64 turns, ~1k -> ~32k history
    python bench/agentic_kv.py --device cuda     # 0.5B Qwen2 shape, bf16
    python bench/agentic_kv.py --model-path DIR  # an existing HF checkpoint directory

One JSON line: {"bench": "agentic_kv", "turn_s": {"cache": {"1k", "8k", "16k", "32k"},
"no_cache": {...}}, "ratio_32k_1k_cache", "ratio_32k_1k_no_cache", "hit_rate", "machine", ...}.

Design decisions:
- Two real engine processes (`python -m miles.engines.embedded`, one with `--disable-radix-cache`)
  started in the same run, driven over HTTP like the TITO session server drives one: every turn's
  input ids are exactly the previous turn's input + that engine's own output ids + the new
  "messages" (random ids). The engines take turns (never both at once), so on a small machine
  neither steals the other's cores.
- "Engine time" is the engine's own `meta_info.e2e_latency` (queueing + prefill + decode), not the
  HTTP round trip; the history length of a turn is its prompt length. Figures at 1k/8k/16k/32k
  are the turn whose history is nearest.
- The model is built with miles.tiny with `max_position_embeddings` raised to the session's length
  (the tiny defaults stop at 4096), and the engine gets the same `--context-length`; the pool
  (`--max-total-tokens`) holds 3 contexts, so the cache (half the pool by default) keeps the
  whole history.
- Greedy decoding with `ignore_eos`: every turn has the same output length on both engines.
- Turn 0 opens the session and is not measured: it has nothing to hit and pays first-call costs
  (allocator growth); on CUDA every decode graph is captured at start-up
  (`--cuda-graph-precapture-kv` = the context), so no capture lands in a measured turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from miles.hostinfo import machine

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
POINTS = {"1k": 1024, "8k": 8192, "16k": 16384, "32k": 32768}


def build_model(name: str, context: int) -> Path:
    from miles.tiny import build_tiny_model
    if name == "qwen2-0.5b":
        return build_tiny_model(arch="qwen2", **{**QWEN2_05B, "max_position_embeddings": context})
    if name == "tiny":
        return build_tiny_model(arch="qwen3", max_position_embeddings=context)
    raise SystemExit(f"--model: {name!r} is not tiny or qwen2-0.5b")


async def run_session(clients: dict, args, vocab: int) -> dict[str, list[tuple]]:
    """The same session shape on every engine; per engine [(history, engine_s, cached, output)]."""
    rng = random.Random(0)
    growth = (args.end_tokens - args.start_tokens) / max(args.turns - 1, 1)
    new_per_turn = max(1, round(growth) - args.output_tokens)
    # Turn 0 opens the session (nothing to hit yet, and first-call costs), so that turn 1, the
    # first measured one, has `start_tokens` of history.
    start = [rng.randrange(3, vocab) for _ in range(max(1, args.start_tokens - round(growth)))]
    history = {name: list(start) for name in clients}
    out = {name: [] for name in clients}
    sp = {"max_new_tokens": args.output_tokens, "temperature": 0.0, "ignore_eos": True}
    for turn in range(args.turns + 1):
        new = [rng.randrange(3, vocab) for _ in range(new_per_turn)] if turn else []
        for name, client in clients.items():
            ids = history[name] + new
            res = await client.generate(ids, sp, timeout_s=args.turn_timeout_s)
            out[name].append((len(ids), res.e2e_latency_s, res.cached_tokens, res.output_ids))
            history[name] = ids + res.output_ids
    return out


def at_points(rows: list[tuple]) -> dict[str, float]:
    return {k: round(min(rows, key=lambda r: abs(r[0] - n))[1], 4) for k, n in POINTS.items()}


async def main_async(args) -> dict:
    from miles.engines.client import EngineClient
    from miles.engines.embedded import launch_embedded_engine
    context = args.end_tokens + args.output_tokens + 1024
    path = Path(args.model_path) if args.model_path else build_model(args.model, context)
    common = ["--skip-tokenizer-init", "--device", args.device, "--dtype", args.dtype,
              "--context-length", str(context), "--max-total-tokens", str(3 * context),
              "--max-running-requests", "4", "--torch-threads", str(args.torch_threads),
              "--random-seed", "0", "--log-level", "warning"]
    if args.device.startswith("cuda"):  # every decode graph captured before the session starts
        common += ["--cuda-graph-precapture-kv", str(context)]
    logs = Path(tempfile.mkdtemp(prefix="agentic_kv."))
    engines = {}
    try:
        for name, extra in (("cache", []), ("no_cache", ["--disable-radix-cache"])):
            engines[name] = await launch_embedded_engine(path, extra_args=common + extra,
                                                         log_path=logs / f"{name}.log",
                                                         ready_timeout_s=600)
        clients = {name: EngineClient(e.url) for name, e in engines.items()}
        try:
            rows = await run_session(clients, args, await vocab_size(clients["cache"]))
            rows = {name: r[1:] for name, r in rows.items()}  # turn 0 opened the session
            state = (await clients["cache"].server_info())["internal_states"][0]
        finally:
            for c in clients.values():
                await c.close()
    finally:
        for e in engines.values():
            await e.stop_async(grace_s=2)
    points = {name: at_points(r) for name, r in rows.items()}
    return {
        "bench": "agentic_kv", "model": f"{args.model_path or args.model} {args.dtype}",
        "turns": args.turns, "history_tokens": [rows["cache"][0][0], rows["cache"][-1][0]],
        "output_tokens": args.output_tokens, "turn_s": points,
        "ratio_32k_1k_cache": round(points["cache"]["32k"] / points["cache"]["1k"], 2),
        "ratio_32k_1k_no_cache": round(points["no_cache"]["32k"] / points["no_cache"]["1k"], 2),
        "total_s": {name: round(sum(r[1] for r in rs), 2) for name, rs in rows.items()},
        "hit_rate": round(sum(r[2] for r in rows["cache"]) / sum(r[0] for r in rows["cache"]), 4),
        "hit_rate_engine": round(state["cache_hit_rate"], 4),  # since start: turn 0 included
        # greedy: the same tokens on both engines until the first turn that differs (rounding)
        "turns_with_equal_output": next((i for i, (a, b) in enumerate(zip(rows["cache"], rows["no_cache"]))
                                         if a[3] != b[3]), args.turns),
        "min_cached_fraction": round(min(r[2] / r[0] for r in rows["cache"]), 4),
        "machine": machine(args.device), "device": args.device, "torch_threads": args.torch_threads,
    }


async def vocab_size(client) -> int:
    return int((await client.model_info())["vocab_size"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--model", default=None, help="tiny (default on CPU) or qwen2-0.5b (default on CUDA)")
    p.add_argument("--model-path", default=None, help="an HF checkpoint directory instead of --model")
    p.add_argument("--dtype", default=None)
    p.add_argument("--turns", type=int, default=64)
    p.add_argument("--start-tokens", type=int, default=1024)
    p.add_argument("--end-tokens", type=int, default=32768)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--turn-timeout-s", type=float, default=600.0)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("qwen2-0.5b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.turns < 2 or args.start_tokens < 1 or args.end_tokens <= args.start_tokens:
        raise SystemExit(f"--turns {args.turns} --start-tokens {args.start_tokens} --end-tokens "
                         f"{args.end_tokens}: need >= 2 turns and a history that grows")
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
