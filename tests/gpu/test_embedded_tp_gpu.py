"""The embedded engine at --tp-size 2 on two GPUs (NCCL), and P2P weights into it.

Skipped without two CUDA devices (the P2P test: three; NCCL refuses two ranks of one group on
one GPU, so the trainer takes GPU 0 and the engine's ranks GPUs 1 and 2). Run on a 4-GPU machine:
    python -m pytest tests/gpu/test_embedded_tp_gpu.py -q

The same code as the CPU tests (tests/engines/test_embedded_tp.py, tests/weights/test_p2p_engine.py)
with NCCL for the forward's collectives and for the P2P group: TP-2 greedy tokens equal TP-1's
(fp32), and a publish from this process's GPU lands every full tensor (checksums equal).
"""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

from miles.engines.embedded import launch_embedded_engine  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

ARGS = ["--device", "cuda", "--dtype", "float32", "--max-total-tokens", "8000",
        "--max-running-requests", "16", "--random-seed", "0"]


async def _generate(url, prompts):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/generate", json={
                "input_ids": prompts, "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
    return ([o["output_ids"] for o in out],
            [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in out])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_tp2_on_two_gpus_matches_tp1(arch, tmp_path):
    path = build_tiny_model(arch=arch)
    one = await launch_embedded_engine(path, extra_args=ARGS, log_path=tmp_path / "tp1.log")
    two = await launch_embedded_engine(path, extra_args=ARGS + ["--tp-size", "2"],
                                       log_path=tmp_path / "tp2.log", ready_timeout_s=300)
    try:
        prompts = [[11, 12, 13, 14], [7, 8, 9, 10, 11, 12], [40, 41]]
        (t1, l1), (t2, l2) = await _generate(one.url, prompts), await _generate(two.url, prompts)
        assert t1 == t2
        for a, b in zip(l1, l2):
            np.testing.assert_allclose(a, b, atol=1e-3, rtol=0)
        async with aiohttp.ClientSession() as s:
            sums = []
            for url in (one.url, two.url):
                async with s.get(f"{url}/weights_checksum", params={"algorithm": "device"}) as r:
                    sums.append((await r.json())["checksums"])
        assert sums[0] == sums[1]
    finally:
        await one.stop_async(2)
        await two.stop_async(2)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three CUDA devices")
async def test_p2p_from_a_gpu_trainer_into_a_tp2_engine(tmp_path):
    import asyncio

    from safetensors.torch import load_file

    from miles.weights.checks import CHECKSUMS
    from miles.weights.config import WeightsConfig
    from miles.weights.factory import make_transport
    path = build_tiny_model(arch="qwen3")
    engine = await launch_embedded_engine(path, log_path=tmp_path / "tp2.log", ready_timeout_s=300,
                                          extra_args=ARGS + ["--tp-size", "2", "--device", "cuda:1"])
    torch.cuda.set_device(0)
    transport = make_transport(WeightsConfig(transport="p2p", group_backend="nccl",
                                             connect_timeout_s=120.0), rank=0, world_size=1)
    try:
        await asyncio.to_thread(transport.connect, [engine.url])
        full = {}
        for f in path.glob("*.safetensors"):
            full.update({k: v.float().cuda() + 0.5 for k, v in load_file(str(f)).items()})

        def publish():
            transport.begin(1)
            transport.send_bucket(list(full.items()))
            transport.finish(1)

        await asyncio.to_thread(publish)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{engine.url}/weights_checksum", params={"algorithm": "device"}) as r:
                sums = (await r.json())["checksums"]
        assert sums == {n: CHECKSUMS["device"](t) for n, t in full.items()}
    finally:
        await asyncio.to_thread(transport.close)
        await engine.stop_async(2)
