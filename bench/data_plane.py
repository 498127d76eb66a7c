"""The driver -> trainer data plane: a rollout batch with R3 routing arrays to DP 1/2/4 ranks.

Prints one JSON line:
  {"bench": "data_plane", "batch_MB", "rows": [{"dp", "send", "shm", "seconds", "GBps",
   "cpu_s", "GB_per_cpu_s", "rank_MB", "total_MB"}, ...], "sweep": [{"MB", "frames_GBps",
   "shm_GBps", "speedup", "frames_cpu_s", "shm_cpu_s", "cpu_ratio"}, ...],
   "ray": [...] or "ray: unavailable (<why>)", "shard_fn", "load_avg", "machine"}
and the same figures as a table on stderr.

- The batch: `--samples` Samples of `--tokens` int32 tokens, float32 rollout log-probs over the
  response (half the tokens), uint8 R3 routing (tokens - 1, `--layers`, `--top-k`); groups of 8.
- Ranks: `dp` real trainer-rank processes, each an `Actor` answering `TrainStep` (it reads every
  array's length, nothing more, the same for each transport); the driver calls them all at once
  with `ActorRef.call`, the path `miles.loop` takes. `seconds`: from the first send to the last
  reply, median of `--rounds` after one warm-up.
- `send`: "shard" is `miles.loop.shard_batch` (each rank only its DP share, plus the batch
  index); "whole" is the same-run baseline of the whole batch to every rank. `shm`: the driver's
  runtime with `shm_min_bytes` = 1 (every call through shared memory) or 0 (ZeroMQ frames).
  `GBps` = bytes delivered to all ranks / seconds; `rank_MB` = array bytes one rank receives.
  `cpu_s`: CPU seconds of the driver and every rank for one send (all threads, kernel time
  included), the figure that stays fair when other work loads the machine: wall time there
  favours the path with more threads (frames keep ZeroMQ's I/O threads on both ends busy).
- `sweep`: one rank, the whole batch scaled to each of `--sweep-mb`, frames against shm in
  alternating rounds (load from anything else on the machine falls on both alike): where shm is
  not faster, `cluster.shm_min_bytes` should stay above that size.
- Ray: the same arrays (a list of per-sample dicts) `ray.put` by the driver and fetched by `dp`
  Ray actors (zero-copy numpy views from the object store), whole and sharded, in the venv
  `bench/ray_venv.sh` makes (never a Miles dependency); "unavailable (<why>)" when it cannot run.

Usage: .venv/bin/python bench/data_plane.py [--ray-python .cache/bench/ray/bin/python]
       [--samples 512] [--dp 1,2,4] [--sweep-mb 1,4,16,64,256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from miles.hostinfo import machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sample_bytes(tokens: int, layers: int, top_k: int) -> int:
    return tokens * 4 + tokens // 2 * 4 + (tokens - 1) * layers * top_k


def make_samples(n: int, tokens: int, layers: int, top_k: int) -> list:
    from miles.wire.messages import Sample
    rng = np.random.default_rng(0)
    resp = tokens // 2
    return [Sample(tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), response_length=resp,
                   rollout_logprobs=-rng.random(resp, dtype=np.float32),
                   routed_experts=rng.integers(0, 64, (tokens - 1, layers, top_k), dtype=np.uint8),
                   reward=1.0, status="completed", group_id=f"g{i // 8}", index=i % 8)
            for i in range(n)]


def array_bytes(step) -> int:
    total = sum(s.tokens.nbytes + s.rollout_logprobs.nbytes + s.routed_experts.nbytes
                for s in step.samples)
    index = getattr(step, "index", None)
    if index is not None:
        total += sum(getattr(index, f).nbytes for f in index.__struct_fields__
                     if isinstance(getattr(index, f), np.ndarray))
    return total


def shard(samples: list, dp: int) -> tuple[list, str]:
    """One TrainStep per rank: `miles.loop.shard_batch` where it exists."""
    from miles.wire.messages import TrainStep
    try:
        from miles.loop import shard_batch
    except ImportError:  # before the sharding data plane landed: contiguous groups
        per = -(-len(samples) // dp)
        return [TrainStep(samples=samples[r * per:(r + 1) * per]) for r in range(dp)], "fallback"
    from miles.config import TrainConfig
    return shard_batch(samples, TrainConfig(), dp), "miles.loop.shard_batch"


# ----- trainer ranks ----------------------------------------------------------------------------

def _serve_rank(q, name):
    from miles.runtime import Actor, Runtime, run_event_loop
    from miles.wire.messages import TrainResult, TrainStep

    class Rank(Actor):
        def on_train_step(self, msg: TrainStep) -> TrainResult:
            return TrainResult(metrics={"samples": float(len(msg.samples)), "bytes": float(sum(
                len(s.tokens) + len(s.rollout_logprobs) + len(s.routed_experts)
                for s in msg.samples)), "cpu_s": time.process_time()})

    async def main():
        actor = Rank(name)
        q.put(await actor.start(Runtime(shm_min_bytes=0), register=False))
        await actor.serve_forever()

    run_event_loop(main())


def start_ranks(n: int) -> tuple[list, list[str]]:
    ctx = mp.get_context("spawn")
    procs, endpoints = [], []
    for r in range(n):
        q = ctx.Queue()
        p = ctx.Process(target=_serve_rank, args=(q, f"trainer/{r}"), daemon=True)
        p.start()
        procs.append(p)
        try:
            endpoints.append(q.get(timeout=60))
        except Exception:
            raise SystemExit(f"trainer rank {r} did not start within 60 s") from None
    return procs, endpoints


_rank_cpu: dict[int, float] = {}


async def timed_send(refs: list, steps: list, expect: list[int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the driver and every rank, all threads and the kernel's
    work for them included: the figure that stays fair when the machine is loaded)."""
    t, cpu = time.perf_counter(), time.process_time()
    replies = await asyncio.gather(*(ref.call(step, timeout_s=300) for ref, step in zip(refs, steps)))
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    for i, (reply, n) in enumerate(zip(replies, expect)):
        assert reply.metrics["samples"] == n, f"a rank got {reply.metrics} of {n} samples"
        now = reply.metrics["cpu_s"]
        cpu += now - _rank_cpu.get(i, now)  # the first call only sets the mark
        _rank_cpu[i] = now
    return seconds, cpu


