"""`miles replay FILE`: re-run a recorded step offline, from the flight recorder's `.mlw` file.

    miles run recipe.toml --set logging.record_wire=true --set 'logging.record_steps=[12]'
    miles replay runs/<name>/wire/driver.mlw --step 12            # the loss, bit for bit
    miles replay runs/<name>/wire/driver.mlw --step 12 --resend http://127.0.0.1:30000

What it does:
- Training: finds the step's `TrainStep`s (every DP rank's shard, put back together by
  `miles.loop.whole_batch`) and the `TrainResult` that came back, builds the recipe's backend
  on ONE rank (gloo, this process), loads the state the trainers had just before that step (the
  driver saves it to `wire/step_NNNNNN/pre_state` when it records a step), trains on the recorded
  batch and compares every metric with the recorded one. On CPU with the same world size the loss is reproduced bit
  for bit; a run recorded with more trainer ranks replays at world size 1, where the data-parallel
  split differs, so the figures are close but not bitwise (the output says which).
- Engine requests (`--resend URL`): rebuilds the `/generate` request of every sample of the batch
  exactly as the built-in rollout worker sent it (prompt ids, sampling params, the seed derived
  from run seed, prompt index, sample index and attempt) and sends it to an engine or gateway at
  URL, then reports how many responses reproduce the recorded tokens. Against the same weights
  version and a deterministic engine they all do; a difference points at the engine.

Output: one JSON line per step (and one per resend), like the benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from miles.actors.trainer import build_backend, phases_for
from miles.config import recipe_from_json
from miles.loop import whole_batch
from miles.wire.messages import TrainResult, TrainStep
from miles.wire.recorder import read_records


def recorded_steps(path: Path) -> dict[int, dict]:
    """step -> {"train": TrainStep, "result": TrainResult, "world": trainer ranks called}."""
    steps: dict[int, dict] = {}
    for rec in read_records(path):
        entry = steps.setdefault(rec.meta.step, {"ranks": set()})
        if isinstance(rec.msg, TrainStep) and rec.meta.direction == "call":
            entry["ranks"].add(rec.meta.peer)
            entry.setdefault("shards", []).append(rec.msg)
        elif isinstance(rec.msg, TrainResult) and rec.meta.direction == "reply":
            if rec.meta.peer.endswith("/0") or "result" not in entry:
                entry["result"] = rec.msg

    for e in steps.values():  # each DP rank received its shard (loop.shard_batch): the whole batch
        if "shards" in e:
            shards = e.pop("shards")
            e["train"] = TrainStep(samples=whole_batch(shards), phase=shards[0].phase)
    return {s: e for s, e in steps.items() if "train" in e}


def _run_dir(path: Path) -> Path:
    return path.parent.parent  # <run>/wire/driver.mlw


def load_run_recipe(path: Path):
    resolved = _run_dir(path) / "recipe.resolved.node0.json"
    if not resolved.exists():
        raise SystemExit(f"miles replay: {resolved} not found (the run directory of {path} holds "
                         f"the resolved recipe a run writes at start)")
    return recipe_from_json(resolved.read_bytes())


def pre_state_dir(path: Path, step: int) -> Path:
    return path.parent / f"step_{step:06d}" / "pre_state"


def _timing(key: str) -> bool:
    """Wall-clock figures (step time, throughput, MFU) differ on every run by nature."""
    return key.endswith("_s") or "per_s" in key or "mfu" in key or "tflops" in key


def replay_train(path: Path, step: int, entry: dict, recipe) -> dict:
    from miles.backends.base import RankInfo

    state = pre_state_dir(path, step)
    if not state.exists():
        raise SystemExit(f"miles replay: step {step}: {state} not found (the driver saves the "
                         f"trainers' state there before a recorded step)")
    backend = build_backend(recipe, RankInfo())
    try:
        backend.load_model(state)
        got = backend.train(entry["train"].samples, phases_for(recipe)[entry["train"].phase])
    finally:
        backend.close()
    want = entry["result"].metrics if "result" in entry else {}
    world = len(entry["ranks"])
    same = {k: (float(got[k]) == float(v)) for k, v in want.items() if k in got and not _timing(k)}
    return {"step": step, "world_recorded": world, "world_replayed": 1,
            "samples": len(entry["train"].samples),
            "recorded_loss": want.get("loss"), "replayed_loss": float(got.get("loss", float("nan"))),
            "bitwise_equal": bool(same) and all(same.values()),  # every metric but timings
            "metrics_compared": len(same),
            "metrics_differing": sorted(k for k, ok in same.items() if not ok)}


async def resend(url: str, entry: dict, recipe) -> dict:
    from miles.actors.rollout import engine_request
    from miles.engines.client import EngineClient

    samples = [s for s in entry["train"].samples if s.response_length > 0]
    same = 0
    async with EngineClient(url, generate_timeout_s=recipe.rollout.request_timeout_s) as client:
        async def one(s):
            prompt_ids, params, rid = engine_request(recipe, s)
            result = await client.generate(prompt_ids, params, return_logprob=True, rid=rid + "-replay")
            return list(result.output_ids) == s.response_ids.tolist()
        results = await asyncio.gather(*(one(s) for s in samples))
    same = sum(results)
    return {"resent": len(samples), "same_tokens": same, "url": url}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="miles replay", description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path, help="a .mlw file written by logging.record_wire")
    p.add_argument("--step", type=int, action="append", default=[],
                   help="the step to replay (repeatable; default: every recorded step)")
    p.add_argument("--resend", metavar="URL", default="",
                   help="also re-send the step's engine requests to this engine or gateway")
    p.add_argument("--no-train", action="store_true", help="skip the training replay")
    args = p.parse_args(argv)
    if not args.file.exists():
        print(f"miles replay: {args.file}: no such file", file=sys.stderr)
        return 2
    steps = recorded_steps(args.file)
    chosen = args.step or sorted(steps)
    missing = [s for s in chosen if s not in steps]
    if missing:
        print(f"miles replay: step(s) {missing} not in {args.file} (recorded: {sorted(steps)})",
              file=sys.stderr)
        return 2
    recipe = load_run_recipe(args.file)
    code = 0
    for step in chosen:
        if not args.no_train:
            out = replay_train(args.file, step, steps[step], recipe)
            print(json.dumps(out), flush=True)
            code |= 0 if out["bitwise_equal"] or out["world_recorded"] != 1 else 1
        if args.resend:
            out = asyncio.run(resend(args.resend, steps[step], recipe))
            print(json.dumps({"step": step, **out}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
