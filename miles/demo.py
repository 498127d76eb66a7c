"""The built-in demo job (recipes/demo.toml): a driver calls a sink actor and streams Samples to it.

It shows the runtime on its own, before any model is involved: the driver (possibly on another
node) measures call round trips, streams a batch of array-carrying Samples and checks that the
sink's checksum equals its own. If the sink dies mid-stream, the driver waits for its restarted
incarnation and sends the batch again (`options.retries`).

Options: driver `{sink, samples, tokens, batch, retries}`; sink `{delay_s}` (per batch, to make
it a slow consumer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import numpy as np

from miles.runtime import Actor, ActorDied
from miles.wire.messages import Ping, Sample, SampleBatch, StreamSummary, VersionSpan


def sample_checksum(samples, h=None):
    h = h or hashlib.sha256()
    for s in samples:
        h.update(s.tokens.tobytes())
        if s.rollout_logprobs is not None:
            h.update(s.rollout_logprobs.tobytes())
    return h


def make_samples(n: int, tokens: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    resp = tokens // 2
    return [Sample(tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), response_length=resp,
                   loss_mask=np.ones(resp, np.uint8),
                   rollout_logprobs=-rng.random(resp, dtype=np.float32),
                   weight_versions=[VersionSpan(0, 0, resp)], reward=float(i % 2),
                   status="completed", group_id=f"g{i // 8}", rollout_id=f"r{i}", index=i % 8)
            for i in range(n)]


class Sink(Actor):
    """Receives streamed batches and answers with a checksum of everything it got."""

    async def on_stream(self, topic, items):
        delay_s = float(self.options.get("delay_s", 0.0))
        h, n, nbytes = hashlib.sha256(), 0, 0
        async for batch in items:
            sample_checksum(batch.samples, h)
            n += len(batch.samples)
            nbytes += sum(s.tokens.nbytes for s in batch.samples)
            if delay_s:
                await asyncio.sleep(delay_s)
        return StreamSummary(topic=topic, items=n, nbytes=nbytes, checksum=h.hexdigest())


class DemoDriver(Actor):
    async def run(self) -> int:
        opts = self.options
        sink = self.runtime.ref(opts.get("sink", "sink"))
        await self.runtime.lookup(sink.name, wait_s=60)
        latencies = []
        for _ in range(200):
            t = time.perf_counter()
            await sink.call(Ping(), timeout_s=10)
            latencies.append(time.perf_counter() - t)
        samples = make_samples(int(opts.get("samples", 256)), int(opts.get("tokens", 1024)))
        expected = sample_checksum(samples).hexdigest()
        nbytes = sum(x.tokens.nbytes + x.rollout_logprobs.nbytes + x.loss_mask.nbytes for x in samples)
        batch, attempts = int(opts.get("batch", 32)), 0
        while True:
            t = time.perf_counter()
            try:
                async with sink.stream("demo", timeout_s=60) as s:
                    for i in range(0, len(samples), batch):
                        await s.send(SampleBatch(samples=samples[i:i + batch]))
                break
            except ActorDied as e:
                attempts += 1
                print(json.dumps({"demo": "sink died", "error": str(e), "attempt": attempts}), flush=True)
                if attempts > int(opts.get("retries", 0)):
                    return 1
                await sink.wait_restarted(timeout_s=60)
        dt = time.perf_counter() - t
        ok = s.result.checksum == expected and s.result.items == len(samples)
        print(json.dumps({"demo": "ok" if ok else "CHECKSUM MISMATCH", "checksum": s.result.checksum,
                          "expected": expected, "call_p50_us": round(float(np.median(latencies)) * 1e6, 1),
                          "samples": s.result.items, "MB": round(nbytes / 1e6, 1),
                          "stream_MBps": round(nbytes / dt / 1e6, 1), "retries": attempts}), flush=True)
        return 0 if ok else 1
