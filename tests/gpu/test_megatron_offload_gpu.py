"""Megatron backend with optimizer-state offload on one CUDA device (bf16 weights, fp32 main params):
LocalAdamW over OffloadedAdamW (fused kernels, pinned host buffers or files, side streams) leaves
the parameters bit-identical to the same optimizer keeping its moments on the device, the moments
are not on the device between steps (what the backend holds is smaller by at least them), and the
run still learns like megatron's own optimizer.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_megatron_offload_gpu.py -q
"""

from __future__ import annotations

import gc
import hashlib
import sys
from pathlib import Path

import msgspec
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.base import MAIN_PHASE  # noqa: E402
from miles.backends.megatron_step import LocalAdamW, MegatronAdam  # noqa: E402
from miles.backends.optim_offload import OffloadedAdamW  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

MODEL = dict(arch="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
SFT = LossConfig(loss_type="sft", loss_reduction="token")
STEPS = 3


def _run(path, tmp_path, offload: str, batch) -> dict:
    """STEPS steps; "device" is LocalAdamW with plain fused AdamW (the moments on the device),
    "megatron" the backend's choice without offload (megatron's optimizer)."""
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    mode = "cpu" if offload == "device" else ("none" if offload == "megatron" else offload)
    cfg = TrainConfig(backend="megatron", model_path=str(path), param_dtype="bfloat16", lr=1e-3,
                      max_tokens_per_microbatch=512, optimizer_offload=mode,
                      offload_dir=str(tmp_path / "nvme") if mode == "nvme" else "")
    backend = make_backend("megatron")
    backend.init(cfg, RankInfo(), SFT)
    try:
        opt = backend._optimizers[MAIN_PHASE]
        if offload == "device":  # the same DDP (no distributed optimizer), moments kept on the GPU
            opt = backend._optimizers[MAIN_PHASE] = LocalAdamW(
                opt.params, msgspec.structs.replace(cfg, optimizer_offload="none"), backend.device,
                fp32_main=True)
            assert type(opt.optimizer) is torch.optim.AdamW and opt.optimizer.defaults["fused"]
        elif offload == "megatron":
            assert isinstance(opt, MegatronAdam)
        else:
            assert isinstance(opt, LocalAdamW) and isinstance(opt.optimizer, OffloadedAdamW)
            opt.optimizer.bucket_bytes = 4 << 20  # several buckets: the 1.5 MiB-6 MiB weights share
        losses = [backend.train(batch)["loss"] for _ in range(STEPS)]
        torch.cuda.synchronize()
        out = {"losses": losses, "held": torch.cuda.memory_allocated() - base}
        if offload != "megatron":
            out["digest"] = hashlib.sha256(b"".join(
                p.detach().float().cpu().numpy().tobytes() for c in backend.chunks
                for p in c.module.parameters())).hexdigest()
            out["moment_bytes"] = sum(2 * m.numel() * m.element_size() for m in opt.mains)
            out["device_state"] = [(k, v.numel()) for st in opt.optimizer.state.values()
                                   for k, v in st.items() if torch.is_tensor(v) and v.is_cuda]
        if offload in ("cpu", "nvme"):
            out["buckets"] = len(opt.optimizer._buckets)
        return out
    finally:
        backend.close()


def test_offloaded_megatron_steps_are_bit_identical_and_off_the_device(tmp_path):
    path = build_tiny_model(**MODEL)
    batch = make_samples(groups=2, per_group=4, seed=6, vocab=400)
    runs = {name: _run(path, tmp_path, name, batch) for name in ("device", "cpu", "nvme", "megatron")}
    device = runs["device"]
    for name in ("cpu", "nvme"):
        r = runs[name]
        assert r["digest"] == device["digest"], f"offload {name!r} changed the parameters"
        assert r["losses"] == device["losses"]
        assert r["buckets"] >= 3
        # between steps only the step counts (scalars) are on the device, and the backend holds
        # less device memory by at least the moments (the fp32 exp_avg and exp_avg_sq of every main
        # param; measured on an H100: 166 MB less for 99 MB of moments)
        assert all(k == "step" and n == 1 for k, n in r["device_state"]), r["device_state"]
        saved = device["held"] - r["held"]
        print(f"offload {name}: backend holds {r['held'] / 2**20:.1f} MiB on the device against "
              f"{device['held'] / 2**20:.1f} MiB (moments {r['moment_bytes'] / 2**20:.1f} MiB)")
        assert saved >= 0.98 * r["moment_bytes"], (saved, r["moment_bytes"])
    assert device["losses"][-1] < device["losses"][0]
    # megatron's optimizer and ours compute the same update up to rounding
    mega = runs["megatron"]["losses"]
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(device["losses"], mega)), (device["losses"], mega)
