"""The embedded engine's prefix cache: same tokens with it on and off, hits across the turns of a
session, eviction and retraction under a small pool without leaking slots, nothing stale after a
weight update, routed experts of cached positions, and the SGLang-shaped reporting.

Log-probs with the cache agree with those without to 1e-5 (float32, CPU), not bitwise: a cached
position's K/V was computed by an earlier forward of another shape (the previous turn's prefill
and decode steps) and the new tokens' attention runs over keys read back from the pool with a
mask instead of causal SDPA over the fresh keys; reductions of other shapes round differently
(measured differences are ~1e-6).
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import numpy as np
import pytest
import torch

from miles.engines.client import EngineClient
from miles.engines.embedded import launch_embedded_engine
from miles.engines.embedded_engine.kv_cache import KVPool
from miles.engines.embedded_engine.prefix_cache import PrefixCache
from miles.engines.embedded_engine.protocol import SamplingParams
from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
from miles.engines.embedded_engine.request import Request
from miles.engines.embedded_engine.scheduler import Scheduler
from miles.tiny import build_tiny_model

LOGPROB_TOL = 1e-5
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=1.0)


def scheduler(arch: str = "qwen3", *, cache: bool = True, pool: int = 6000, share: float = 0.5,
              running: int = 16) -> Scheduler:
    runner = ModelRunner(str(build_tiny_model(arch=arch)), RunnerConfig(
        device="cpu", max_running_requests=running, max_total_tokens=pool, context_length=2048))
    return Scheduler(runner, max_running_requests=running, max_prefill_tokens=8192, weight_version="0",
                     prefill_interval=0, prefix_cache=cache, prefix_cache_max_share=share,
                     stats_interval_s=0)


async def generate(sch: Scheduler, rid: str, ids: list[int], n: int, params: dict, seed: int = 0,
                   **kw) -> Request:
    req = Request(rid=rid, input_ids=list(ids), params=SamplingParams(**params), seed=seed,
                  max_new_tokens=n, return_logprob=True, **kw)
    sch.submit(req)
    await asyncio.wait_for(req.done.wait(), 60)  # deadline: this request's generation
    assert req.finish["type"] == "length", req.finish
    return req


async def session(sch: Scheduler, name: str, turns: int, params: dict, *, rng_seed: int = 0,
                  new_tokens: int = 20, out_tokens: int = 12, **kw) -> list[Request]:
    """A multi-turn session: each turn's input is the previous input + output + new tokens."""
    rng = random.Random(rng_seed)
    ids: list[int] = []
    done = []
    for t in range(turns):
        ids = ids + [rng.randrange(3, 500) for _ in range(new_tokens)]
        req = await generate(sch, f"{name}-{t}", ids, out_tokens, params, seed=1000 * rng_seed + t, **kw)
        done.append(req)
        ids = ids + req.output_ids
    return done


def assert_same_outputs(with_cache: list[Request], without: list[Request]) -> None:
    for a, b in zip(with_cache, without, strict=True):
        assert a.output_ids == b.output_ids, a.rid
        diff = max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs))
        assert diff < LOGPROB_TOL, (a.rid, diff)


async def flushed_pool_is_whole(sch: Scheduler, free_at_start: int) -> None:
    async with sch.step_lock:
        sch.flush_prefix_cache()
    assert sch.runner.kv.free_slots == free_at_start
    assert sch.runner.kv.free_rows == sch.max_running


# ---- the radix tree alone ---------------------------------------------------------------------

