"""Embedded engine control plane: pause modes, weight updates (disk, tensor, gloo), versions, aborts."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles.engines.client import EngineClient, EngineRequestError, encode_tensor_payload
from miles.engines.embedded import launch_embedded_engine
from miles.weights.checks import tensor_sha256
from miles.engines.embedded_engine.weights import init_custom_process_group
from miles.weights.checks import device_digest
from miles.engines.procs import free_port
from miles.tiny import build_tiny_model

ARGS = ["--torch-threads", "1", "--random-seed", "0", "--log-level", "warning",
        "--max-total-tokens", "8000", "--max-running-requests", "16"]
N_INFLIGHT, MAX_NEW = 6, 160


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    a, b = build_tiny_model(arch="qwen3"), build_tiny_model(arch="qwen3", seed=1)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    engine = asyncio.run(launch_embedded_engine(a, extra_args=ARGS, log_path=log))
    yield a, b, engine.url
    engine.stop(grace_s=2)


def state_dict(path):
    return load_file(str(path / "model.safetensors"))


def hf_logprobs(path, tokens):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].log_softmax(-1)


async def start_inflight(c: EngineClient):
    """N requests the engine is decoding: returns as soon as all are running (not after a fixed
    sleep: on an idle box the tiny model finishes all of them in ~0.1 s, under CI load in seconds)."""
    tasks = [asyncio.create_task(c.generate([30 + i, 31, 32, 33], {
        "max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}, return_logprob=True,
        rid=f"inflight-{i}")) for i in range(N_INFLIGHT)]
    deadline = time.monotonic() + 30
    while (load := (await c.get_load())[0])["num_reqs"] - load["num_waiting_reqs"] < N_INFLIGHT:
        assert not any(t.done() for t in tasks), "a request ended before all were running"
        assert time.monotonic() < deadline, "the requests were not all running within 30 s"
        await asyncio.sleep(0.002)
    assert not any(t.done() for t in tasks)
    return tasks


def assert_crossed(results, old: str, new: str):
    for r in results:
        assert r.finish_reason.type == "length" and len(r.output_ids) == MAX_NEW
        (v0, s0, e0), (v1, s1, e1) = [(s.version, s.start, s.end) for s in r.weight_versions]
        assert (v0, s0) == (old, 0) and (v1, e1) == (new, MAX_NEW) and 0 < e0 == s1 < MAX_NEW
        assert r.weight_version == new


async def reset(c: EngineClient, path, version: str):
    await c.update_weights_from_disk(str(path), weight_version=version)


async def test_pause_in_place_update_from_disk_continue(setup):
    a, b, url = setup
    async with EngineClient(url) as c:
        await reset(c, a, "0")
        tasks = await start_inflight(c)
        await c.pause_generation("in_place")
        before = (await c.get_load())[0]["num_reqs"]
        await asyncio.sleep(0.1)
        assert before == N_INFLIGHT and not any(t.done() for t in tasks)
        with pytest.raises(EngineRequestError, match="running or waiting"):
            await c.flush_cache()  # SGLang refuses too while requests hold KV
        res = await c.update_weights_from_disk(str(b), weight_version="1")
        assert res["success"] and res["num_paused_requests"] == N_INFLIGHT
        assert (await c.model_info())["weight_version"] == "1"
        await c.continue_generation()
        results = await asyncio.gather(*tasks)
    assert_crossed(results, "0", "1")
    assert [s.version for s in results[0].version_spans()] == [0, 1]


async def test_pause_retract_recomputes_with_new_weights(setup):
    a, b, url = setup
    async with EngineClient(url) as c:
        await reset(c, a, "4")
        tasks = await start_inflight(c)
        await c.pause_generation("retract")
        await c.update_weights_from_disk(str(b), weight_version="5")
        await c.continue_generation()
        results = await asyncio.gather(*tasks)
    assert_crossed(results, "4", "5")
    # Before the update every token came from A; after it the KV was recomputed with B, so each
    # later logprob is exactly B's forward over the same tokens.
    r = results[0]
    k = r.weight_versions[0].end
    tokens = [30, 31, 32, 33] + r.output_ids
    got = np.asarray(r.output_logprobs)
    for path, lo, hi in ((a, 0, k), (b, k, MAX_NEW)):
        lp = hf_logprobs(path, tokens)[3:-1].gather(1, torch.tensor(r.output_ids)[:, None])[:, 0].numpy()
        assert np.abs(lp[lo:hi] - got[lo:hi]).max() < 1e-4
    assert all(x.num_retractions >= 1 for x in results)


async def join_gloo_group(c, group_name: str):
    """The trainer's side of a 2-rank gloo weight-update group with the engine (rank 1)."""
    port = free_port()
    init = asyncio.create_task(c.init_weights_update_group("127.0.0.1", port, 1, 2,
                                                           group_name=group_name, backend="gloo"))
    pg = await asyncio.to_thread(init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}",
                                 2, 0, group_name)
    assert (await init)["success"]
    return pg