def figures(runs: list[tuple[float, float]], nbytes: int) -> dict:
    seconds, cpu = float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs]))
    return {"seconds": round(seconds, 4), "GBps": round(nbytes / seconds / 1e9, 3),
            "cpu_s": round(cpu, 4), "GB_per_cpu_s": round(nbytes / max(cpu, 1e-9) / 1e9, 3)}


async def miles_rows(samples: list, dps: list[int], rounds: int, endpoints: list[str]) -> tuple[list, str]:
    from miles.runtime import Runtime
    from miles.wire.messages import TrainStep
    runtimes = {on: Runtime(shm_min_bytes=1 if on else 0) for on in (True, False)}
    rows, shard_fn = [], ""
    try:
        for dp in dps:
            sharded, shard_fn = shard(samples, dp)
            plans = {"shard": sharded, "whole": [TrainStep(samples=samples)] * dp}
            for send, steps in plans.items():
                expect = [len(s.samples) for s in steps]
                per_rank = [array_bytes(s) for s in steps]
                times: dict[bool, list] = {True: [], False: []}
                refs = {on: [rt.ref_at(ep, f"trainer/{i}") for i, ep in enumerate(endpoints[:dp])]
                        for on, rt in runtimes.items()}
                for on in (True, False):
                    await timed_send(refs[on], steps, expect)  # warm-up: connections, page cache
                for _ in range(rounds):  # alternating, so outside load falls on both alike
                    for on in (True, False):
                        times[on].append(await timed_send(refs[on], steps, expect))
                for on in (True, False):
                    rows.append({"dp": dp, "send": send, "shm": on,
                                 **figures(times[on], sum(per_rank)),
                                 "rank_MB": round(max(per_rank) / 1e6, 1),
                                 "total_MB": round(sum(per_rank) / 1e6, 1)})
    finally:
        for rt in runtimes.values():
            rt.close()
    return rows, shard_fn


