"""Tensor parallelism in the embedded engine (--tp-size 2, gloo on CPU): real rank processes.

A TP-2 engine generates what a TP-1 engine generates (greedy tokens equal, log-probs allclose,
seeded sampling equal), keeps doing so over prefix-cache hits, pause/continue and a weight update
from disk; its checksums cover the full model and equal TP-1's; shapes that do not split are
refused naming the field; a dead worker takes the server down."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import aiohttp
import numpy as np
import pytest

from miles.engines.client import EngineClient
from miles.engines.embedded import build_parser, build_server, launch_embedded_engine
from miles.tiny import build_tiny_model

ARGS = ["--torch-threads", "1", "--random-seed", "0", "--log-level", "info",
        "--max-total-tokens", "4000", "--max-running-requests", "16"]
PROMPTS = [[11, 12, 13, 14, 15], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47]]


async def _pair(arch: str, tmp_path_factory):
    path = build_tiny_model(arch=arch)
    logs = tmp_path_factory.mktemp(f"tp-{arch}")
    one, two = await asyncio.gather(
        launch_embedded_engine(path, extra_args=ARGS, log_path=logs / "tp1.log"),
        launch_embedded_engine(path, extra_args=ARGS + ["--tp-size", "2"], log_path=logs / "tp2.log",
                               ready_timeout_s=180))
    return path, one, two, logs


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    path, one, two, logs = asyncio.run(_pair("qwen3", tmp_path_factory))
    yield path, one.url, two.url, logs
    one.stop(grace_s=2)
    two.stop(grace_s=2)


async def generate(url: str, sampling: dict, prompts=PROMPTS) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/generate", json={"input_ids": prompts, "sampling_params": sampling,
                                                   "return_logprob": True}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def tokens_and_logprobs(out: list[dict]):
    return ([o["output_ids"] for o in out],
            [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in out])


async def assert_same_generation(url1: str, url2: str, sampling: dict) -> None:
    a, b = await asyncio.gather(generate(url1, sampling), generate(url2, sampling))
    (ta, la), (tb, lb) = tokens_and_logprobs(a), tokens_and_logprobs(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)


async def checksums(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/weights_checksum") as r:
            assert r.status == 200, await r.text()
            return (await r.json())["checksums"]


GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 7}


async def test_tp2_generates_what_tp1_generates(qwen3_pair):
    _, url1, url2, _ = qwen3_pair
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url2}/server_info") as r:
            assert (await r.json())["tp_size"] == 2
    await assert_same_generation(url1, url2, GREEDY)
    await assert_same_generation(url1, url2, SAMPLED)
    # the same prompts again: prefix-cache hits on both, still the same
    await assert_same_generation(url1, url2, GREEDY)
    assert await checksums(url1) == await checksums(url2)  # full-model digests, every name


async def test_tp2_pause_continue_and_update_from_disk(qwen3_pair):
    path, url1, url2, _ = qwen3_pair
    other = build_tiny_model(arch="qwen3", seed=1)
    before = await checksums(url2)
    for url in (url1, url2):
        c = EngineClient(url)
        try:
            await c.pause_generation("in_place")
            await c.continue_generation()
            await c.update_weights_from_disk(str(other), weight_version="2")
        finally:
            await c.close()
    after1, after2 = await checksums(url1), await checksums(url2)
    assert after2 == after1 and after2 != before
    await assert_same_generation(url1, url2, GREEDY)
    async with aiohttp.ClientSession() as s:  # one expert-free TP-split weight, read back whole
        name = "model.layers.0.self_attn.q_proj.weight"
        heads = []
        for url in (url1, url2):
            async with s.get(f"{url}/get_weights_by_name", params={"name": name}) as r:
                heads.append(await r.json())
        assert heads[0] == heads[1]
        # the one-rank update paths say so at tp 2, naming the field
        async with s.post(f"{url2}/update_weights_from_tensor",
                          json={"serialized_named_tensors": ["x"]}) as r:
            assert r.status == 400 and "tp_size" in await r.text()
    for url in (url1, url2):  # back to the fixture's weights for the other tests
        c = EngineClient(url)
        try:
            await c.update_weights_from_disk(str(path))
        finally:
            await c.close()


@pytest.mark.slow
async def test_tp2_moe_with_expert_parallel_experts(tmp_path_factory):
    path, one, two, _ = await _pair("qwen3_moe", tmp_path_factory)
    try:
        await assert_same_generation(one.url, two.url, GREEDY)
        await assert_same_generation(one.url, two.url, SAMPLED)
        assert await checksums(one.url) == await checksums(two.url)
    finally:
        await one.stop_async(2)
        await two.stop_async(2)


@pytest.mark.parametrize("tp,field,value", [(3, "num_attention_heads", 4),
                                            (4, "num_key_value_heads", 2)])
def test_shapes_that_do_not_split_are_refused_by_field(tp, field, value):
    args = build_parser().parse_args(["--model-path", str(build_tiny_model(arch="qwen3")),
                                      "--tp-size", str(tp)])
    with pytest.raises(SystemExit, match=rf"--tp-size {tp}: config.{field}={value} does not split"):
        build_server(args)


async def test_a_dead_worker_takes_the_server_down(tmp_path):
    log = tmp_path / "engine.log"
    engine = await launch_embedded_engine(build_tiny_model(arch="qwen3"), log_path=log,
                                          extra_args=ARGS + ["--tp-size", "2"], ready_timeout_s=180)
    try:
        pid = int(re.search(r"TP worker embedded-tp1 started \(pid (\d+)\)", log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.process.proc.poll() is None:
            assert time.monotonic() < deadline, "the server was still up 20 s after its worker died"
            await asyncio.sleep(0.1)
        assert engine.process.proc.returncode != 0
        assert "TP worker embedded-tp1" in log.read_text() and "exited with code" in log.read_text()
    finally:
        await engine.stop_async(2)


async def test_a_p2p_plan_for_another_layout_is_refused_and_the_engine_serves_on(qwen3_pair):
    import base64

    import msgspec

    from miles.weights.p2p import EngineLayout, TensorSpec, make_plan
    _, url1, url2, _ = qwen3_pair
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url2}/p2p_layout") as r:
            lay = await r.json()
        assert lay["tp_size"] == 2 and lay["dtype"] == "float32"
        plan = make_plan([TensorSpec(n, shape) for n, shape in lay["specs"]], trainer_world=1,
                         engine=EngineLayout(tp=1))
        body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3,
                "group_name": "bad", "timeout_s": 5.0,
                "plan": base64.b64encode(msgspec.msgpack.encode(plan)).decode()}
        async with s.post(f"{url2}/init_p2p_group", json=body) as r:
            assert r.status == 400
            assert "engine tp=1 != this engine's --tp-size 2" in (await r.json())["message"]
        async with s.post(f"{url2}/update_weights_from_p2p", json={}) as r:
            assert r.status == 400 and "has not joined a P2P group" in await r.text()
    await assert_same_generation(url1, url2, GREEDY)  # both ranks still up and in step