def test_radix_tree_matches_splits_dedupes_evicts_and_resets_without_leaks():
    pool = KVPool(1, 101, 1, 2, 4, 64, device=torch.device("cpu"), dtype=torch.float32)
    cache = PrefixCache(pool, max_tokens=30)
    start = pool.free_slots
    a = pool.alloc(10)
    cache.insert(list(range(10)), a, owned=0)
    hit = cache.match(list(range(6)) + [99, 98], limit=8)
    assert hit.length == 6 and hit.slots.tolist() == a[:6].tolist()  # split at the mismatch
    cache.lock(hit.node)
    # A second request with the same 6-token prefix plus its own 4: the tree keeps one copy.
    b = np.concatenate([hit.slots, pool.alloc(4)])
    cache.insert(list(range(6)) + [50, 51, 52, 53], b, owned=6)
    assert cache.tokens == 14
    # A duplicate of what is cached is freed at insert, not kept twice.
    dup = pool.alloc(10)
    cache.insert(list(range(10)), dup, owned=0)
    assert cache.tokens == 14 and pool.free_slots == start - 14
    assert cache.match(list(range(10)), limit=5).length == 5  # the limit bounds the match
    # Eviction: LRU over unreferenced leaves; the locked prefix stays.
    assert cache.evict(100) == 8 and cache.tokens == 6
    assert cache.match(list(range(10)), limit=10).length == 6
    # A reset while the prefix is referenced frees it at the last unlock.
    cache.reset()
    assert cache.match(list(range(10)), limit=10).length == 0 and pool.free_slots == start - 6
    cache.unlock(hit.node)
    assert pool.free_slots == start
    with pytest.raises(ValueError, match="max_tokens: -1"):
        PrefixCache(pool, max_tokens=-1)


# ---- the scheduler in-process -----------------------------------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_session_gets_the_same_tokens_with_and_without_the_cache_and_hits(params):
    on, off = scheduler(cache=True), scheduler(cache=False)
    free = on.runner.kv.free_slots
    on.start(), off.start()
    try:
        with_cache = await session(on, "s", 6, params)
        without = await session(off, "s", 6, params)
        assert_same_outputs(with_cache, without)
        for prev, req in zip(with_cache, with_cache[1:]):
            assert req.cached_tokens >= len(prev.input_ids) + len(prev.output_ids) - 1, req.rid
        assert with_cache[0].cached_tokens == 0 and all(r.cached_tokens == 0 for r in without)
        prompt = sum(len(r.input_ids) for r in with_cache)
        assert on.stats["prompt_tokens"] == prompt and on.stats["cached_tokens"] > 0.7 * prompt
        assert off.stats["cached_tokens"] == 0
        await flushed_pool_is_whole(on, free)
    finally:
        await on.close(), await off.close()


async def test_prompt_logprobs_are_computed_not_served_from_the_cache():
    """A request asking for prompt log-probs from position p matches at most p-1 tokens, so every
    position it wants logits for is forwarded."""
    sch = scheduler()
    sch.start()
    try:
        first = await generate(sch, "a", list(range(3, 43)), 4, GREEDY)
        again = await generate(sch, "b", list(range(3, 43)), 4, GREEDY, logprob_start_len=10)
        assert again.cached_tokens == 9 and again.output_ids == first.output_ids
        assert len(again.input_logprobs) == 30
    finally:
        await sch.close()


async def test_many_sessions_through_a_small_budget_evict_and_leak_nothing():
    on = scheduler(pool=900, share=0.3, running=8)
    off = scheduler(cache=False, pool=6000, running=8)
    free = on.runner.kv.free_slots
    on.start(), off.start()
    try:
        async def all_sessions(sch):
            return await asyncio.gather(*(session(sch, f"s{i}", 4, GREEDY, rng_seed=i, new_tokens=15,
                                                  out_tokens=8) for i in range(10)))
        with_cache, without = await all_sessions(on), await all_sessions(off)
        for a, b in zip(with_cache, without):
            assert_same_outputs(a, b)
        assert on.cache.tokens <= on.cache.max_tokens == 270
        hits = sum(r.cached_tokens for s in with_cache for r in s)
        assert hits > 0  # sessions still hit, although 10 of them never fit at once
        assert on.runner.kv.free_slots + on.cache.tokens == free
        await flushed_pool_is_whole(on, free)
    finally:
        await on.close(), await off.close()


