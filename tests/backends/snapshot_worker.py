"""One trainer rank of the snapshot test (launched by backend_helpers.run_ranks, 1 or 2 ranks).

    python snapshot_worker.py heal:<snapshot dir> <out.json>

Trains two steps (the warm start's phase and RL's, so two optimizers' moments are in it), takes
an in-memory snapshot into this rank's double-buffered file, trains on, and checks that a fresh
backend restored from the file trains the same losses bit for bit (the RNG included: dropout
is off in the tiny model, so the RNG is checked by drawing from it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends import snapshot  # noqa: E402
from miles.wire.snapshot import HEADER_BYTES, SnapshotFile, snapshot_bytes  # noqa: E402
from miles.backends.base import TrainPhase  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402


def main(folder: Path, out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch="qwen3"))
    grpo = LossConfig(advantage_estimator="grpo", loss_reduction="token")
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=1e-3, max_tokens_per_microbatch=4096)
    sft = TrainPhase("sft", LossConfig(loss_type="sft", loss_reduction="token"), cfg)
    batch = make_samples(groups=2, per_group=4, seed=5)
    trainer = make_backend("fsdp")
    trainer.init(cfg, rank, grpo)
    trainer.train(batch)
    trainer.train(batch, sft)  # RL's moments and the warm start's: both in the snapshot
    file = SnapshotFile(folder / f"trainer-{rank.rank}.snap")
    meta, arrays = snapshot.capture(trainer, train_call=2, metrics={"loss": 1.5})
    file.write(meta, arrays)
    draws = torch.rand(4).tolist()
    after = [trainer.train(batch)["loss"] for _ in range(2)]
    file.write(*snapshot.capture(trainer, train_call=4, metrics={}))
    # a writer killed mid-copy: slot of call 4 opened (begin) but never closed (end)
    torn = SnapshotFile(file.path)
    with open(file.path, "r+b") as f:
        slot = HEADER_BYTES + (torn.seq % 2) * torn._slot_bytes()
        f.seek(slot + 8)
        f.write((0).to_bytes(8, "little"))
    images = SnapshotFile(file.path).images()
    assert [i.meta["train_call"] for i in images] == [2], [i.meta["train_call"] for i in images]

    resumed = make_backend("fsdp")
    resumed.init(cfg, rank, grpo)
    snapshot.restore(resumed, images[0])
    assert resumed.step == trainer.step - 2, (resumed.step, trainer.step)
    assert torch.rand(4).tolist() == draws
    again = [resumed.train(batch)["loss"] for _ in range(2)]
    assert again == after, f"the restored backend trained other losses: {after} vs {again}"
    for (n, p), (_, q) in zip(trainer.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{n} differs after the same two steps"
    out.write_text(json.dumps({"losses": after, "restored": images[0].meta["train_call"],
                               "bytes": snapshot_bytes(arrays),
                               "phases": meta["phases"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    kind, _, arg = scenario.partition(":")
    if kind != "heal":
        raise SystemExit(f"unknown scenario {scenario!r}")
    main(Path(arg), out_path)
