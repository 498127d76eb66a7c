"""Optimizer-state offload on CUDA (fused AdamW, pinned host buffers, side streams): steps are
bit-identical to torch's fused AdamW, and the moments leave device memory.

Skipped without CUDA. Run on the GPU machine:
    python -m pytest tests/gpu/test_optim_offload_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.backends.optim_offload import BUFFERS, OffloadedAdamW  # noqa: E402


def _params(seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4096, 1024), (1024,), (1024, 4096), (4096,), (8192, 1024)]
    return [torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.02).cuda()) for s in shapes]


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_fused_steps_bit_identical_and_off_the_device(offload, tmp_path):
    ref, off = _params(0), _params(0)
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, fused=True)
    adamw = torch.optim.AdamW(_groups(ref), **kw)
    streamed = OffloadedAdamW(_groups(off), offload=offload, offload_dir=str(tmp_path),
                              bucket_bytes=8 << 20, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).cuda() for p in ref]
        for params, opt in ((ref, adamw), (off, streamed)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    torch.cuda.synchronize()
    for a, b in zip(ref, off):
        assert torch.equal(a, b)
    assert len(streamed._buckets) >= 3
    on_device = [v for st in streamed.state.values() for v in st.values() if v.is_cuda and v.dim() > 0]
    assert on_device == []  # the moments live off the device between steps
    moments = sum(2 * p.numel() * 4 for p in off)  # 128 MiB
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    streamed.step()
    torch.cuda.synchronize()
    # During the step: BUFFERS buckets of [m | v], each at most 2 x bucket_bytes (the 16 and 32 MiB
    # weights are cut into 8 MiB pieces; uncut, the 32 MiB one made each buffer 64 MiB: 192 MiB).
    # The 1 MiB is for the copies of the step count the earlier pieces step with (512 B blocks);
    # fused AdamW allocates nothing else. The offloader's own count says the same, exactly.
    budget = BUFFERS * 2 * (8 << 20)
    assert streamed.stats["device_buffer_bytes"] == budget
    assert torch.cuda.max_memory_allocated() - before <= budget + (1 << 20) < moments
    assert torch.cuda.memory_allocated() - before <= 1 << 20  # and nothing of it stays after
    sd = streamed.state_dict()
    assert sd["state"][0]["exp_avg"].device.type == "cpu"
