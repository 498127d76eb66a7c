"""One trainer rank of the optimizer-offload tests (launched by backend_helpers.run_ranks).

    python offload_worker.py offload:<arch> <out.json>

Trains the same batch for two optimizer steps with train.optimizer_offload none, cpu and nvme
(moments streamed in buckets small enough that every parameter group spans several) and writes
each run's full parameters' sha256 plus the resume checks to <out.json>; the pytest side compares.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.optim_offload import OffloadedAdamW  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402


def digests(backend) -> dict[str, str]:
    """sha256 of every full (gathered) parameter: equal digests are equal bits."""
    out = {}
    for name, p in backend.policy.named_parameters():
        full = p.full_tensor().detach().cpu().contiguous()
        out[name] = hashlib.sha256(full.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def build(path: str, rank, offload: str, tmp: Path):
    backend = make_backend("fsdp")
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=1e-3, weight_decay=0.1,
                      max_tokens_per_microbatch=4096, optimizer_offload=offload,
                      offload_dir=str(tmp / "nvme") if offload == "nvme" else "")
    backend.init(cfg, rank, LossConfig(advantage_estimator="grpo", loss_reduction="rollout"))
    opt = backend.optimizer
    if offload != "none":
        assert isinstance(opt, OffloadedAdamW), type(opt)
        opt.bucket_bytes = 16 << 10  # many buckets: a bucket boundary inside every group
    return backend


def scenario(arch: str, out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    tmp = out.parent
    samples = make_samples(groups=2, per_group=4, seed=3)
    result: dict = {"rank": rank.rank, "digests": {}}
    for offload in ("none", "cpu", "nvme"):
        backend = build(path, rank, offload, tmp)
        losses = [backend.train(samples)["loss"] for _ in range(2)]
        result["digests"][offload] = digests(backend)
        result[f"losses_{offload}"] = losses
        opt = backend.optimizer
        if offload != "none":
            result[f"buckets_{offload}"] = len(opt._buckets)
            result[f"read_bytes_{offload}"] = opt.stats["read_bytes"]
            # between steps the device holds no moments (only the scalar step counts)
            result[f"state_tensors_{offload}"] = sorted({k for st in opt.state.values() for k in st})
        if offload == "nvme":
            files = sorted((tmp / "nvme").rglob("bucket*.bin"))
            result["nvme_files"] = len(files)
            result["nvme_bytes"] = sum(f.stat().st_size for f in files)
        del backend

    # Resume with offload on: save after step 1, step 2 after loading equals step 2 straight on
    # (and a checkpoint written with nvme loads into a run without offload, and back).
    for saver, loader in (("nvme", "nvme"), ("nvme", "none"), ("none", "cpu")):
        ckpt = tmp / f"ckpt-{saver}-{loader}"
        first = build(path, rank, saver, tmp)
        first.train(samples)
        first.save_model(ckpt, extra_state={"k": 1})
        del first
        resumed = build(path, rank, loader, tmp)
        assert resumed.load_model(ckpt) == {"k": 1}
        resumed.train(samples)
        result[f"resumed_{saver}_{loader}"] = digests(resumed)
        del resumed
    dist.barrier()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    kind, _, arch = sys.argv[1].partition(":")
    if kind != "offload":
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
    scenario(arch, Path(sys.argv[2]))
    dist.barrier()
    dist.destroy_process_group()