async def test_retraction_under_kv_pressure_with_shared_prefixes_stays_correct():
    """Eight requests share one cached 120-token prefix and decode until the pool runs dry: the
    cache gives up its unreferenced entries, then requests are retracted and recomputed (from the
    shared prefix, still referenced by the others); every output equals the one without cache."""
    shared = [random.Random(5).randrange(3, 500) for _ in range(120)]
    prompts = [shared + [7 + i, 9 + i] for i in range(8)]
    on, off = scheduler(pool=700, share=0.5), scheduler(cache=False, pool=6000)
    free = on.runner.kv.free_slots
    on.start(), off.start()
    try:
        await generate(on, "warm", shared + [1], 2, GREEDY)
        await generate(on, "other", [400] * 60, 2, GREEDY)  # an unreferenced entry to evict first
        with_cache = await asyncio.gather(*(generate(on, f"r{i}", p, 100, GREEDY)
                                            for i, p in enumerate(prompts)))
        without = await asyncio.gather(*(generate(off, f"r{i}", p, 100, GREEDY)
                                         for i, p in enumerate(prompts)))
        assert on.stats["retractions"] > 0 and off.stats["retractions"] == 0
        assert_same_outputs(with_cache, without)
        assert all(r.cached_tokens >= 120 for r in with_cache)
        await flushed_pool_is_whole(on, free)
    finally:
        await on.close(), await off.close()


async def test_routed_experts_of_cached_positions_equal_those_without_cache():
    on, off = scheduler("qwen3_moe", cache=True), scheduler("qwen3_moe", cache=False)
    on.start(), off.start()
    try:
        kw = dict(return_routed_experts=True)
        with_cache = await session(on, "m", 4, GREEDY, **kw)
        without = await session(off, "m", 4, GREEDY, **kw)
        assert_same_outputs(with_cache, without)
        assert all(r.cached_tokens > 0 for r in with_cache[1:])
        for a, b in zip(with_cache, without):
            end = len(a.input_ids) + len(a.output_ids) - 1
            assert a.routed[:end].any()
            np.testing.assert_array_equal(a.routed[:end], b.routed[:end], err_msg=a.rid)
        # A request without routing caches no routing: one that wants it matches nothing there.
        plain = await generate(on, "plain", [11] * 30, 3, GREEDY)
        wants = await generate(on, "wants", [11] * 30 + plain.output_ids + [12], 3, GREEDY, **kw)
        assert wants.cached_tokens == 0 and wants.routed[:30].any()
    finally:
        await on.close(), await off.close()


# ---- a real engine process --------------------------------------------------------------------

ARGS = ["--torch-threads", "1", "--random-seed", "0", "--log-level", "warning",
        "--max-total-tokens", "4000"]


