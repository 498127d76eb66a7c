"""A publish survives engines that die before or during it, and follows the fleet's engine set.

A real Trainer actor (FSDP, one gloo rank, in this process) publishes to real embedded engines over
the nccl transport's code path (a gloo group) and over disk, with check_weights on: an engine
killed mid-transfer or before the pause is dropped and the survivors get the whole version; a new
set in `PublishWeights.engine_urls` (a restarted engine) reconnects the transport; with no engine
left the publish fails and says so."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from miles.actors.trainer import Trainer
from miles.backends import TrainConfig
from miles.config import Recipe, RunConfig
from miles.engines.client import EngineClient
from miles.rl.config import ModelConfig
from miles.tiny import build_tiny_model
from miles.weights import WeightsConfig
from miles.wire.messages import Published, PublishWeights
from weights_helpers import REPO, free_port, start_engines, stop_engines


async def _versions(engines) -> list[str]:
    out = []
    for e in engines:
        async with EngineClient(e.url, timeout_s=10, max_retries=0) as c:
            out.append(str((await c.model_info()).get("weight_version")))
    return out


def _kill(engine) -> None:
    engine.process.kill()


@pytest.mark.parametrize("transport", ["nccl", "disk"])
async def test_publish_drops_dead_engines_and_follows_the_engine_set(tmp_path, transport):
    path = str(build_tiny_model(arch="qwen3"))
    recipe = Recipe(run=RunConfig(output_dir=str(tmp_path / "run")), model=ModelConfig(path=path),
                    train=TrainConfig(model_path=path, param_dtype="float32", lr=1e-3,
                                      max_tokens_per_microbatch=4096),
                    weights=WeightsConfig(transport=transport, check_weights=True,
                                          disk_dir=str(tmp_path / "weights"), bucket_bytes=1 << 20,
                                          direct_min_bytes=0, connect_timeout_s=75.0,  # > group_timeout_s: a survivor stuck in the abandoned collective answers after it
                                          control_timeout_s=5.0, pause_timeout_s=10.0,
                                          bucket_timeout_s=30.0, group_timeout_s=30.0))
    e0, e1, e2 = engines = await start_engines(path, 3, tmp_path)
    trainer = Trainer()
    trainer.recipe = recipe
    await trainer.on_start()
    try:
        first = await trainer.on_publish_weights(PublishWeights(version=1, engine_urls=[e0.url, e1.url]))
        assert await _versions([e0, e1]) == ["1", "1"]
        m = msgspec.msgpack.decode(msgspec.msgpack.encode(first), type=Published).metrics  # as on the wire
        parts = sum(m[f"weights/{k}_s"] for k in ("pause", "transfer", "load", "version", "resume"))
        assert 0 < m["weights/stall_s"] == pytest.approx(parts) and m["weights/load_s"] > 0, m

        # e1 dies after the first bucket of version 2 went out.
        buckets = trainer.backend.iter_hf_weight_buckets

        def dying_midway():
            for k, bucket in enumerate(buckets()):
                yield bucket
                if k == 0:
                    _kill(e1)
        trainer.backend.iter_hf_weight_buckets = dying_midway
        reply = await asyncio.wait_for(trainer.on_publish_weights(PublishWeights(version=2)), 120)
        trainer.backend.iter_hf_weight_buckets = buckets
        assert f"dropped dead engines {[e1.url]}" in reply.detail, reply.detail
        assert trainer.engine_urls == [e0.url]
        assert await _versions([e0]) == ["2"]

        # The fleet's new set (e2 stands for e1's restart): the transport reconnects to it.
        await trainer.on_publish_weights(PublishWeights(version=3, engine_urls=[e0.url, e2.url]))
        assert set(trainer.engine_urls) == {e0.url, e2.url}
        assert await _versions([e0, e2]) == ["3", "3"]

        # An engine that died before the publish (its pause fails): the survivor gets the version.
        _kill(e0)
        reply = await asyncio.wait_for(trainer.on_publish_weights(
            PublishWeights(version=4, engine_urls=[e0.url, e2.url])), 120)
        assert e0.url in reply.detail and trainer.engine_urls == [e2.url]
        assert await _versions([e2]) == ["4"]

        # No engine left: the publish fails, naming why.
        _kill(e2)
        with pytest.raises(RuntimeError, match="no engine of .* answers"):
            await asyncio.wait_for(trainer.on_publish_weights(PublishWeights(version=5)), 120)
    finally:
        await trainer.on_stop()
        await stop_engines(engines)


def _run_two_ranks(out_dir: Path, env: dict[str, str], timeout_s: float = 240) -> list[dict]:
    worker = Path(__file__).with_name("fleet_publish_worker.py")
    port, procs = free_port(), []
    for rank in range(2):
        penv = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                    PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    CUDA_VISIBLE_DEVICES="", **env)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(worker), "two", str(out_dir / f"rank{rank}.json")],
                                       env=penv, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout_s)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (out_dir / f"rank{rank}.log").read_text()[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow  # two FSDP ranks start in their own processes: ~50 s on a busy 2-core machine
async def test_two_trainer_ranks_agree_to_publish_again_to_the_survivors(tmp_path):
    path = str(build_tiny_model(arch="qwen3"))
    engines = await start_engines(path, 2, tmp_path)
    try:
        env = {"ENGINE_URLS": ",".join(e.url for e in engines), "MODEL_PATH": path,
               "ENGINE_PIDS": ",".join(str(e.process.pid) for e in engines)}
        zero, one = await asyncio.to_thread(_run_two_ranks, tmp_path, env)
    finally:
        await stop_engines(engines)
    assert zero["v1"] == one["v1"] == "version 1"
    assert zero["v2"] == f"version 2; dropped dead engines {[engines[1].url]}"
    assert one["v2"].startswith("version 2")
    assert zero["connected"] == one["connected"] == [engines[0].url]
    assert zero["v3"].startswith("failed:") and "answers any more" in zero["v3"], zero["v3"]
    assert one["v3"] == zero["v3"], "every rank fails with rank 0's reason"


async def test_only_an_engine_whose_port_refuses_counts_as_dead():
    from aiohttp import web

    from miles.weights.publisher import reachable_engines

    async def answer(request):
        return web.json_response({"weight_version": "1"})

    async def hang(request):
        await asyncio.sleep(5)
        return web.json_response({})

    runners, urls = [], []
    for handler in (answer, hang):
        app = web.Application()
        app.router.add_get("/model_info", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    closed = f"http://127.0.0.1:{free_port()}"
    try:
        assert await reachable_engines([urls[0], closed, urls[1]], timeout_s=0.5) == urls
    finally:
        for r in runners:
            await r.cleanup()
