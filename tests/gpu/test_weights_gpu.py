"""Weight transports on CUDA: colocated CUDA IPC (trainer and engine on one GPU), NCCL from GPU 0 to
an engine on GPU 1 with a request in flight across the update, disk-delta into a CUDA engine. Every
publish runs with check_weights (each engine parameter's checksum equals what the trainer sent; the
device digest when the trainer's tensors are on a GPU). The NCCL test sends v1 zero-copy
(`direct_min_bytes`), v2 as flat buckets.

Skipped without CUDA (the NCCL test needs 2 GPUs). Run:
    .venv/bin/python -m pytest tests/gpu/test_weights_gpu.py -q
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.hf_weights import iter_hf_weight_buckets  # noqa: E402
from miles.engines.client import EngineClient  # noqa: E402
from miles.engines.embedded import launch_embedded_engine  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402
from miles.weights import WeightPublisher, WeightsConfig, make_transport, send_weights  # noqa: E402

MODEL = dict(arch="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
ENGINE = ["--dtype", "bfloat16", "--log-level", "warning", "--random-seed", "0",
          "--max-total-tokens", "8192"]


def plain_model(path, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()


def run_update(model, transport, version: int, bucket_bytes: int = 4 << 20):
    """FSDPBackend.update_weights on the sender rank, for a plain model."""
    def run():
        send_weights(transport, version, iter_hf_weight_buckets(model, bucket_bytes))
    return run


def nudge(model, scale: float = 1e-2) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


@pytest.mark.parametrize("direct,batch_below", [(True, 1 << 20), (True, 0), (False, 1 << 20)],
                         ids=["direct", "direct_copy_each", "buckets"])
async def test_colocated_cuda_ipc_from_the_fsdp_backend(tmp_path, direct, batch_below):
    path = build_tiny_model(**MODEL)
    engine = await launch_embedded_engine(path, extra_args=["--device", "cuda:0", *ENGINE],
                                          log_path=tmp_path / "engine.log")
    try:
        backend = make_backend("fsdp")
        backend.init(TrainConfig(model_path=str(path), param_dtype="bfloat16", lr=1e-4), RankInfo(),
                     LossConfig(loss_type="sft", loss_reduction="token"))
        await asyncio.to_thread(backend.train, make_samples(groups=2, per_group=2, seed=7))
        cfg = WeightsConfig(transport="colocated", check_weights=True, bucket_bytes=8 << 20,
                            colocated_direct=direct, colocated_batch_below_bytes=batch_below)
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        for version in (1, 2):
            report = await publisher.publish(version, lambda v=version: backend.update_weights(transport, v))
            assert report.checked  # every engine parameter's checksum equals the trainer's
            if direct:  # written straight into the engine's views: no flat bucket
                assert report.direct_tensors == report.tensors > 0 and report.buckets == 0
            else:
                assert report.buckets >= 2 and report.direct_tensors == 0
            m = report.metrics()  # stall time: the parts add up, the load tail is measured
            assert m["weights/stall_s"] == pytest.approx(sum(m[f"weights/{k}_s"] for k in (
                "pause", "transfer", "load", "version", "resume")))
            assert m["weights/load_s"] > 0
            await asyncio.to_thread(backend.train, make_samples(groups=2, per_group=2, seed=8))
        async with EngineClient(engine.url) as c:
            assert (await c.model_info())["weight_version"] == "2"
            out = await c.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0.0})
            assert len(out.output_ids) == 8
        await publisher.close()
        transport.close()
        backend.close()
    finally:
        await engine.stop_async()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
async def test_nccl_gpu0_to_engine_on_gpu1_with_a_request_in_flight(tmp_path):
    path = build_tiny_model(**MODEL)
    engine = await launch_embedded_engine(path, extra_args=["--device", "cuda:1", *ENGINE],
                                          log_path=tmp_path / "engine.log")
    try:
        torch.cuda.set_device(0)
        model = plain_model(path, "cuda:0")
        cfg = WeightsConfig(transport="nccl", check_weights=True, bucket_bytes=4 << 20,
                            connect_timeout_s=60)
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        async with EngineClient(engine.url) as c:
            for version in (1, 2):
                # v1 zero-copy (matrices straight into the engine's parameters), v2 flat buckets
                cfg.direct_min_bytes = (1 << 20) if version == 1 else 0  # read at begin()
                nudge(model)
                stream = c.generate_stream([5, 6, 7], {"max_new_tokens": 300, "temperature": 0.0,
                                                       "ignore_eos": True})
                await stream.__anext__()
                report = await publisher.publish(version, run_update(model, transport, version))
                assert report.checked and report.buckets >= 2
                assert (report.direct_tensors > 0) == (version == 1), report
                last = None
                async for chunk in stream:
                    last = chunk
                assert len(last.output_ids) == 300
                assert [s.version for s in last.weight_versions][-1] == str(version)
                assert len(last.weight_versions) == 2
        await publisher.close()
        transport.close()
    finally:
        await engine.stop_async()


async def generates_on(url: str, version: str) -> None:
    """The engine still generates, and on the weights of `version`."""
    client = EngineClient(url)
    try:
        out = await client.generate([5, 17, 42], {"max_new_tokens": 8})
    finally:
        await client.close()
    assert len(out.output_ids) == 8 and out.weight_version == version


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
async def test_disk_delta_into_a_cuda_engine(graphs, tmp_path):
    path = build_tiny_model(**MODEL)
    # The engine stages on its GPU only when free memory exceeds the delta by its headroom (2 GiB):
    # give back what earlier tests of this process keep cached. At INFO, the engine logs where.
    torch.cuda.empty_cache()
    engine = await launch_embedded_engine(path, extra_args=[
        "--device", "cuda:0", *ENGINE, "--log-level", "info",
        *([] if graphs else ["--disable-cuda-graph"])], log_path=tmp_path / "engine.log")
    try:
        model = plain_model(path, "cuda:0")
        cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp_path / "d"))
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        nudge(model)
        first = await publisher.publish(1, run_update(model, transport, 1))
        nudge(model, 1e-5)  # a few low mantissa bits: a small XOR delta
        second = await publisher.publish(2, run_update(model, transport, 2))
        assert first.checked and second.checked
        assert transport.last_manifest.base_version == 1
        assert second.payload_bytes < first.payload_bytes
        # staged on the GPU (it has room): apply swaps device pointers or copies device to device
        free, total = torch.cuda.mem_get_info(0)
        assert transport.staged_on == ["cuda:0"], (transport.staged_on, f"free {free / 2**30:.1f} "
                                                   f"of {total / 2**30:.1f} GiB")
        assert "staged on cuda:0" in (tmp_path / "engine.log").read_text()
        # never paused; with captured decode graphs every weight is copied (a replay reads the
        # addresses it captured), eager the whole weights are swapped in (6 per layer + 2)
        assert second.pause_s == second.paused_s == 0.0
        [applied] = transport.applied
        assert applied["swapped"] == (0 if graphs else 6 * MODEL["num_hidden_layers"] + 2), applied
        assert applied["swapped"] + applied["copied"] == second.tensors
        # and it still generates, on the checked weights
        await generates_on(engine.url, "2")
        await publisher.close()
        transport.close()
    finally:
        await engine.stop_async()


async def test_a_sparse_disk_delta_is_scattered_on_the_gpu_under_cuda_graphs(tmp_path):
    """--delta-staging sparse: only the changed elements go to the GPU and `apply` writes them into
    the live weights in place, so the captured decode graphs keep their addresses."""
    path = build_tiny_model(**MODEL)
    torch.cuda.empty_cache()
    engine = await launch_embedded_engine(path, extra_args=[
        "--device", "cuda:0", *ENGINE, "--log-level", "info", "--delta-staging", "sparse"],
        log_path=tmp_path / "engine.log")
    try:
        model = plain_model(path, "cuda:0")
        cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp_path / "d"))
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        nudge(model)
        await publisher.publish(1, run_update(model, transport, 1))
        nudge(model, 1e-5)
        second = await publisher.publish(2, run_update(model, transport, 2))
        assert second.checked and transport.staged_on == ["cuda:0"]
        [applied] = transport.applied
        assert applied["scattered"] == second.tensors and applied["swapped"] == 0, applied
        assert "staged on cuda:0 (sparse:" in (tmp_path / "engine.log").read_text()
        await generates_on(engine.url, "2")
        await publisher.close()
        transport.close()
    finally:
        await engine.stop_async()
