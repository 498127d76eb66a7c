"""`weights.transport = "p2p"` into a real TP-2 embedded engine: from two real FSDP trainer ranks
(gloo), and from a recipe (`recipes/p2p_quickstart.toml`, the whole loop).

After a publish the engine's weights equal the trainer's (its /weights_checksum digests of the
full tensors against the trainer's own), each sender's bytes equal exactly its planned pieces
(counted on the sender), and the recipe learns without its held-out reward collapsing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import load_file

from miles.engines.embedded import launch_embedded_engine
from miles.tiny import build_tiny_model
from miles.weights.checks import CHECKSUMS
from miles.weights.config import WeightsConfig
from miles.weights.factory import make_transport
from miles.weights.p2p import EngineLayout, P2PTransport, TensorSpec, make_plan
from miles.weights.process_group import free_port
from tests.ports import cluster_port

REPO = Path(__file__).resolve().parents[2]


def test_the_recipe_key_makes_a_p2p_transport_on_every_rank():
    cfg = WeightsConfig(transport="p2p")
    for rank in range(2):
        t = make_transport(cfg, rank=rank, world_size=2)
        assert isinstance(t, P2PTransport) and t.traits.sender and t.world_size == 2
    with pytest.raises(ValueError, match="weights.transport='p2q'"):
        WeightsConfig(transport="p2q")


async def layout(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/p2p_layout") as r:
            return await r.json()


def expected_bytes(lay: dict, trainers: int) -> dict[tuple[int, int], int]:
    plan = make_plan([TensorSpec(n, shape) for n, shape in lay["specs"]], trainer_world=trainers,
                     engine=EngineLayout(tp=lay["tp_size"]))
    return plan.bytes_between(itemsize=4)


async def test_versions_and_a_reconnect_from_this_process_into_a_tp2_engine(tmp_path):
    """One trainer rank (this process, no default group): two versions through one group, then
    close and connect again (a fresh group; the engine leaves the old one first)."""
    import torch
    model_dir = build_tiny_model(arch="qwen3")
    engine = await launch_embedded_engine(model_dir, log_path=tmp_path / "engine.log",
                                          extra_args=["--tp-size", "2", "--torch-threads", "1"],
                                          ready_timeout_s=180)
    cfg = WeightsConfig(transport="p2p", connect_timeout_s=60.0, group_timeout_s=60.0,
                        bucket_timeout_s=60.0, bucket_bytes=1 << 16)
    transport = make_transport(cfg, rank=0, world_size=1)
    full = {}
    for f in model_dir.glob("*.safetensors"):
        full.update({k: v.float() for k, v in load_file(str(f)).items()})
    try:
        lay = await layout(engine.url)
        expected = expected_bytes(lay, trainers=1)
        for version in (1, 2, 3):
            if version == 3:  # a new group, as after the fleet changed
                await asyncio.to_thread(transport.close)
            if version in (1, 3):
                await asyncio.to_thread(transport.connect, [engine.url])
            sent = {n: t + 0.01 * version * torch.ones_like(t) for n, t in full.items()}
            items = list(sent.items())

            def publish():
                transport.begin(version)
                for i in range(0, len(items), 7):  # several buckets
                    transport.send_bucket(items[i:i + 7])
                transport.finish(version)

            await asyncio.to_thread(publish)
            assert transport.sent_bytes == {j: expected[(0, j)] for j in range(2)}
            assert transport.stats.buckets == -(-len(items) // 7)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{engine.url}/weights_checksum") as r:
                    sums = (await r.json())["checksums"]
            assert sums == {n: CHECKSUMS["sha256"](t) for n, t in sent.items()}, version
    finally:
        await asyncio.to_thread(transport.close)
        await engine.stop_async(2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_two_trainer_ranks_publish_into_a_tp2_engine(arch, tmp_path):
    model_dir = build_tiny_model(arch=arch)
    engine = await launch_embedded_engine(model_dir, log_path=tmp_path / "engine.log",
                                          extra_args=["--tp-size", "2", "--torch-threads", "1"],
                                          ready_timeout_s=180)
    try:
        lay = await layout(engine.url)
        assert lay["tp_size"] == 2
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        worker = Path(__file__).with_name("p2p_engine_worker.py")
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, str(worker), str(model_dir), engine.url, str(tmp_path),
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT) for r in range(2)]
        try:
            logs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 240)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
        for p, (log, _) in zip(procs, logs):
            assert p.returncode == 0, log.decode(errors="replace")[-4000:]
        trainer = load_file(str(tmp_path / "trainer.safetensors"))
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{engine.url}/weights_checksum") as r:
                engine_sums = (await r.json())["checksums"]
        original = {}
        for f in model_dir.glob("*.safetensors"):
            original.update(load_file(str(f)))
        assert set(engine_sums) == set(trainer)
        for name, t in trainer.items():  # exactly the trainer's weights, every full tensor
            assert engine_sums[name] == CHECKSUMS["sha256"](t), name
        assert sum(CHECKSUMS["sha256"](original[n].float()) != engine_sums[n] for n in trainer) > 0
        expected = expected_bytes(lay, trainers=2)
        for r in range(2):
            got = json.loads((tmp_path / f"rank{r}.json").read_text())
            sent = {int(k): v for k, v in got["sent_bytes"].items()}
            assert sent == {j: expected.get((r, j), 0) for j in range(2)}, r
        # each engine rank holds (and received) less than the model
        model_bytes = sum(t.numel() * 4 for t in trainer.values())
        for j in range(2):
            assert sum(expected.get((r, j), 0) for r in range(2)) < model_bytes
    finally:
        await engine.stop_async(2)


@pytest.mark.slow
def test_p2p_quickstart_recipe_publishes_exact_slices_and_keeps_learning(tmp_path):
    out = tmp_path / "run"
    sets = ["loop.num_steps=3", "loop.eval_every=3", "loop.save_every=0", "eval.n_prompts=32",
            "loop.groups_per_step=4", 'buffer.filter="none"', 'loop.mode="sync"',
            f"run.output_dir={json.dumps(str(out))}", "logging.progress=false",
            f"cluster.head_port={cluster_port()}"]
    args = [sys.executable, "-m", "miles.cli", "run", str(REPO / "recipes" / "p2p_quickstart.toml")]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("miles run p2p_quickstart still running after 420 s:\n"
                             + proc.communicate()[0].decode(errors="replace")[-3000:]) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.decode(errors="replace")
    # check_weights = true: a publish whose engine checksums differ from the trainer's fails the run
    assert proc.returncode == 0, text[-3000:]
    resolved = json.loads((out / "recipe.resolved.node0.json").read_text())
    assert resolved["weights"]["transport"] == "p2p" and resolved["weights"]["check_weights"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:  # stall time and its parts, for every publish
        parts = sum(r[f"weights/{k}"] for k in ("pause_s", "transfer_s", "load_s", "version_s",
                                                  "resume_s"))
        assert r["weights/stall_s"] > 0 and abs(parts - r["weights/stall_s"]) < 1e-5
    # every sender's counted bytes per engine rank, every version, equal its planned pieces
    from miles.engines.embedded_engine.params import Weights
    from miles.engines.embedded_engine.shapes import load_hf_config, shape_from_config
    import torch
    w = Weights(shape_from_config(load_hf_config(build_tiny_model(arch="qwen3"))),
                torch.device("meta"), torch.float32)
    expected = expected_bytes({"specs": [[n, list(t.shape)] for n, t in w.names.items()],
                               "tp_size": 2}, trainers=2)
    sent: dict[tuple[int, int], list] = {}
    for r in range(2):
        for m in re.finditer(r"p2p version (\d+): trainer rank (\d+) sent bytes to engine ranks "
                             r"(\[.*?\])$", (out / "logs" / f"trainer_{r}.log").read_text(), re.M):
            pairs = json.loads(m.group(3).replace("(", "[").replace(")", "]"))
            sent[(int(m.group(1)), int(m.group(2)))] = pairs
    versions = {v for v, _ in sent}
    assert len(versions) >= 3 and all((v, r) in sent for v in versions for r in range(2))
    for (v, r), pairs in sent.items():
        assert pairs == [[j, expected.get((r, j), 0)] for j in range(2)], (v, r)
    evals = [r for r in records if r.get("kind") == "eval"]
    first, last = evals[0], evals[-1]
    assert first["eval/reward"] > 0  # the warm-start taught the format
    assert last["eval/reward"] >= first["eval/reward"] - 0.1, (first, last)  # no collapse


async def test_two_engines_each_get_their_own_copy(tmp_path):
    """Two TP-1 engines: the same plan, engine e's rank at T + e; each receives every byte."""
    model_dir = build_tiny_model(arch="qwen3")
    engines = await asyncio.gather(*(launch_embedded_engine(
        model_dir, log_path=tmp_path / f"engine{e}.log", extra_args=["--torch-threads", "1"])
        for e in range(2)))
    transport = make_transport(WeightsConfig(transport="p2p", connect_timeout_s=60.0,
                                             group_timeout_s=60.0), rank=0, world_size=1)
    try:
        await asyncio.to_thread(transport.connect, [e.url for e in engines])
        full = {}
        for f in model_dir.glob("*.safetensors"):
            full.update({k: v.float() * 1.5 for k, v in load_file(str(f)).items()})

        def publish():
            transport.begin(4)
            transport.send_bucket(list(full.items()))
            transport.finish(4)

        await asyncio.to_thread(publish)
        model_bytes = sum(t.numel() * 4 for t in full.values())
        assert transport.sent_bytes == {0: model_bytes, 1: model_bytes}
        want = {n: CHECKSUMS["sha256"](t) for n, t in full.items()}
        async with aiohttp.ClientSession() as s:
            for e in engines:
                async with s.get(f"{e.url}/weights_checksum") as r:
                    assert (await r.json())["checksums"] == want, e.url
    finally:
        await asyncio.to_thread(transport.close)
        await asyncio.gather(*(e.stop_async(2) for e in engines))