async def test_distributed_gloo_update_while_paused_in_place(setup):
    a, b, url = setup
    sd = state_dict(b)
    names = sorted(sd)
    async with EngineClient(url) as c:
        await reset(c, a, "6")
        pg = await join_gloo_group(c, "miles_test")
        try:
            tasks = await start_inflight(c)
            await c.pause_generation("in_place")
            update = asyncio.create_task(c.update_weights_from_distributed(
                names, [str(sd[n].dtype) for n in names], [list(sd[n].shape) for n in names],
                group_name="miles_test", weight_version="7"))

            def broadcast():  # the trainer's rank 0, in the listed order
                for n in names:
                    dist.broadcast(sd[n].contiguous(), src=0, group=pg)
            await asyncio.to_thread(broadcast)
            assert (await update)["success"]
            await c.continue_generation()
            results = await asyncio.gather(*tasks)
            sums = await c.weights_checksum()
        finally:
            await c.destroy_weights_update_group("miles_test")
            dist.destroy_process_group(pg)
    assert_crossed(results, "6", "7")
    assert sums == {n: tensor_sha256(t) for n, t in sd.items()}


async def test_flat_buckets_posted_out_of_order_are_received_in_bucket_seq_order(setup):
    """Calls in flight together (bucket 1 even arrives first): receives follow bucket_seq."""
    a, b, url = setup
    sd = state_dict(b)
    names = sorted(sd)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    flats = [torch.cat([sd[n].reshape(-1) for n in part]) for part in halves]
    async with EngineClient(url) as c:
        await reset(c, a, "6")
        pg = await join_gloo_group(c, "miles_seq")
        try:
            await c.pause_generation("in_place")

            def call(k):
                part = halves[k]
                return asyncio.create_task(c.update_weights_from_distributed(
                    part, [str(sd[n].dtype) for n in part], [list(sd[n].shape) for n in part],
                    group_name="miles_seq", load_format="flattened_bucket", bucket_seq=k))
            second = call(1)
            await asyncio.sleep(0.2)  # bucket 1's call waits for bucket 0's turn
            assert not second.done()
            first = call(0)

            def broadcast():  # the trainer's rank 0: bucket 0, then bucket 1
                for flat in flats:
                    dist.broadcast(flat, src=0, group=pg)
            await asyncio.to_thread(broadcast)
            assert (await first)["success"] and (await second)["success"]
            await c.update_weight_version("7")
            await c.continue_generation()
            sums = await c.weights_checksum()
        finally:
            await c.destroy_weights_update_group("miles_seq")
            dist.destroy_process_group(pg)
    assert sums == {n: tensor_sha256(t) for n, t in sd.items()}


async def test_update_from_tensor_and_bad_update_leaves_weights(setup):
    a, b, url = setup
    sd_a, sd_b = state_dict(a), state_dict(b)
    name = "model.layers.1.mlp.down_proj.weight"
    async with EngineClient(url) as c:
        await reset(c, a, "8")
        assert await c.weights_checksum([name]) == {name: tensor_sha256(sd_a[name])}
        res = await c.update_weights_from_tensor([encode_tensor_payload({name: sd_b[name]})],
                                                 weight_version="9")
        assert res["success"]
        assert await c.weights_checksum([name]) == {name: tensor_sha256(sd_b[name])}
        assert await c.weights_checksum([name], algorithm="device") == {name: device_digest(sd_b[name])}
        with pytest.raises(EngineRequestError, match="algorithm: 'md5' is not one of"):
            await c.weights_checksum([name], algorithm="md5")
        before = await c.weights_checksum()
        bad = {name: sd_a[name], "model.layers.9.mlp.down_proj.weight": sd_a[name].clone()}
        with pytest.raises(EngineRequestError, match="layers.9.*not a parameter"):
            await c.update_weights_from_tensor([encode_tensor_payload(bad)])
        with pytest.raises(EngineRequestError, match="shape"):
            await c.update_weights_from_tensor([encode_tensor_payload({name: sd_a[name].T})])
        with pytest.raises(EngineRequestError, match="never unpickles"):
            await c.update_weights_from_tensor(["gASVAAAAAAAAAACMAWGULg=="])
        with pytest.raises(EngineRequestError, match="not a directory"):
            await c.update_weights_from_disk("/nonexistent/ckpt")
        # colocated direct writes need CUDA IPC targets; a CPU engine refuses both halves by name
        with pytest.raises(EngineRequestError, match="CUDA IPC targets need an engine on CUDA"):
            await c.ipc_weight_targets()
        with pytest.raises(EngineRequestError, match="token 'stale' is not this engine's"):
            await c.update_weights_from_tensor(['{"token": "stale"}'], load_format="miles_cuda_ipc_direct",
                                               weight_version="10")
        with pytest.raises(EngineRequestError, match="not a miles_cuda_ipc_direct write"):
            await c.update_weights_from_tensor(['{"token": 1}'], load_format="miles_cuda_ipc_direct")
        assert await c.weights_checksum() == before
        assert (await c.model_info())["weight_version"] == "9"


