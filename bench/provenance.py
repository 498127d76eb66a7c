"""The cost of sample provenance (and of OpenTelemetry export) on the CPU quickstart.

Prints one JSON line:
  {"bench": "provenance", "steps", "variants": {"off": {...}, "on": {...}, "otel": {...}},
   "overhead_step_frac", "overhead_period_frac", "bytes_per_sample_wire", "bytes_per_sample_jsonl",
   "spans_received", "load_avg", "machine"}

- Each variant is one `miles run recipes/quickstart.toml` of `--steps` RL steps (a 5-step warm
  start, no evaluation between, buffer.filter = none so every step trains 64 samples):
  off = logging.provenance false; on = the default (stamped, journalled, provenance.jsonl);
  otel = on plus logging.otel set to an OTLP/HTTP receiver on loopback that this script runs
  (spans decoded with opentelemetry-proto and counted).
- `step_s`: the median of `perf/step_s` (train + confirm + provenance log + publish) over the
  steps; `period_s`: the median time between two train rows (the whole step, waiting for the
  batch included: what a slower rollout would show). The variants run in the order given
  (default off,on,otel,otel,on,off: each twice, mirrored, so a drift of the machine's load
  weighs on all alike) and each figure is the median over its runs' steps.
- `bytes_per_sample_wire`: the median msgpack size of a Provenance record (what it adds to a
  Sample on the wire and in the buffer journal); `_jsonl`: of its provenance.jsonl line.
- Same-run baseline: "off" is measured in the same invocation, on the same machine.
- On a loaded 2-core host the runs' medians move by tens of percent from run to run (other
  jobs), far more than the record costs; so the line also has the work itself, timed in this
  process: `stamp_us` (the rollout's stamp of one sample) and `log_us` (the driver's
  provenance.jsonl row of one sample), medians of 2000, and `cpu_frac_of_step` = (stamp + log)
  x samples per step / the off variant's median step time: the share of a step they add, CPU
  time with nothing overlapped (an upper bound; the stamp runs in the rollout process).

Usage: .venv/bin/python bench/provenance.py [--steps 20] [--order off,on,otel,otel,on,off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from miles.hostinfo import machine  # noqa: E402
from miles.rl.provenance import FILE, LineageRow, read_jsonl  # noqa: E402


class _Receiver(BaseHTTPRequestHandler):
    spans = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        _Receiver.spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def run(variant: str, steps: int, out: Path, otlp: str) -> dict:
    sets = {"run.output_dir": json.dumps(str(out)), "run.name": json.dumps(out.name),
            "logging.progress": "false", "loop.num_steps": str(steps), "sft.steps": "5",
            "loop.eval_every": "0", "eval.n_prompts": "10", "loop.save_every": "0",
            "buffer.filter": '"none"', "logging.plot": "false",
            "logging.provenance": "false" if variant == "off" else "true",
            "logging.otel": json.dumps(otlp if variant == "otel" else "none")}
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: miles run exited {proc.returncode}: {proc.stdout[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    times = [r["time_s"] for r in train]
    return {"step_s": [r["perf/step_s"] for r in train],
            "period_s": [b - a for a, b in zip(times, times[1:])]}


def micro(n: int = 2000) -> dict:
    """Per-sample CPU time of the stamp and of the lineage row (see the module docstring)."""
    import time
    import numpy as np
    from miles.config import load_recipe
    from miles.engines.sampling_params import sampling_params
    from miles.rl.provenance import ProvenanceLog, Stamper, note_engine
    from miles.wire.messages import Sample, VersionSpan

    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml")
    stamper, sampling = Stamper(recipe), sampling_params(recipe.rollout, 7)
    samples = [Sample(tokens=np.arange(20, dtype=np.int32), response_length=6, reward=1.0,
                      status="completed", weight_versions=[VersionSpan(3, 0, 6)], group_id="g",
                      rollout_id=f"g-{i}", index=i, metadata={"prompt_index": i}) for i in range(n)]
    t = time.perf_counter()
    for s in samples:
        note_engine(s, {"engine_id": "127.0.0.1:30000", "engine_incarnation": 1})
        stamper.stamp(s, sampling, queued_at=1.0, started_at=2.0)
    stamp = (time.perf_counter() - t) / n
    with tempfile.TemporaryDirectory() as tmp:
        log = ProvenanceLog(tmp, fresh=True)
        t = time.perf_counter()
        for i in range(0, n, 64):
            log.write(1, samples[i:i + 64])
        write = (time.perf_counter() - t) / n
    return {"stamp_us": round(stamp * 1e6, 2), "log_us": round(write * 1e6, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--order", default="off,on,otel,otel,on,off")
    p.add_argument("--micro-only", action="store_true", help="only the in-process per-sample timings")
    a = p.parse_args()
    if a.micro_only:
        print(json.dumps({"bench": "provenance", **micro(), "machine": machine()}), flush=True)
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    otlp = f"http://127.0.0.1:{server.server_address[1]}"
    samples: dict[str, dict[str, list[float]]] = {}
    wire, jsonl = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(a.order.split(",")):
            out = Path(tmp) / f"{variant}{i}"
            got = run(variant, a.steps, out, otlp)
            print(f"{variant}: step_s median {statistics.median(got['step_s']):.3f}", file=sys.stderr)
            for k, v in got.items():
                samples.setdefault(variant, {}).setdefault(k, []).extend(v)
            if variant == "on" and not wire:
                for row, line in zip(read_jsonl(out / FILE, LineageRow), (out / FILE).read_bytes().splitlines()):
                    rec = row.record()
                    if rec is not None:
                        wire.append(len(msgspec.msgpack.encode(rec)))
                        jsonl.append(len(line) + 1)
    server.shutdown()
    med = {v: {k: round(statistics.median(x), 4) for k, x in d.items()} for v, d in samples.items()}
    result = {"bench": "provenance", "steps": a.steps, "order": a.order, "variants": med,
              "runs_step_s": {v: [round(statistics.median(d["step_s"][i:i + a.steps]), 3)
                                  for i in range(0, len(d["step_s"]), a.steps)] for v, d in samples.items()}}
    work = micro()
    result.update(work)
    if "off" in med:   # the quickstart trains 8 groups x 8 samples per step
        result["cpu_frac_of_step"] = round((work["stamp_us"] + work["log_us"]) * 64e-6 / med["off"]["step_s"], 5)
    if "off" in med and "on" in med:
        result["overhead_step_frac"] = round(med["on"]["step_s"] / med["off"]["step_s"] - 1, 4)
        result["overhead_period_frac"] = round(med["on"]["period_s"] / med["off"]["period_s"] - 1, 4)
    if "otel" in med and "off" in med:
        result["otel_overhead_step_frac"] = round(med["otel"]["step_s"] / med["off"]["step_s"] - 1, 4)
    result.update({"bytes_per_sample_wire": statistics.median(wire) if wire else None,
                   "bytes_per_sample_jsonl": statistics.median(jsonl) if jsonl else None,
                   "spans_received": _Receiver.spans, "load_avg": round(os.getloadavg()[0], 1),
                   "machine": machine()})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
