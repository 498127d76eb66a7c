"""One trainer rank publishing into a real TP-2 embedded engine through `weights.transport = "p2p"`.

    python p2p_engine_worker.py <model dir> <engine url> <out dir>

The transport is the recipe's (make_transport from a WeightsConfig), so the plan comes from the
engine's /p2p_layout and the group is joined over HTTP. Trains one step (the weights are then the
trainer's, not the checkpoint's), publishes version 1, writes what this rank sent to each engine
rank (rank<r>.json) and, on rank 0, the full HF tensors it published (trainer.safetensors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.weights.config import WeightsConfig  # noqa: E402
from miles.weights.factory import make_transport  # noqa: E402


def main() -> None:
    model_dir, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = RankInfo.from_env()
    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=model_dir, param_dtype="float32", lr=1e-2,
                             update_bucket_bytes=64 << 10), rank, LossConfig())
    backend.train(make_samples(groups=2, per_group=2, seed=5, vocab=500))
    cfg = WeightsConfig(transport="p2p", connect_timeout_s=60.0, group_timeout_s=60.0,
                        bucket_timeout_s=60.0, control_timeout_s=30.0)
    transport = make_transport(cfg, rank=rank)
    transport.connect([url])
    backend.update_weights(transport, version=1)
    full = {n: t.clone() for bucket in backend.iter_hf_weight_buckets() for n, t in bucket}
    if rank.rank == 0:
        from safetensors.torch import save_file
        save_file(full, str(out / "trainer.safetensors"))
    (out / f"rank{rank.rank}.json").write_text(json.dumps(
        {"sent_bytes": transport.sent_bytes, "load_s": transport.stats.load_s,
         "buckets": transport.stats.buckets}))
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
