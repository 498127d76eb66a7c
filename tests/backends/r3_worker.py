"""One trainer rank of the 2-process R3 test: trains its own shard of a routed batch
(`miles.loop.shard_batch`, exactly what the driver sends) and writes what it saw to <out.json>.

    python r3_worker.py <model_dir> <out.json>
"""

from __future__ import annotations

import json
import sys

import msgspec
import torch

torch.set_num_threads(1)

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.loop import shard_batch  # noqa: E402
from test_r3_wire import routed_batch  # noqa: E402


def main(model: str, out: str) -> None:
    rank = RankInfo.from_env()
    cfg = TrainConfig(model_path=model, param_dtype="float32", lr=1e-3, router_replay=True,
                      old_logprobs="recompute", max_tokens_per_microbatch=64)
    backend = make_backend("fsdp")
    backend.init(cfg, rank, LossConfig())
    samples = routed_batch(backend.vocab_size)
    mine = shard_batch(samples, cfg, rank.world_size)[rank.rank]
    positions = mine.index.positions.tolist()
    result = {"with_routing": [i for i, s in zip(positions, mine.samples) if s.routed_experts is not None]}
    result["metrics"] = backend.train(mine.samples, index=mine.index)
    # Rank 1 loses the routing of one sample it trains: every rank must refuse, none may hang.
    broken = list(mine.samples)
    if rank.rank == 1:
        broken[0] = msgspec.structs.replace(broken[0], routed_experts=None)
    try:
        backend.train(broken, index=mine.index)
        result["refusal"] = None
    except ValueError as e:
        result["refusal"] = str(e)
    backend.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
