"""One trainer rank of the Megatron optimizer-offload tests (launched by backend_helpers.run_ranks).

    python megatron_offload_worker.py offload:<tp> <out.json>      (DP = world size / tp)

On CPU (gloo), fp32, the same batch: two optimizer steps with train.optimizer_offload none, cpu
and nvme (moments streamed in 16 KiB buckets, so every parameter group spans many, the
embedding cut into pieces), each run's local parameters hashed; then save after one step, resume
in a fresh backend (the same or another offload) and take the second step. Every run builds its
own megatron groups in the one process group, as the resharding checkpoint test does. Rank r
writes its own digests and figures to <out.json>; the pytest side compares.
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
from miles.backends import RankInfo, TrainConfig  # noqa: E402
from miles.backends.base import MAIN_PHASE  # noqa: E402
from miles.backends.config import MegatronConfig  # noqa: E402
from miles.backends.megatron import MegatronBackend  # noqa: E402
from miles.backends.optim_offload import OffloadedAdamW  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

BUCKET_BYTES = 16 << 10
# SFT: its loss is the NLL itself, so it tells weights apart
LOSS = LossConfig(loss_type="sft", loss_reduction="token")


def build(path: str, rank: RankInfo, tp: int, offload: str, tmp: Path) -> MegatronBackend:
    cfg = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=3e-3,
                      weight_decay=0.01, max_tokens_per_microbatch=128, optimizer_offload=offload,
                      offload_dir=str(tmp / "nvme") if offload == "nvme" else "",
                      megatron=MegatronConfig(tp=tp, pp=1, sequence_parallel=False))
    backend = MegatronBackend()
    backend.init(cfg, rank, LOSS)
    inner = backend._optimizers[MAIN_PHASE].optimizer
    if offload != "none":
        assert isinstance(inner, OffloadedAdamW), type(inner)
        inner.bucket_bytes = BUCKET_BYTES  # before the first step lays the buckets out
    else:
        assert type(inner) is torch.optim.AdamW, type(inner)
    return backend


def digests(backend: MegatronBackend) -> dict[str, str]:
    """sha256 of every parameter this rank holds: equal digests are equal bits."""
    out = {}
    for i, chunk in enumerate(backend.chunks):
        for name, p in chunk.module.named_parameters():
            data = p.detach().cpu().contiguous()
            out[f"{i}.{name}"] = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def drop(backend: MegatronBackend) -> None:
    """Let the backend's model and optimizer go (its offload files too), keeping the process group."""
    backend.chunks = None
    backend._optimizers.clear()


def scenario(tp: int, out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch="qwen3"))
    tmp = out.parent / f"rank{rank.rank}"
    tmp.mkdir(parents=True, exist_ok=True)
    batch = make_samples(groups=2, per_group=4, seed=3)
    result: dict = {"rank": rank.rank, "digests": {}, "losses": {}}
    for offload in ("none", "cpu", "nvme"):
        backend = build(path, rank, tp, offload, tmp)
        result["losses"][offload] = [backend.train(batch)["loss"] for _ in range(2)]
        result["digests"][offload] = digests(backend)
        inner = backend._optimizers[MAIN_PHASE].optimizer
        if offload != "none":
            result[f"buckets_{offload}"] = len(inner._buckets)
            result[f"read_bytes_{offload}"] = inner.stats["read_bytes"]
            result[f"moment_bytes_{offload}"] = sum(2 * m.numel() * m.element_size()
                                                    for m in backend._optimizers[MAIN_PHASE].mains)
            # between steps the optimizer holds no moments (only the scalar step counts)
            result[f"state_keys_{offload}"] = sorted({k for st in inner.state.values() for k in st})
        if offload == "nvme":
            result["nvme_files"] = len(list((tmp / "nvme").rglob("bucket*.bin")))
        drop(backend)

    # Step 1, save, a fresh backend loads, step 2: equal to two steps straight on. Across
    # offloads too: the checkpoint holds the moments, not where they were kept.
    for saver, loader in (("nvme", "nvme"), ("cpu", "none"), ("none", "cpu")):
        ckpt = out.parent / f"ckpt-{saver}-{loader}"
        first = build(path, rank, tp, saver, tmp)
        first.train(batch)
        first.save_model(ckpt, extra_state={"k": 1})
        drop(first)
        resumed = build(path, rank, tp, loader, tmp)
        assert resumed.load_model(ckpt) == {"k": 1} and resumed.step == 1
        resumed.train(batch)
        result[f"resumed_{saver}_{loader}"] = digests(resumed)
        if loader == "nvme":  # the loaded moments went into its files, not onto the optimizer
            inner = resumed._optimizers[MAIN_PHASE].optimizer
            result["resumed_state_keys"] = sorted({k for st in inner.state.values() for k in st})
        drop(resumed)
    dist.barrier()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    kind, _, tp = sys.argv[1].partition(":")
    if kind != "offload":
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
    scenario(int(tp), Path(sys.argv[2]))
    dist.barrier()
    dist.destroy_process_group()