async def test_pause_abort_returns_partial_outputs_and_queues_new_work(setup):
    a, _, url = setup
    async with EngineClient(url) as c:
        await reset(c, a, "10")
        tasks = await start_inflight(c)
        await c.pause_generation("abort")
        results = await asyncio.gather(*tasks)
        assert all(r.aborted and 0 < len(r.output_ids) < MAX_NEW for r in results)
        assert all(len(r.output_logprobs) == len(r.output_ids) for r in results)
        queued = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True}))
        await asyncio.sleep(0.2)
        assert not queued.done()  # paused: new requests wait, as in SGLang
        await c.continue_generation()
        assert len((await queued).output_ids) == 4


async def test_abort_one_request_by_rid_and_version_update(setup):
    a, _, url = setup
    async with EngineClient(url) as c:
        await reset(c, a, "11")
        victim = asyncio.create_task(c.generate([5, 6], {"max_new_tokens": 400, "ignore_eos": True},
                                                rid="victim"))
        other = asyncio.create_task(c.generate([5, 7], {"max_new_tokens": 60, "ignore_eos": True}))
        await asyncio.sleep(0.15)
        await c.abort_request("victim")
        v, o = await asyncio.gather(victim, other)
        assert v.aborted and v.rid == "victim" and len(v.output_ids) < 400
        assert o.finish_reason.type == "length" and len(o.output_ids) == 60
        await c.update_weight_version(12)
        assert (await c.generate([1], {"max_new_tokens": 1})).weight_version == "12"
        info = await c.server_info()
        assert info["dp_size"] == 1 and info["weight_version"] == "12"


_SILENT_SENDER = """
import os, sys, torch, torch.distributed as dist
from miles.engines.embedded_engine.weights import init_custom_process_group
pg = init_custom_process_group("gloo", sys.argv[1], 2, 0, sys.argv[2])
print("joined", flush=True)
sys.stdin.readline()  # silent until told
dist.broadcast(torch.ones(1024), src=0, group=pg)
print("sent", flush=True)
# leave without gloo's C++ teardown: its destructor can abort ("terminate called without an
# active exception") once the peer's group is gone, which says nothing about the engine side
os._exit(0)
"""


def test_destroying_a_group_with_a_receive_pending_from_a_silent_sender_returns_at_once():
    """/destroy_weights_update_group runs on the engine's event loop. A gloo group's destructor
    joins its worker threads, and one of them waits out a receive whose sender went silent (the
    trainer failed mid-publish): its last reference must die on the releasing thread, or the
    engine answers nothing, /server_info included, for up to the group's timeout (600 s)."""
    import subprocess
    import sys
    import threading
    import time

    from miles.engines.embedded_engine.weights import UpdateGroups, _PendingBucket

    port, name = free_port(), "silent-sender"
    sender = subprocess.Popen([sys.executable, "-c", _SILENT_SENDER, f"tcp://127.0.0.1:{port}", name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        groups = UpdateGroups(torch.device("cpu"))
        groups.init("127.0.0.1", port, 1, 2, name, "gloo")
        assert sender.stdout.readline().strip() == "joined"
        flat = torch.empty(1024)
        work = dist.broadcast(flat, src=0, group=groups.groups[name], async_op=True)
        groups.pending[name] = _PendingBucket(work, flat, [], [])
        del work

        t = time.monotonic()
        destroyer = threading.Thread(target=groups.destroy, args=(name,), daemon=True)
        destroyer.start()
        destroyer.join(10)
        took = time.monotonic() - t
        releasing = [th for th in threading.enumerate() if th.name == f"release-{name}"]
        # The sender speaks at last: the receive completes and the releasing thread can finish.
        sender.stdin.write("go\n")
        sender.stdin.flush()
        assert sender.stdout.readline().strip() == "sent"
        for th in releasing:
            th.join(30)
        assert not destroyer.is_alive() and took < 5, f"destroy blocked {took:.1f} s"
        assert name not in groups.groups and name not in groups.pending
        assert not any(th.is_alive() for th in releasing), "the releasing thread never finished"
        assert sender.wait(30) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
