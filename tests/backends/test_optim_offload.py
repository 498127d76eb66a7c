"""Optimizer-state offload (miles/backends/optim_offload.py): moments in host memory or files,
streamed per bucket; the parameters after training are bit-identical to plain AdamW's."""

from __future__ import annotations

import pytest
import torch
from backend_helpers import run_ranks

from miles.backends import TrainConfig
from miles.backends.optim_offload import BUFFERS, OffloadedAdamW

WORKER = __import__("pathlib").Path(__file__).with_name("offload_worker.py")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_steps_are_bit_identical_to_adamw(offload, tmp_path):
    ref, off = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, foreach=True)
    adamw = torch.optim.AdamW(_groups(ref), **kw)
    # 1 KiB buckets (256 floats): each Linear weight (2048, 512 floats) is cut into bucket-sized
    # pieces, a bucket each; the biases share
    streamed = OffloadedAdamW(_groups(off), offload=offload, offload_dir=str(tmp_path),
                              bucket_bytes=1 << 10, **kw)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for model, opt in ((ref, adamw), (off, streamed)):
            opt.zero_grad()
            model(x * (step + 1)).square().mean().backward()
            opt.step()
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)
    assert len(streamed._buckets) >= 3
    moved = 2 * sum(p.numel() * 4 for p in off.parameters()) * 3
    assert streamed.stats["read_bytes"] == streamed.stats["write_bytes"] == moved
    # the moments are not on the optimizer (the device); state_dict brings them out exactly
    assert all(set(st) == {"step"} for st in streamed.state.values())
    sd, ref_sd = streamed.state_dict(), adamw.state_dict()
    for i, st in ref_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][i][key], st[key]), (i, key)
    if offload == "nvme":
        files = list(tmp_path.rglob("bucket*.bin"))
        assert len(files) == len(streamed._buckets)
        streamed.close()
        assert not any(tmp_path.rglob("bucket*.bin"))


def _big_params(seed: int):
    # odd sizes: a weight 7.5 buckets long (its last piece shares a bucket with the next weight),
    # one exactly a bucket, one just over, and biases
    gen = torch.Generator().manual_seed(seed)
    shapes = [(120, 1000), (3,), (4096, 8), (32769,), (5, 7)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.02) for s in shapes]


@pytest.mark.parametrize("kernel", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_parameter_larger_than_a_bucket_is_cut_and_the_budget_holds(kernel, offload, tmp_path):
    bucket_bytes = 128 << 10  # 32768 floats: the 120x1000 weight is 3.7 buckets
    ref, off = _big_params(0), _big_params(0)
    choice = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kernel]
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, **choice)
    adamw = torch.optim.AdamW(ref, **kw)
    streamed = OffloadedAdamW(off, offload=offload, offload_dir=str(tmp_path),
                              bucket_bytes=bucket_bytes, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # a step count advanced once per piece would change the bias correction
        grads = [torch.randn(p.shape, generator=gen) for p in ref]
        for params, opt in ((ref, adamw), (off, streamed)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(ref, off):
        assert torch.equal(a, b)
    # the offloader's own accounting: no bucket over the budget, and what a step allocated for
    # moments is BUFFERS of them (before cutting, the biggest weight set it: 3 x 2 x 469 KiB)
    assert max(b.numel for b in streamed._buckets) * 4 <= bucket_bytes
    assert streamed.stats["device_buffer_bytes"] == BUFFERS * 2 * bucket_bytes
    assert len(streamed._where[id(off[0])]) == 4 and len(streamed._where[id(off[3])]) == 2
    moved = 3 * 2 * sum(p.numel() * 4 for p in off)
    assert streamed.stats["read_bytes"] == streamed.stats["write_bytes"] == moved
    sd, ref_sd = streamed.state_dict(), adamw.state_dict()
    for i, st in ref_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][i][key], st[key]), (i, key)
    # a checkpoint of cut parameters loads into another layout (nothing cut there: 1 GiB buckets)
    again = _big_params(0)
    for a, b in zip(again, off):
        a.data.copy_(b.data)
    resumed = OffloadedAdamW(again, offload=offload, offload_dir=str(tmp_path), bucket_bytes=1 << 30, **kw)
    resumed.load_state_dict(sd)
    grads = [torch.randn(p.shape, generator=gen) for p in ref]
    for params, opt in ((ref, adamw), (again, resumed)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(ref, again):
        assert torch.equal(a, b)
    streamed.close()
    resumed.close()


def test_load_state_dict_round_trip(tmp_path):
    ref, off = _model(), _model()
    adamw = torch.optim.AdamW(_groups(ref), lr=1e-2, foreach=True)
    x = torch.randn(4, 32)
    ref(x).sum().backward()
    adamw.step()
    off.load_state_dict(ref.state_dict())
    streamed = OffloadedAdamW(_groups(off), offload="nvme", offload_dir=str(tmp_path),
                              bucket_bytes=1 << 10, lr=1e-2, foreach=True)
    streamed.load_state_dict(adamw.state_dict())
    for model, opt in ((ref, adamw), (off, streamed)):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)


def test_bad_offload_settings_name_the_field():
    with pytest.raises(ValueError, match=r"train.optimizer_offload='disk' is not one of"):
        TrainConfig(optimizer_offload="disk")
    with pytest.raises(ValueError, match=r"train.offload_dir"):
        TrainConfig(optimizer_offload="nvme")
    with pytest.raises(ValueError, match=r"offload_dir"):
        OffloadedAdamW(_model().parameters(), offload="nvme", offload_dir="").step()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp_offload_is_bit_identical_and_resumes(world_size, tmp_path):
    ranks = run_ranks("offload:qwen3", tmp_path, world_size=world_size, timeout_s=300, worker=WORKER)
    for r in ranks:
        d = r["digests"]
        assert d["cpu"] == d["none"] and d["nvme"] == d["none"], "offload changed the parameters"
        assert r["losses_cpu"] == r["losses_none"] == r["losses_nvme"]
        assert r["buckets_cpu"] > 3 and r["read_bytes_nvme"] > 0
        assert r["state_tensors_cpu"] == r["state_tensors_nvme"] == ["step"]
        # step 1, checkpoint, load, step 2 == two steps straight (moments restored exactly)
        for pair in ("nvme_nvme", "nvme_none", "none_cpu"):
            assert r[f"resumed_{pair}"] == d["none"], pair
        assert r["nvme_files"] >= r["buckets_nvme"]  # one file per bucket on this rank at least


def test_a_dropped_optimizer_releases_its_files(tmp_path):
    import gc
    model = _model()
    opt = OffloadedAdamW(model.parameters(), offload="nvme", offload_dir=str(tmp_path), lr=1e-3,
                         bucket_bytes=1 << 10, foreach=True)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    assert list(tmp_path.rglob("bucket*.bin"))
    del opt
    gc.collect()
    assert not list(tmp_path.rglob("bucket*.bin"))  # a finished warm-start phase leaves nothing
