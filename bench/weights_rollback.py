"""The stall of a disk_delta publish with the fleet transaction (weights.rollback) against without.

Prints one JSON line:
  {"bench": "weights_rollback", "rounds", "rollback": {"stall_s", "prepare_s"},
   "no_rollback": {...}, "stall_ratio", "load_avg", "machine"}

- One real CPU embedded engine (a tiny 2-layer model), one WeightPublisher over disk_delta. After
  a raw first publish, `--rounds` publishes of a model nudged by 1e-3 noise each time, with
  `weights.rollback` on and off in ABBA order (the transport reads it at every prepare), so
  both see the same machine load drift. `stall_s` is the publish's stall (the commit's round trip:
  the engine's swap under its step lock, PublishReport), `prepare_s` the engine's decode + verify
  (+ the copy of the replaced bytes with rollback on), medians over the rounds of each.
- The bound (issue 40): stall_ratio = stall with / stall without <= 1.1. The copy that makes the
  rollback possible is made while the engine prepares, off the step lock, so only prepare_s
  should grow.
- bench/weights.py --transport disk_delta [--no-rollback] times the same on the real model
  shapes, one setting per run (GPU).

Usage: .venv/bin/python bench/weights_rollback.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from miles.engines.embedded import launch_embedded_engine  # noqa: E402
from miles.hostinfo import machine  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402
from miles.weights import WeightPublisher, WeightsConfig, make_transport  # noqa: E402


async def main(rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(num_hidden_layers=2)
        engine = await launch_embedded_engine(path, log_path=Path(tmp) / "engine.log", ready_timeout_s=600,
                                              extra_args=["--torch-threads", "1", "--log-level", "warning"])
        try:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            cfg = WeightsConfig(transport="disk_delta", disk_dir=str(Path(tmp) / "d"), delta_threads=2)
            transport = make_transport(cfg, rank=0)
            publisher = WeightPublisher(cfg, [engine.url], transport)
            await publisher.connect()

            def run_update(version):
                return lambda: transport.send(version, [[(n, p.detach()) for n, p in model.named_parameters()]])

            await publisher.publish(1, run_update(1))
            got: dict[bool, list] = {True: [], False: []}
            for i in range(rounds):
                cfg.rollback = i % 4 in (0, 3)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3)
                report = await publisher.publish(i + 2, run_update(i + 2))
                got[cfg.rollback].append((report.stall_s, report.prepare_s))
            await publisher.close()
            transport.close()
        finally:
            await engine.stop_async()
    med = {k: {"stall_s": statistics.median(s for s, _ in v), "prepare_s": statistics.median(p for _, p in v),
               "n": len(v)} for k, v in got.items()}
    return {"bench": "weights_rollback", "rounds": rounds, "rollback": med[True], "no_rollback": med[False],
            "stall_ratio": round(med[True]["stall_s"] / med[False]["stall_s"], 4),
            "load_avg": round(os.getloadavg()[0], 1), "machine": machine()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    print(json.dumps(asyncio.run(main(p.parse_args().rounds))), flush=True)
