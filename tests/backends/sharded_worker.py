"""One trainer rank of the sharded-batch tests (launched by backend_helpers.run_ranks).

    python sharded_worker.py fsdp:<arch> <out.json>
    python sharded_worker.py megatron:<arch>:<tp>,<pp>,<ep> <out.json>

Trains the same batch twice from the same weights: once with the whole batch on every rank
(`TrainStep.index` None) and once with `miles.loop.shard_batch`'s shard for this rank (after a
wire round trip through `miles.wire.codec`, as the driver sends it). Writes both paths' metrics
and the largest difference of the updated weights; then the door checks of a sharded step: a bad
sample and a sample that contradicts the index on rank 1's shard refuse on every rank, weights
untouched; with model-parallel peers (one DP index, two ranks), peers holding different copies of
their shard refuse too. The pytest side (test_sharded_batch.py) asserts on what is written.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.config import MegatronConfig, trainer_dp_layout  # noqa: E402
from miles.loop import shard_batch  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402
from miles.wire.codec import Codec  # noqa: E402

TIMING = ("step_s", "tokens_per_s")


def full_weights(backend) -> dict[str, torch.Tensor]:
    """Every weight under its HF name, full tensors (collective: every rank iterates)."""
    return {n: t.detach().double().cpu().clone() for bucket in backend.iter_hf_weight_buckets() for n, t in bucket}


def checksum(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(t.sum() for t in weights.values()))


def wire(step):
    """The TrainStep as a trainer rank decodes it (raw array frames, no pickle)."""
    codec = Codec()
    frames = [bytes(memoryview(f)) for f in codec.encode("call", step)]
    return codec.decode(frames)[1]


def scenario(kind: str, arch: str, sizes: str, out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    base = dict(model_path=path, param_dtype="float32", lr=1e-3, max_tokens_per_microbatch=64,
                steps_per_train=2)
    if kind == "megatron":
        tp, pp, ep = (int(x) for x in sizes.split(","))
        base.update(backend="megatron", megatron=MegatronConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=False))
    cfg = TrainConfig(**base)
    loss = LossConfig(advantage_estimator="grpo", loss_reduction="rollout")
    batches = {"groups4": make_samples(groups=4, per_group=4, siblings=2, seed=3),
               # one group for two DP ranks: rank 1's shard is empty (it runs dummies only)
               "one_group": make_samples(groups=1, per_group=3, seed=8)}
    result: dict = {"rank": rank.rank, "parity": {}}
    for name, samples in batches.items():
        step_cfg = cfg if name == "groups4" else msgspec.structs.replace(cfg, steps_per_train=1)
        mine = wire(shard_batch(samples, step_cfg, rank.world_size)[rank.rank])
        runs = {}
        for path_name, (batch, index) in {"whole": (samples, None), "sharded": (mine.samples, mine.index)}.items():
            backend = make_backend(kind)
            backend.init(step_cfg, rank, loss)
            metrics = [backend.train(batch, index=index) for _ in range(2)]
            runs[path_name] = ([{k: v for k, v in m.items() if k not in TIMING} for m in metrics],
                               full_weights(backend))
            if path_name == "sharded" and name == "groups4":
                result["refusals"] = refusals(backend, mine, rank.rank)
        (m_whole, w_whole), (m_shard, w_shard) = runs["whole"], runs["sharded"]
        result["parity"][name] = {
            "shard_size": len(mine.samples), "positions": mine.index.positions.tolist(),
            "metrics_whole": m_whole, "metrics_sharded": m_shard,
            "weights_max_abs_diff": max(float((w_whole[n] - w_shard[n]).abs().max()) for n in w_whole),
            "weights_moved": max(float(t.abs().sum()) for t in w_whole.values()) > 0,
            "same_names": sorted(w_whole) == sorted(w_shard)}
    dist.barrier()
    out.write_text(json.dumps(result))


def refusals(backend, mine, rank: int) -> dict:
    """Rank 1 holds a bad sample (NaN reward), then one whose length contradicts the index;
    every rank must refuse each together and no weight may move."""
    got = {}
    before = checksum(full_weights(backend))
    bad_reward = list(mine.samples)
    if rank == 1:
        bad_reward[0] = msgspec.structs.replace(bad_reward[0], reward=math.nan)
    short = list(mine.samples)
    if rank == 1:
        s = short[0]
        short[0] = msgspec.structs.replace(s, tokens=np.concatenate([s.tokens[:1], s.tokens]))
    for name, batch in (("nan_reward", bad_reward), ("length", short)):
        try:
            backend.train(batch, index=mine.index)
            got[name] = None
        except ValueError as exc:
            got[name] = str(exc)
    got["weights_unchanged"] = checksum(full_weights(backend)) == before
    dp_size, _ = trainer_dp_layout(backend.cfg, dist.get_world_size())
    if dp_size < dist.get_world_size():  # model-parallel peers: rank 1's copy of the shard differs
        other = list(mine.samples)
        if rank == 1:
            tokens = other[0].tokens.copy()
            tokens[0] = (tokens[0] + 1) % backend.vocab_size   # still a valid sample
            other[0] = msgspec.structs.replace(other[0], tokens=tokens)
        try:
            backend.train(other, index=mine.index)
            got["peer_shard"] = None
        except ValueError as exc:
            got["peer_shard"] = str(exc)
    got["first_position"] = int(mine.index.positions[0]) if len(mine.index.positions) else -1
    return got


if __name__ == "__main__":
    spec, out_path = sys.argv[1], Path(sys.argv[2])
    parts = spec.split(":")
    scenario(parts[0], parts[1], parts[2] if len(parts) > 2 else "", out_path)
