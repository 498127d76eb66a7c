"""Embedded engine scheduling: continuous batching, joins mid-flight, stops, seeds, batch forms."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from miles.engines.client import EngineClient
from miles.engines.embedded import launch_embedded_engine
from miles.tiny import build_tiny_model

ARGS = ["--torch-threads", "1", "--random-seed", "0", "--log-level", "warning",
        "--max-running-requests", "48"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = build_tiny_model(arch="qwen3")
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    engine = asyncio.run(launch_embedded_engine(path, extra_args=ARGS + ["--max-total-tokens", "6000"],
                                                log_path=log))
    yield engine.url
    engine.stop(grace_s=2)


async def test_32_concurrent_requests_of_varied_lengths(url):
    rng = random.Random(0)
    jobs = [([rng.randrange(20, 500) for _ in range(rng.randint(2, 60))], rng.randint(1, 48))
            for _ in range(32)]
    async with EngineClient(url) as c:
        results = await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "ignore_eos": True,
                                                        "sampling_seed": i}, return_logprob=True)
                                         for i, (p, n) in enumerate(jobs)))
        load = await c.get_load()
    for (prompt, n), res in zip(jobs, results):
        assert res.finish_reason.type == "length" and res.finish_reason.length == n
        assert len(res.output_ids) == n == len(res.output_logprobs) == res.completion_tokens
        assert res.prompt_tokens == len(prompt)
    assert load[0]["num_reqs"] == 0  # everything finished and freed


async def test_joining_mid_flight_gives_the_same_tokens(url):
    prompt = [11, 22, 33, 44, 55]
    greedy = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    async with EngineClient(url) as c:
        alone_greedy = await c.generate(prompt, greedy, return_logprob=True)
        alone_seeded = await c.generate(prompt, seeded)
        background = [asyncio.create_task(c.generate([7 + i] * (3 + 5 * i), {
            "max_new_tokens": 600, "ignore_eos": True})) for i in range(8)]
        for _ in range(200):  # wait until the batch is decoding (not a fixed sleep: load varies)
            if (await c.get_load())[0]["num_reqs"] == 8:
                break
            await asyncio.sleep(0.01)
        assert not any(t.done() for t in background)
        joined_greedy, joined_seeded = await asyncio.gather(c.generate(prompt, greedy, return_logprob=True),
                                                            c.generate(prompt, seeded))
        done = await asyncio.gather(*background)
    assert joined_greedy.output_ids == alone_greedy.output_ids
    assert max(abs(a - b) for a, b in zip(joined_greedy.output_logprobs, alone_greedy.output_logprobs)) < 1e-4
    assert joined_seeded.output_ids == alone_seeded.output_ids
    assert all(len(r.output_ids) == 600 for r in done)


async def test_stop_tokens_min_new_tokens_and_eos(url):
    prompt = [101, 102, 103]
    async with EngineClient(url) as c:
        free = await c.generate(prompt, {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True})
        stop_id = free.output_ids[5]
        first = free.output_ids.index(stop_id)
        stopped = await c.generate(prompt, {"max_new_tokens": 30, "temperature": 0.0,
                                            "stop_token_ids": [stop_id], "ignore_eos": True})
        held = await c.generate(prompt, {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True,
                                         "stop_token_ids": [stop_id], "min_new_tokens": first + 3})
    assert stopped.output_ids == free.output_ids[:first + 1]
    assert stopped.finish_reason.type == "stop" and stopped.finish_reason.matched == stop_id
    assert len(held.output_ids) >= first + 3 and stop_id not in held.output_ids[:first + 3]


async def test_seed_determinism_and_variety(url):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url) as c:
        a, b, d = await asyncio.gather(c.generate([1, 2], {**sp, "sampling_seed": 5}),
                                       c.generate([1, 2], {**sp, "sampling_seed": 5}),
                                       c.generate([1, 2], {**sp, "sampling_seed": 6}))
    assert a.output_ids == b.output_ids != d.output_ids


async def test_batch_forms_n_and_text(url):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", json={
                "input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"],
                "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}}) as r:
            out = await r.json()
        async with s.post(url + "/generate", json={
                "text": "What is 2 + 2?", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_prompt_token_ids": True}) as r:
            single = await r.json()
    assert r.status == 200 and [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "b_0", "b_1"]
    assert all(len(o["output_ids"]) == 3 for o in out)
    assert isinstance(single["text"], str) and len(single["prompt_token_ids"]) > 3


async def test_stream_is_cumulative_and_ends_with_finish(url):
    async with EngineClient(url) as c:
        chunks = [ch async for ch in c.generate_stream([9, 8, 7], {"max_new_tokens": 5,
                                                                    "temperature": 0.0,
                                                                    "ignore_eos": True},
                                                       return_logprob=True)]
        whole = await c.generate([9, 8, 7], {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True})
    assert [len(ch.output_ids) for ch in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1].output_ids == whole.output_ids and chunks[-1].finish_reason.type == "length"


async def test_pool_pressure_retracts_and_still_finishes(tmp_path):
    """A KV pool too small for every request at once: the newest are retracted, none is lost."""
    path = build_tiny_model(arch="qwen3")
    engine = await launch_embedded_engine(path, extra_args=ARGS + ["--max-total-tokens", "400"],
                                          log_path=tmp_path / "engine.log")
    try:
        async with EngineClient(engine.url) as c:
            sp = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
            alone = await c.generate([3, 4, 5], sp)
            results = await asyncio.gather(*(c.generate([3, 4, 5], sp) for _ in range(10)))
    finally:
        await engine.stop_async(grace_s=2)
    assert all(r.output_ids == alone.output_ids for r in results)
    assert sum(r.num_retractions for r in results) > 0


def test_bench_smoke_on_cpu():
    """bench/engine.py runs on CPU and prints one JSON line per batch size. Decode cost is the
    difference of two runs, so they differ by 28 steps (~30 ms): with 4 (the earlier setting)
    timing noise once made the difference negative in a fresh-clone run."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "bench" / "engine.py"), "--device", "cpu", "--batches", "1,2",
                          "--n-short", "2", "--n-long", "30", "--skip-hf"], capture_output=True,
                         text=True, timeout=120, check=True, cwd=root).stdout
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["batch"] for x in lines] == [1, 2] and all(x["tok_per_s"] > 0 for x in lines)
    assert {"bench", "model", "ms_per_step", "hf_generate_tok_per_s", "hbm_bound_tok_per_s",
            "machine"} <= set(lines[0])