@pytest.mark.slow
async def test_engine_reports_hits_and_serves_nothing_stale_after_weight_updates(tmp_path):
    path = build_tiny_model(arch="qwen3")
    on = await launch_embedded_engine(path, extra_args=ARGS, log_path=tmp_path / "on.log")
    off = await launch_embedded_engine(path, extra_args=ARGS + ["--disable-radix-cache"],
                                       log_path=tmp_path / "off.log")
    sp = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    try:
        async with EngineClient(on.url) as c, EngineClient(off.url) as d, aiohttp.ClientSession() as h:
            ids = list(range(5, 45))
            first = await c.generate(ids, sp)
            turn2 = ids + first.output_ids + [7, 8, 9]
            second = await c.generate(turn2, sp)
            plain = await d.generate(turn2, sp)
            assert second.cached_tokens == len(ids) + len(first.output_ids) - 1
            assert plain.cached_tokens == 0 and plain.output_ids == second.output_ids
            state = (await c.server_info())["internal_states"][0]
            assert state["prompt_tokens_total"] == len(ids) + len(turn2)
            assert state["cached_tokens_total"] == second.cached_tokens
            assert state["cache_hit_rate"] == pytest.approx(second.cached_tokens / (len(ids) + len(turn2)))
            assert state["prefix_cache_tokens"] == len(turn2) + len(second.output_ids) - 1
            async with h.get(on.url + "/metrics") as r:
                metrics = await r.text()
            assert f"sglang:cached_tokens_total{{model_name=\"{path}\"}} {second.cached_tokens}" in metrics
            assert "# TYPE sglang:cache_hit_rate gauge" in metrics
            # A weight update resets the cache: the next turn is computed afresh ...
            turn3 = turn2 + second.output_ids + [10]
            await c.update_weights_from_disk(str(path), weight_version="1")
            third = await c.generate(turn3, sp)
            assert third.cached_tokens == 0
            # ... and a request that crossed an update leaves nothing in the cache.
            long = asyncio.create_task(c.generate(turn3 + third.output_ids, {**sp, "max_new_tokens": 300}))
            for _ in range(500):  # deadline: the long request is decoding
                if (await c.get_load())[0]["num_reqs"]:
                    break
                await asyncio.sleep(0.01)
            await c.update_weights_from_disk(str(path), weight_version="2")
            crossed = await asyncio.wait_for(long, 60)
            assert {s.version for s in crossed.weight_versions} == {"1", "2"}
            after = await c.generate(turn3 + third.output_ids + crossed.output_ids + [3], sp)
            assert after.cached_tokens == 0
            state = (await c.server_info())["internal_states"][0]
            assert state["prefix_cache_tokens"] == len(after.output_ids) - 1 + after.prompt_tokens
            assert "Cache flushed" in await c.flush_cache()
            state = (await c.server_info())["internal_states"][0]
            assert state["prefix_cache_tokens"] == 0 and state["num_used_tokens"] == 0
    finally:
        on.stop(grace_s=2), off.stop(grace_s=2)


def test_cache_flags_parse_and_a_bad_share_is_refused(capsys):
    from miles.engines.embedded import build_parser
    ns = build_parser().parse_args(["--model-path", "m", "--disable-radix-cache",
                                    "--prefix-cache-max-share", "0.25"])
    assert ns.disable_radix_cache and ns.prefix_cache_max_share == 0.25
    assert not build_parser().parse_args(["--model-path", "m"]).disable_radix_cache
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", "--prefix-cache-max-share", "1.5"])
    assert "--prefix-cache-max-share: '1.5' is not a number in [0, 1]" in capsys.readouterr().err


async def test_samples_of_one_prompt_prefilled_together_keep_one_copy_of_it():
    """Four samples of a 120-token prompt in one prefill: after it, the pool holds the prompt once
    (the others' copies freed, their rows moved onto the cache's slots) plus each sample's decode
    slots; a fifth request with that prompt, arriving while they decode, hits; outputs equal the
    cache-less run's."""
    prompt = [random.Random(9).randrange(3, 500) for _ in range(120)]
    on, off = scheduler(), scheduler(cache=False)
    free = on.runner.kv.free_slots
    on.start(), off.start()
    try:
        async def group(sch):
            reqs = [Request(rid=f"g{i}", input_ids=list(prompt), params=SamplingParams(temperature=1.0),
                            seed=i, max_new_tokens=200, return_logprob=True) for i in range(4)]
            async with sch.step_lock:  # all four land in one prefill
                for r in reqs:
                    sch.submit(r)
            return reqs
        reqs = await group(on)
        for _ in range(3000):  # deadline: every sample decoding
            if all(len(r.output_ids) >= 3 for r in reqs):
                break
            await asyncio.sleep(0.002)
        async with on.step_lock:
            used = free - on.runner.kv.free_slots
            decode_slots = sum(len(r.output_ids) - 1 for r in reqs if not r.finished)
            assert not any(r.finished for r in reqs)
            assert used == len(prompt) + decode_slots
        late = await generate(on, "late", prompt + [4], 5, GREEDY)
        assert late.cached_tokens == len(prompt)
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in reqs)), 60)
        ref = await group(off)
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in ref)), 60)
        assert_same_outputs(reqs, ref)
        await flushed_pool_is_whole(on, free)
    finally:
        await on.close(), await off.close()
