"""Megatron backend on one CUDA device (TP=1): bf16 training steps through megatron's own optimizer
(fp32 main params, distributed optimizer over DP=1), bf16 log-probs close to the FSDP backend's on
the same weights, sleep freeing the device, and weights into a CUDA embedded engine over the
colocated (CUDA IPC) transport, checked by sha256.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_megatron_gpu.py -q
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
from miles.engines.client import EngineClient  # noqa: E402
from miles.engines.embedded import launch_embedded_engine  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402
from miles.weights import WeightPublisher, WeightsConfig, make_transport  # noqa: E402

MODEL = dict(arch="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
ENGINE = ["--dtype", "bfloat16", "--log-level", "warning", "--random-seed", "0",
          "--max-total-tokens", "8192"]
SFT = LossConfig(loss_type="sft", loss_reduction="token")


def _megatron(path, **kw):
    backend = make_backend("megatron")
    backend.init(TrainConfig(backend="megatron", model_path=str(path), param_dtype="bfloat16", lr=1e-3,
                             max_tokens_per_microbatch=512, **kw), RankInfo(), SFT)
    return backend


def test_bf16_steps_megatron_optimizer_and_sleep():
    from miles.backends.megatron_step import MegatronAdam

    path = build_tiny_model(**MODEL)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    backend = _megatron(path)
    batch = make_samples(groups=2, per_group=4, seed=6, vocab=400)
    try:
        assert isinstance(backend._optimizers["rl"], MegatronAdam)
        losses = [backend.train(batch)["loss"] for _ in range(4)]
        assert losses[3] < losses[0], losses
        param = next(backend.chunks[0].parameters())
        assert param.dtype == torch.bfloat16 and param.is_cuda
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated() - base
        backend.sleep()
        asleep = torch.cuda.memory_allocated() - base
        print(f"memory_allocated by the backend: awake {awake / 2**20:.1f} MiB, asleep "
              f"{asleep / 2**20:.1f} MiB (the process held {base / 2**20:.1f} MiB before)")
        assert asleep < 0.2 * awake, (awake, asleep, base)
        backend.wake_up()
        after = backend.train(batch)["loss"]
        assert after < losses[0]
    finally:
        backend.close()


def test_megatron_logprobs_match_fsdp_in_bf16():
    """The same checkpoint, the same batch, lr 0: the two backends' first-step entropies agree."""
    path = build_tiny_model(**MODEL)
    batch = make_samples(groups=2, per_group=4, seed=9, vocab=400)
    out = {}
    for name in ("fsdp", "megatron"):
        backend = make_backend(name)
        backend.init(TrainConfig(backend=name, model_path=str(path), param_dtype="bfloat16", lr=0.0,
                                 max_tokens_per_microbatch=512, compile=False), RankInfo(), SFT)
        out[name] = backend.train(batch)
        backend.close()
    print({k: (v["loss"], v["entropy"]) for k, v in out.items()})
    assert abs(out["fsdp"]["loss"] - out["megatron"]["loss"]) < 0.02 * abs(out["fsdp"]["loss"])
    assert abs(out["fsdp"]["entropy"] - out["megatron"]["entropy"]) < 0.02 * out["fsdp"]["entropy"]


async def test_megatron_weights_into_a_cuda_engine(tmp_path):
    path = build_tiny_model(**MODEL)
    engine = await launch_embedded_engine(path, extra_args=["--device", "cuda:0", *ENGINE],
                                          log_path=tmp_path / "engine.log")
    try:
        backend = await asyncio.to_thread(_megatron, path)
        await asyncio.to_thread(backend.train, make_samples(groups=2, per_group=2, seed=7))
        cfg = WeightsConfig(transport="colocated", check_weights=True, bucket_bytes=8 << 20)
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        for version in (1, 2):
            report = await publisher.publish(version, lambda v=version: backend.update_weights(transport, v))
            # straight into the engine's own weights (colocated_direct): no flat bucket left
            assert report.checked and report.direct_tensors == report.tensors and report.buckets == 0
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


def test_megatron_dist_checkpoint_and_ppo_with_megatrons_optimizer(tmp_path):
    """dist_checkpointing with megatron's own optimizer (bf16, fp32 main params, the distributed
    optimizer's fully reshardable state): save, one step (loss A); a fresh backend loads, one step:
    loss A again (bf16: to 1e-3 relative). Then PPO on CUDA: the critic (its own megatron optimizer)
    learns and its checkpoint resumes the same way."""
    path = build_tiny_model(**MODEL)
    batch = make_samples(groups=2, per_group=4, seed=6, vocab=400)
    first = _megatron(path)
    second = None
    try:
        first.train(batch)
        first.save_model(tmp_path / "ckpt", extra_state={"data_position": 2})
        want = first.train(batch)["loss"]
        second = _megatron(path)
        assert second.load_model(tmp_path / "ckpt") == {"data_position": 2} and second.step == 1
        got = second.train(batch)["loss"]
        print(f"dist_checkpoint resume on CUDA: loss {want:.6f} vs {got:.6f}")
        assert got == pytest.approx(want, rel=1e-3)
    finally:
        (second or first).close()
    ppo = LossConfig(advantage_estimator="ppo", loss_reduction="token")
    cfg = TrainConfig(backend="megatron", model_path=str(path), param_dtype="bfloat16", lr=1e-6, critic_lr=2e-3,
                      max_tokens_per_microbatch=512)
    a = make_backend("megatron")
    a.init(cfg, RankInfo(), ppo)
    b = None
    try:
        history = [a.train(batch) for _ in range(8)]
        losses = [m["value_loss"] for m in history]
        print("megatron PPO on CUDA: value_loss", [round(x, 4) for x in losses],
              "explained_variance", [round(m["explained_variance"], 3) for m in history])
        assert losses[-1] < 0.5 * losses[0], losses
        a.save_model(tmp_path / "ppo")
        want = a.train(batch)["value_loss"]
        b = make_backend("megatron")
        b.init(cfg, RankInfo(), ppo)
        b.load_model(tmp_path / "ppo")
        assert b.train(batch)["value_loss"] == pytest.approx(want, rel=1e-3)
    finally:
        (b or a).close()