async def sweep(sizes_mb: list[float], args, endpoint: str) -> list[dict]:
    from miles.runtime import Runtime
    from miles.wire.messages import TrainStep
    runtimes = {on: Runtime(shm_min_bytes=1 if on else 0) for on in (True, False)}
    out = []
    try:
        per = sample_bytes(args.tokens, args.layers, args.top_k)
        for mb in sizes_mb:
            samples = make_samples(max(1, round(mb * 1e6 / per)), args.tokens, args.layers, args.top_k)
            step = TrainStep(samples=samples)
            nbytes = array_bytes(step)
            refs = {on: [rt.ref_at(endpoint, "trainer/0")] for on, rt in runtimes.items()}
            times: dict[bool, list] = {True: [], False: []}
            for on in (True, False):
                await timed_send(refs[on], [step], [len(samples)])
            for _ in range(args.rounds):
                for on in (True, False):
                    times[on].append(await timed_send(refs[on], [step], [len(samples)]))
            frames, on = figures(times[False], nbytes), figures(times[True], nbytes)
            out.append({"MB": round(nbytes / 1e6, 1), "frames_GBps": frames["GBps"],
                        "shm_GBps": on["GBps"], "speedup": round(frames["seconds"] / on["seconds"], 2),
                        "frames_cpu_s": frames["cpu_s"], "shm_cpu_s": on["cpu_s"],
                        "cpu_ratio": round(frames["cpu_s"] / max(on["cpu_s"], 1e-9), 2)})
    finally:
        for rt in runtimes.values():
            rt.close()
    return out


# ----- Ray ---------------------------------------------------------------------------------------

RAY_SCRIPT = r'''
import json, sys, time
import numpy as np
import ray
n, tokens, layers, top_k, rounds = map(int, sys.argv[1:6])
dps = [int(x) for x in sys.argv[6].split(",")]
ray.init(num_cpus=max(dps) + 1, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_cpus=1)
class Rank:
    def train(self, samples):  # numpy arrays arrive as zero-copy views of the object store
        return len(samples), sum(len(s["tokens"]) + len(s["logprobs"]) + len(s["routing"]) for s in samples)

rng = np.random.default_rng(0)
resp = tokens // 2
samples = [{"tokens": rng.integers(0, 150000, tokens, dtype=np.int32),
            "logprobs": -rng.random(resp, dtype=np.float32),
            "routing": rng.integers(0, 64, (tokens - 1, layers, top_k), dtype=np.uint8),
            "group": f"g{i // 8}"} for i in range(n)]
nbytes = lambda ss: sum(s["tokens"].nbytes + s["logprobs"].nbytes + s["routing"].nbytes for s in ss)
ranks = [Rank.remote() for _ in range(max(dps))]
ray.get([r.train.remote([]) for r in ranks])
rows = []
for dp in dps:
    per = -(-n // dp)
    for send in ("shard", "whole"):
        parts = [samples[r * per:(r + 1) * per] for r in range(dp)] if send == "shard" else [samples] * dp
        def once():
            t = time.perf_counter()
            refs = {}
            for p in parts:  # the whole batch is put once and fetched by every rank
                if id(p) not in refs:
                    refs[id(p)] = ray.put(p)
            got = ray.get([r.train.remote(refs[id(p)]) for r, p in zip(ranks, parts)])
            assert [g[0] for g in got] == [len(p) for p in parts]
            return time.perf_counter() - t
        once()
        s = float(np.median([once() for _ in range(rounds)]))
        total = sum(nbytes(p) for p in parts)
        rows.append({"dp": dp, "send": send, "seconds": round(s, 4), "GBps": round(total / s / 1e9, 3),
                     "rank_MB": round(max(nbytes(p) for p in parts) / 1e6, 1),
                     "total_MB": round(total / 1e6, 1)})
print(json.dumps({"ray": rows, "ray_version": ray.__version__}))
'''


