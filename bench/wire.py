"""Actor calls and bulk transfer between two processes, against bare ZeroMQ and Ray.

Prints one JSON line:
  {"bench": "wire", "call_p50_us", "call_p99_us", "calls_per_s", "bulk_GBps",
   "zmq_call_p50_us", "zmq_bulk_GBps", "ray_call_p50_us", "ray_bulk_GBps", "machine", ...}

- Miles: an `Actor` in a child process; the client calls it with `ActorRef.call` (small `Ping`),
  and sends one 64 MB rollout batch (1,024 Samples of 8k int32 tokens + 8k float32 logprobs).
- Bare ZeroMQ (the floor): a REP socket in a child process, the same frames with a blocking REQ.
- Ray: an actor with the same two methods, run with the Python of `--ray-python` (a separate venv:
  `bench/run_wire.sh` makes one; Ray is never a dependency of Miles). Skipped if not available.

Usage: .venv/bin/python bench/wire.py [--ray-python .venv-bench/bin/python] [--calls 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import subprocess
import time
from pathlib import Path

import numpy as np
from miles.hostinfo import machine

N_SAMPLES, TOKENS = 1024, 8192


def make_batch():
    from miles.wire.messages import Sample, SampleBatch
    rng = np.random.default_rng(0)
    return SampleBatch(samples=[
        Sample(tokens=rng.integers(0, 150_000, TOKENS, dtype=np.int32), response_length=TOKENS,
               rollout_logprobs=-rng.random(TOKENS, dtype=np.float32), status="completed",
               group_id=f"g{i // 8}", index=i % 8) for i in range(N_SAMPLES)])


def batch_bytes(batch) -> int:
    return sum(s.tokens.nbytes + s.rollout_logprobs.nbytes for s in batch.samples)


def percentiles(xs):
    xs = np.asarray(xs) * 1e6
    return float(np.percentile(xs, 50)), float(np.percentile(xs, 99))


# ----- Miles actors ---------------------------------------------------------------------------

def _serve_actor(q):
    from miles.runtime import Actor, Runtime, run_event_loop
    from miles.wire.messages import Ok, SampleBatch

    class Echo(Actor):
        async def on_batch(self, msg: SampleBatch) -> Ok:
            return Ok(detail=str(len(msg.samples)))

    async def main():
        actor = Echo("echo")
        q.put(await actor.start(Runtime(), register=False))
        await actor.serve_forever()

    run_event_loop(main())


def _serve_zmq(q):
    import zmq
    sock = zmq.Context().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    q.put(f"tcp://127.0.0.1:{port}")
    while True:
        sock.recv_multipart(copy=False)
        sock.send(b"ok")


def _spawn(target):
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(q,), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


def bench_miles_and_zmq(n_calls: int, batch, rounds: int = 10) -> dict:
    """Both measured in alternating rounds, so load from anything else on the machine falls on
    both alike and the ratio stays fair."""
    import zmq
    from miles.runtime import Runtime, run_event_loop
    from miles.wire.codec import encode
    from miles.wire.messages import Ping

    actor_proc, actor_ep = _spawn(_serve_actor)
    zmq_proc, zmq_ep = _spawn(_serve_zmq)
    req = zmq.Context.instance().socket(zmq.REQ)
    req.connect(zmq_ep)
    small = [bytes(f) for f in encode("call", Ping(), 1)]  # the very bytes an actor call sends
    big = encode("call", batch, 1)

    def zmq_calls(n):
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            req.send_multipart(small)
            req.recv()
            lat.append(time.perf_counter() - t)
        return lat

    def zmq_bulk():
        t = time.perf_counter()
        req.send_multipart(big, copy=False)
        req.recv()
        return time.perf_counter() - t

    async def client():
        rt = Runtime()
        ref = rt.ref_at(actor_ep, "echo")

        async def miles_calls(n):
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await ref.call(Ping())
                lat.append(time.perf_counter() - t)
            return lat

        async def miles_bulk():
            t = time.perf_counter()
            await ref.call(batch, timeout_s=120)
            return time.perf_counter() - t

        await miles_calls(300), zmq_calls(300), await miles_bulk(), zmq_bulk()  # warm-up
        m_lat, z_lat, m_bulk, z_bulk = [], [], [], []
        per_round = max(1, n_calls // rounds)
        for _ in range(rounds):
            m_lat += await miles_calls(per_round)
            z_lat += zmq_calls(per_round)
        for _ in range(5):
            m_bulk.append(await miles_bulk())
            z_bulk.append(zmq_bulk())
        t = time.perf_counter()
        await asyncio.gather(*(ref.call(Ping()) for _ in range(n_calls)))
        conc = n_calls / (time.perf_counter() - t)
        rt.close()
        return m_lat, z_lat, m_bulk, z_bulk, conc

    m_lat, z_lat, m_bulk, z_bulk, conc = run_event_loop(client())
    actor_proc.terminate()
    zmq_proc.terminate()
    nbytes = batch_bytes(batch)
    p50, p99 = percentiles(m_lat)
    return {"call_p50_us": round(p50, 1), "call_p99_us": round(p99, 1),
            "calls_per_s": round(conc), "calls_per_s_sequential": round(1 / np.mean(m_lat)),
            "bulk_GBps": round(nbytes / float(np.median(m_bulk)) / 1e9, 3),
            "zmq_call_p50_us": round(percentiles(z_lat)[0], 1),
            "zmq_bulk_GBps": round(nbytes / float(np.median(z_bulk)) / 1e9, 3)}


# ----- Ray ------------------------------------------------------------------------------------

RAY_SCRIPT = r'''
import json, sys, time
import numpy as np
import ray
N, T, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
@ray.remote
class Echo:
    def ping(self, payload=b""):
        return payload
    def batch(self, samples):
        return len(samples)
a = Echo.remote()
for _ in range(200):
    ray.get(a.ping.remote())
lat = []
for _ in range(calls):
    t = time.perf_counter(); ray.get(a.ping.remote()); lat.append(time.perf_counter() - t)
rng = np.random.default_rng(0)
samples = [{"tokens": rng.integers(0, 150000, T, dtype=np.int32), "response_length": T,
            "rollout_logprobs": -rng.random(T, dtype=np.float32), "status": "completed",
            "group_id": f"g{i // 8}", "index": i % 8} for i in range(N)]
nbytes = sum(s["tokens"].nbytes + s["rollout_logprobs"].nbytes for s in samples)
ray.get(a.batch.remote(samples))
bulk = []
for _ in range(5):
    t = time.perf_counter(); ray.get(a.batch.remote(samples)); bulk.append(time.perf_counter() - t)
print(json.dumps({"ray_call_p50_us": round(float(np.median(lat)) * 1e6, 1),
                  "ray_bulk_GBps": round(nbytes / min(bulk) / 1e9, 3), "ray_version": ray.__version__}))
'''


def bench_ray(python: str | None, n_calls: int) -> dict:
    if not python or not Path(python).exists():
        return {"ray_call_p50_us": None, "ray_bulk_GBps": None, "ray_skipped": "no --ray-python"}
    out = subprocess.run([python, "-c", RAY_SCRIPT, str(N_SAMPLES), str(TOKENS), str(min(n_calls, 2000))],
                         capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"ray_call_p50_us": None, "ray_bulk_GBps": None,
                "ray_skipped": (out.stderr or out.stdout)[-300:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--ray-python", default=None)
    args = ap.parse_args()
    batch = make_batch()
    result = {"bench": "wire"}
    result.update(bench_miles_and_zmq(args.calls, batch))
    result.update(bench_ray(args.ray_python, args.calls))
    result["bulk_MB"] = round(batch_bytes(batch) / 1e6, 1)
    result["call_vs_zmq"] = round(result["call_p50_us"] / result["zmq_call_p50_us"], 2)
    result["bulk_vs_zmq"] = round(result["bulk_GBps"] / result["zmq_bulk_GBps"], 2)
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
