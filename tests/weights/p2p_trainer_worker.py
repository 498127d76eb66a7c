"""One trainer rank of the P2P transfer test: a real FSDP backend (gloo) publishing through P2PTransport.

    python p2p_trainer_worker.py <model dir> <plan.msgpack> <p2p port> <out dir> [full|shards]

full: backend.update_weights (a dense model: publish_local from the rank's own shards; MoE: the
backend's gather, then each rank sends its rows); shards: P2PTransport.publish_local called
directly. Every all_gather is counted.

Trains one step (so the weights are the trainer's, not the checkpoint's), publishes version 1,
then writes what it sent to each engine rank (rank<r>.json) and, on rank 0, the full HF tensors
it published (trainer.safetensors) for the test to compare with what the engine ranks hold.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.weights.p2p import P2PTransport, Plan  # noqa: E402


def main() -> None:
    model_dir, plan_path, port, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    rank = RankInfo.from_env()
    plan = msgspec.msgpack.decode(plan_path.read_bytes(), type=Plan)
    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=model_dir, param_dtype="float32", lr=1e-2,
                             update_bucket_bytes=64 << 10), rank, LossConfig())
    backend.train(make_samples(groups=2, per_group=2, seed=5, vocab=500))
    transport = P2PTransport(rank.rank, plan, port=port, timeout_s=120.0)
    transport.connect([])
    mode = sys.argv[5] if len(sys.argv) > 5 else "full"
    gathers = []
    real = dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    try:
        if mode == "shards":
            transport.publish_local(backend.policy.lm, 1, bucket_bytes=64 << 10)
        else:
            backend.update_weights(transport, version=1)
    finally:
        dist.all_gather_into_tensor = real
    full = {n: t.clone() for bucket in backend.iter_hf_weight_buckets() for n, t in bucket}
    if rank.rank == 0:
        from safetensors.torch import save_file
        save_file(full, str(out / "trainer.safetensors"))
    (out / f"rank{rank.rank}.json").write_text(json.dumps(
        {"sent_bytes": transport.sent_bytes, "buckets": transport.stats.buckets, "gathers": len(gathers),
         "payload_bytes": transport.stats.payload_bytes, "bytes": transport.stats.bytes}))
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