def bench_ray(python: str | None, args, dps: list[int]) -> dict:
    if not python:
        return {"ray": "ray: unavailable (no --ray-python; bench/ray_venv.sh makes one)"}
    if not Path(python).exists():
        return {"ray": f"ray: unavailable ({python} does not exist; run bench/ray_venv.sh)"}
    try:
        out = subprocess.run([python, "-c", RAY_SCRIPT, str(args.samples), str(args.tokens),
                              str(args.layers), str(args.top_k), str(args.rounds),
                              ",".join(map(str, dps))], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"ray": "ray: unavailable (its run did not finish within 900 s)"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        why = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return {"ray": f"ray: unavailable ({why[0][:300]})"}
    return json.loads(lines[-1])


def table(result: dict) -> str:
    lines = [f"batch {result['batch_MB']} MB ({result['samples']} samples), sharding by "
             f"{result['shard_fn']}; {result['machine']}, load {result['load_avg']}",
             f"{'dp':>3} {'send':>6} {'path':>7} {'rank MB':>8} {'total MB':>9} {'s':>7} {'GB/s':>6}"
             f" {'cpu s':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['dp']:>3} {r['send']:>6} {'shm' if r['shm'] else 'frames':>7} "
                     f"{r['rank_MB']:>8} {r['total_MB']:>9} {r['seconds']:>7} {r['GBps']:>6} "
                     f"{r['cpu_s']:>7}")
    if isinstance(result["ray"], list):
        for r in result["ray"]:
            lines.append(f"{r['dp']:>3} {r['send']:>6} {'ray':>7} {r['rank_MB']:>8} "
                         f"{r['total_MB']:>9} {r['seconds']:>7} {r['GBps']:>6}")
    else:
        lines.append(result["ray"])
    lines.append(f"{'MB':>7} {'frames GB/s':>12} {'shm GB/s':>9} {'speedup':>8} "
                 f"{'frames cpu s':>13} {'shm cpu s':>10}")
    for r in result["sweep"]:
        lines.append(f"{r['MB']:>7} {r['frames_GBps']:>12} {r['shm_GBps']:>9} {r['speedup']:>8} "
                     f"{r['frames_cpu_s']:>13} {r['shm_cpu_s']:>10}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--sweep-mb", default="1,4,16,64,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ray-python", default=None)
    args = ap.parse_args()
    dps = [int(x) for x in args.dp.split(",")]
    os.environ.setdefault("MILES_JOB_ID", f"bench-{os.getpid()}")
    procs, endpoints = start_ranks(max(dps))
    try:
        samples = make_samples(args.samples, args.tokens, args.layers, args.top_k)
        rows, shard_fn = asyncio.run(miles_rows(samples, dps, args.rounds, endpoints))
        swept = asyncio.run(sweep([float(x) for x in args.sweep_mb.split(",") if x], args,
                                  endpoints[0]))
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
    del samples
    result = {"bench": "data_plane", "batch_MB": round(args.samples * sample_bytes(
        args.tokens, args.layers, args.top_k) / 1e6, 1), "samples": args.samples,
        "shape": {"tokens": args.tokens, "layers": args.layers, "top_k": args.top_k},
        "shard_fn": shard_fn, "rows": rows, "sweep": swept}
    result.update(bench_ray(args.ray_python, args, dps))
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    result["machine"] = machine()
    print(table(result), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
