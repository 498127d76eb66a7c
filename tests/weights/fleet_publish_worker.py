"""One trainer rank for test_fleet_publish.py's two-rank case (launched by weights_helpers.run_ranks).

    python fleet_publish_worker.py <scenario> <out.json>    (ENGINE_URLS, ENGINE_PIDS, MODEL_PATH)

Each rank hosts a real Trainer actor (FSDP on gloo). Both publish version 1 to two engines; rank 0
kills engine 1 after the first bucket of version 2 (the ranks must agree to publish again to the
survivor); then engine 0 is killed too and version 3 must fail on both ranks. Each rank writes
what it saw to <out.json>.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from miles.actors.trainer import Trainer  # noqa: E402
from miles.backends import TrainConfig  # noqa: E402
from miles.config import Recipe  # noqa: E402
from miles.rl.config import ModelConfig  # noqa: E402
from miles.weights import WeightsConfig  # noqa: E402
from miles.wire.messages import PublishWeights  # noqa: E402


async def main(out: Path) -> None:
    path = os.environ["MODEL_PATH"]
    urls = os.environ["ENGINE_URLS"].split(",")
    pids = [int(p) for p in os.environ["ENGINE_PIDS"].split(",")]
    rank = int(os.environ["RANK"])
    trainer = Trainer(f"trainer/{rank}")
    trainer.recipe = Recipe(
        model=ModelConfig(path=path),
        train=TrainConfig(model_path=path, param_dtype="float32", lr=1e-3, max_tokens_per_microbatch=4096),
        weights=WeightsConfig(transport="nccl", check_weights=True, bucket_bytes=1 << 20,
                              direct_min_bytes=0, connect_timeout_s=30.0, control_timeout_s=5.0,
                              pause_timeout_s=10.0, bucket_timeout_s=30.0, group_timeout_s=30.0))
    await trainer.on_start()
    seen: dict = {}
    try:
        seen["v1"] = (await trainer.on_publish_weights(PublishWeights(version=1, engine_urls=urls))).detail
        buckets = trainer.backend.iter_hf_weight_buckets

        def dying_midway():
            for k, bucket in enumerate(buckets()):
                yield bucket
                if k == 0 and rank == 0:
                    os.kill(pids[1], signal.SIGKILL)
        trainer.backend.iter_hf_weight_buckets = dying_midway
        seen["v2"] = (await trainer.on_publish_weights(PublishWeights(version=2))).detail
        trainer.backend.iter_hf_weight_buckets = buckets
        seen["connected"] = trainer.engine_urls
        if rank == 0:
            os.kill(pids[0], signal.SIGKILL)
        try:
            await trainer.on_publish_weights(PublishWeights(version=3))
            seen["v3"] = "published"
        except RuntimeError as e:
            seen["v3"] = f"failed: {e}"
    finally:
        await trainer.on_stop()
    out.write_text(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[2])))