def test_kv_buckets_up_to_match_the_buckets_decode_uses():
    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    path = build_tiny_model(arch="qwen3")
    r = ModelRunner(str(path), RunnerConfig(device="cpu", max_running_requests=4,
                                            max_total_tokens=2000, context_length=300))
    assert r.graphs is None  # CPU: eager decode, nothing captured
    assert r.kv_buckets_up_to(1024) == [64, 128, 256, 300]  # the last one is the context length
    assert r.kv_buckets_up_to(100) == [64, 128]
    assert {r.kv_bucket_of(p) for p in range(300)} == set(r.kv_buckets_up_to(300))


def test_batched_prefill_of_uneven_lengths_equals_each_alone_and_bad_attention_is_refused():
    """One padded prefill over sequences of lengths 5, 33, 1 and 17 (causal SDPA over a
    right-padded view, indices built on the host) gives each sequence the logits and K/V it
    gets alone, for plain sampling and for prompt log-probs from an inner position."""
    import torch

    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    path = build_tiny_model(arch="qwen3")
    r = ModelRunner(str(path), RunnerConfig(device="cpu", max_running_requests=16,
                                            max_total_tokens=4000, context_length=128))
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(1, r.shape.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 1, 17)]
    starts = [4, 10, 0, 0]  # len-1 (sampling only), then from an inner position, then from 0

    def run(batch):
        rows = [r.kv.alloc_row() for _ in batch]
        slots = [r.kv.alloc(len(seqs[i])) for i in batch]
        logits, _ = r.prefill([seqs[i] for i in batch], rows, slots, [starts[i] for i in batch], False)
        keys = [r.kv.k[1][torch.from_numpy(s)].clone() for s in slots]
        return logits, keys

    together, keys = run([0, 1, 2, 3])
    for i in range(4):
        (alone,), (key,) = run([i])
        assert together[i].shape == (len(seqs[i]) - starts[i], r.shape.vocab_size)
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(keys[i], key, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefill_attention: 'varlen' needs"):
        ModelRunner(str(path), RunnerConfig(device="cpu", max_total_tokens=500, prefill_attention="varlen"))
    with pytest.raises(ValueError, match="prefill_attention: 'flash' is not"):
        ModelRunner(str(path), RunnerConfig(device="cpu", max_total_tokens=500, prefill_attention="flash"))


def test_auto_prefill_attention_packs_only_batches_that_padding_would_mostly_waste():
    """With a packed (varlen) kernel present, `auto` pads batches of similar lengths (one SDPA
    call per layer, the cheaper path on a GPU) and packs those where padding would more than
    double the work; `varlen_always` packs every batch. Both paths give the same logits (here the
    packed kernel is a per-sequence causal SDPA, standing in for FlashAttention on CPU)."""
    import torch
    import torch.nn.functional as F

    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    path = build_tiny_model(arch="qwen3")
    r = ModelRunner(str(path), RunnerConfig(device="cpu", max_running_requests=16,
                                            max_total_tokens=4000, context_length=128))
    calls = []

    def packed(q, k, v, cu_seqlens, max_len, scale):
        calls.append(len(cu_seqlens) - 1)
        cu = cu_seqlens.tolist()
        out = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                              v[a:b].transpose(0, 1), is_causal=True, scale=scale,
                                              enable_gqa=True).transpose(0, 1)
               for a, b in zip(cu, cu[1:])]
        return torch.cat(out)

    g = torch.Generator().manual_seed(3)

    def run(lengths):
        seqs = [torch.randint(1, r.shape.vocab_size, (n,), generator=g).tolist() for n in lengths]
        rows = [r.kv.alloc_row() for _ in seqs]
        slots = [r.kv.alloc(len(q)) for q in seqs]
        logits, _ = r.prefill(seqs, rows, slots, [0] * len(seqs), False)
        for row, sl in zip(rows, slots):
            r.kv.free_row(row)
            r.kv.free(sl)
        return seqs, logits

    def padded_only(seqs):
        r.model.varlen = None
        rows = [r.kv.alloc_row() for _ in seqs]
        slots = [r.kv.alloc(len(q)) for q in seqs]
        logits, _ = r.prefill(seqs, rows, slots, [0] * len(seqs), False)
        r.model.varlen = packed
        return logits

    r.model.varlen = packed
    seqs, _ = run([20, 18, 22, 21])        # 4 x 22 padded for 81 real tokens: pad
    assert calls == []
    seqs, logits = run([3, 40, 2])          # 3 x 40 for 45: pack
    assert calls == [3] * r.shape.num_layers
    for got, want in zip(logits, padded_only(seqs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    calls.clear()
    r.model.varlen_always = True
    run([20, 18, 22, 21])
    assert calls == [4] * r.shape.num_layers


@pytest.mark.parametrize("mode, short_prefill_on_loop, decode_on_loop",
                         [("auto", True, True), ("all", True, True), ("prefill", True, False),
                          ("none", False, False)])
async def test_inline_steps_pick_which_steps_run_on_the_event_loop(mode, short_prefill_on_loop,
                                                                   decode_on_loop):
    """`inline_steps` (auto is all on CPU) puts a step's forward on the event loop's thread or the
    compute thread; a prefill longer than INLINE_MAX_TOKENS always goes to the thread (a blocked
    loop fails health checks). A bad mode, or a negative prefill interval, is refused, naming the
    field."""
    import threading

    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    from miles.engines.embedded_engine.request import Request
    from miles.engines.embedded_engine.scheduler import INLINE_MAX_TOKENS, Scheduler
    path = build_tiny_model(arch="qwen3")
    runner = ModelRunner(str(path), RunnerConfig(device="cpu", max_running_requests=4,
                                                 max_total_tokens=6000, context_length=4096))
    with pytest.raises(ValueError, match="inline_steps: 'gpu' is not one of"):
        Scheduler(runner, max_running_requests=4, max_prefill_tokens=8192, weight_version="0",
                  inline_steps="gpu")
    with pytest.raises(ValueError, match="prefill_interval: -1 must be >= 0"):
        Scheduler(runner, max_running_requests=4, max_prefill_tokens=8192, weight_version="0",
                  prefill_interval=-1)
    sch = Scheduler(runner, max_running_requests=4, max_prefill_tokens=8192, weight_version="0",
                    inline_steps=mode)
    seen = []
    for name in ("prefill", "decode"):
        original = getattr(runner, name)

        def spy(*args, _name=name, _original=original, **kw):
            seen.append((_name, threading.current_thread() is threading.main_thread()))
            return _original(*args, **kw)
        setattr(runner, name, spy)
    sch.start()
    try:
        for n in (10, INLINE_MAX_TOKENS + 1):
            # distinct tokens: a prefix cache hit would shorten the long prefill below the limit
            req = Request(rid=f"n{n}", input_ids=[5 + n % 7] * n, params=SamplingParams(temperature=0.0),
                          seed=0, max_new_tokens=3)
            sch.submit(req)
            await asyncio.wait_for(req.done.wait(), 60)
            assert len(req.output_ids) == 3
    finally:
        await sch.close()
    prefills = [on_loop for name, on_loop in seen if name == "prefill"]
    decodes = {on_loop for name, on_loop in seen if name == "decode"}
    assert prefills == [short_prefill_on_loop, False] and decodes == {decode_on_loop}, seen


async def test_arrivals_wait_for_the_prefill_interval_then_share_one_prefill():
    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    from miles.engines.embedded_engine.request import Request
    from miles.engines.embedded_engine.scheduler import Scheduler
    path = build_tiny_model(arch="qwen3")
    runner = ModelRunner(str(path), RunnerConfig(device="cpu", max_running_requests=8,
                                                 max_total_tokens=2000, context_length=512))
    sch = Scheduler(runner, max_running_requests=8, max_prefill_tokens=4096, weight_version="0",
                    prefill_interval=3)

    def req(rid: str, n: int) -> Request:
        return Request(rid=rid, input_ids=[5, 6, 7], params=SamplingParams(temperature=0.0),
                       seed=0, max_new_tokens=n)

    long = req("long", 60)
    sch.submit(long)
    sch.start()
    try:
        while len(long.output_ids) < 5:
            await asyncio.sleep(0.001)
        async with sch.step_lock:  # between two steps: both arrivals land before the next one
            sch._decodes_since_prefill = 0
            at = len(long.output_ids)
            late = [req("b", 2), req("c", 2)]
            for r in late:
                sch.submit(r)
            prefills = sch.stats["prefills"]

        async def first_token() -> int:
            while not late[0].output_ids:
                await asyncio.sleep(0)
            return len(long.output_ids)

        when = await asyncio.wait_for(first_token(), 30)
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in late)), 30)
        # Both went in one prefill, after the running request decoded 3 more steps (not at once).
        assert sch.stats["prefills"] == prefills + 1
        assert [len(r.output_ids) for r in late] == [2, 2]
        assert at + 3 <= when <= at + 4, (at, when)
    finally:
        await sch.close()
