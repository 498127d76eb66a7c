"""The in-memory trainer snapshot (`loop.snapshot`, miles/backends/snapshot.py): its memory and
what it costs a training step, against the same steps without it, in the same process.

Prints one JSON line:
  {"bench": "snapshot", "model", "params", "snapshot_mib", "shm_file_mib", "capture_s",
   "write_s", "restore_s", "step_s_off", "step_s_on", "step_overhead", "machine", ...}

- One FSDP rank on gloo (CPU) or the GPU, the tiny quickstart model by default (`--hidden`,
  `--layers` make it bigger); a GRPO batch of `--groups` x 8 samples.
- "off": `--steps` train calls back to back. "on": the same, with the trainer actor's schedule:
  after each call the snapshot (capture to host + the double-buffered write) runs in a worker
  thread, and the next call first waits for it. The overhead is what that wait adds to a step;
  where something else fills the gap between two calls (the driver's confirm and publish), the
  copy hides behind it, so this is the most it can cost.
- capture_s / write_s: the median of the two parts alone; restore_s: one restore into a fresh
  backend (part of a heal's restore time).

    .venv/bin/python bench/snapshot.py [--steps 6] [--hidden 64 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "backends"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=0, help="hidden size (0: the tiny model's)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the tiny model's)")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29731"))
    import torch
    from backend_helpers import make_samples

    from miles.algo import LossConfig
    from miles.backends import RankInfo, TrainConfig, make_backend
    from miles.backends import snapshot
    from miles.wire.snapshot import SnapshotFile, snapshot_bytes
    from miles.tiny import build_tiny_model

    overrides = {}
    if args.hidden:
        overrides.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    path = str(build_tiny_model(arch="qwen3", **overrides))
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=1e-4, max_tokens_per_microbatch=8192)
    loss = LossConfig(advantage_estimator="grpo", loss_reduction="token")
    backend = make_backend("fsdp")
    backend.init(cfg, RankInfo.from_env(), loss)
    batch = make_samples(groups=args.groups, per_group=8, seed=1)
    backend.train(batch)  # warm-up: the optimizer's moments exist from here on
    params = sum(p.numel() for p in backend.policy.parameters())

    def steps(snap: "SnapshotFile | None", parts: list) -> list[float]:
        times, pending = [], None
        for i in range(args.steps):
            t0 = time.perf_counter()
            if pending is not None:
                pending.join()
            metrics = backend.train(batch)
            times.append(time.perf_counter() - t0)
            if snap is not None:
                def copy(call=i + 1, metrics=metrics):
                    t1 = time.perf_counter()
                    meta, arrays = snapshot.capture(backend, call, metrics)
                    t2 = time.perf_counter()
                    snap.write(meta, arrays)
                    parts.append((t2 - t1, time.perf_counter() - t2, snapshot_bytes(arrays)))
                pending = threading.Thread(target=copy)
                pending.start()
        if pending is not None:
            pending.join()
        return times

    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    snap_path = folder / f"miles-snap-bench-{os.getpid()}.snap"
    try:
        off = steps(None, [])
        parts: list = []
        on = steps(SnapshotFile(snap_path), parts)
        off += steps(None, [])  # off before and after on: drift on a shared machine shows
        fresh = make_backend("fsdp")
        fresh.init(cfg, RankInfo.from_env(), loss)
        t0 = time.perf_counter()
        snapshot.restore(fresh, SnapshotFile(snap_path).newest())
        restore_s = time.perf_counter() - t0
        file_bytes = snap_path.stat().st_size
    finally:
        snap_path.unlink(missing_ok=True)
    med_off, med_on = statistics.median(off), statistics.median(on)
    print(json.dumps({
        "bench": "snapshot", "model": f"qwen3 tiny{overrides or ''}", "params": params,
        "device": str(backend.device), "steps": args.steps, "samples_per_step": len(batch),
        "snapshot_mib": round(parts[-1][2] / 2**20, 2), "shm_file_mib": round(file_bytes / 2**20, 2),
        "capture_s": round(statistics.median(p[0] for p in parts), 4),
        "write_s": round(statistics.median(p[1] for p in parts), 4), "restore_s": round(restore_s, 4),
        "step_s_off": round(med_off, 4), "step_s_on": round(med_on, 4),
        "step_overhead": round(med_on / med_off - 1, 4),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                    "load_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__}}), flush=True)


if __name__ == "__main__":
    main()
