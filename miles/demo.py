"""The built-in demo job (recipes/demo.toml): two actors, one call round, one streamed batch.

It shows the runtime on its own, before any model is involved: the driver calls a sink actor
(possibly on another node), measures round trips, streams a batch of array-carrying Samples to it
and checks that the sink's checksum equals its own.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from miles.actors.base import Actor
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
        h, n, nbytes = hashlib.sha256(), 0, 0
        async for batch in items:
            sample_checksum(batch.samples, h)
            n += len(batch.samples)
            nbytes += sum(s.tokens.nbytes for s in batch.samples)
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
        samples = make_samples(self.recipe.run.demo_batch_samples, self.recipe.run.demo_tokens_per_sample)
        t = time.perf_counter()
        async with sink.stream("demo") as s:
            for i in range(0, len(samples), 32):
                await s.send(SampleBatch(samples=samples[i:i + 32]))
        dt = time.perf_counter() - t
        ok = s.result.checksum == sample_checksum(samples).hexdigest()
        nbytes = sum(x.tokens.nbytes + x.rollout_logprobs.nbytes + x.loss_mask.nbytes for x in samples)
        print(json.dumps({"demo": "ok" if ok else "CHECKSUM MISMATCH",
                          "call_p50_us": round(float(np.median(latencies)) * 1e6, 1),
                          "samples": s.result.items, "stream_MBps": round(nbytes / dt / 1e6, 1)}),
              flush=True)
        return 0 if ok else 1
