"""One trainer rank of the Megatron resharding-checkpoint tests (launched by backend_helpers.run_ranks).

    python megatron_ckpt_worker.py reshard:<arch>:<tp>,<pp>-><tp>,<pp> <out.json>

On 2 gloo ranks: train one SFT step at the first layout, save (dist_checkpointing, torch_dist),
train the next step on the same batch (the uninterrupted run's loss and grad norm); then build
the second layout in the same process group, load, and train that step again: the pytest side
compares the two. Also: the loop's extra_state and step come back, and an incomplete checkpoint
is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig  # noqa: E402
from miles.backends.config import MegatronConfig  # noqa: E402
from miles.backends.megatron import MegatronBackend  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402


def config(path: str, tp: int, pp: int) -> TrainConfig:
    return TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=3e-3, warmup_steps=1,
                       lr_decay_style="cosine", lr_decay_steps=10, min_lr=1e-4, weight_decay=0.01,
                       max_tokens_per_microbatch=128,
                       megatron=MegatronConfig(tp=tp, pp=pp, sequence_parallel=False))


def reshard(arch: str, before: tuple[int, int], after: tuple[int, int], out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    # SFT: its loss is the NLL itself, so it tells weights apart (a GRPO loss on-policy is ~-mean(A))
    loss = LossConfig(loss_type="sft", loss_reduction="token")
    batch = make_samples(groups=2, per_group=4, seed=3)
    ckpt = out.parent / "ckpt"
    result: dict = {"rank": rank.rank}

    first = MegatronBackend()
    first.init(config(path, *before), rank, loss)
    result["step1"] = first.train(batch)["loss"]
    first.save_model(ckpt, extra_state={"data_position": 5})
    nxt = first.train(batch)
    result["uninterrupted"] = {"loss": nxt["loss"], "grad_norm": nxt["grad_norm"]}
    result["uninterrupted_step3"] = first.train(batch)["loss"]
    first.chunks = None
    first._optimizers.clear()

    second = MegatronBackend()
    second.init(config(path, *after), rank, loss)   # new megatron groups, same process group
    fresh = second.train(batch)["loss"]             # a fresh model's step-1 loss, for contrast
    extra = second.load_model(ckpt)
    assert extra == {"data_position": 5} and second.step == 1, (extra, second.step)
    resumed = second.train(batch)
    result["resumed"] = {"loss": resumed["loss"], "grad_norm": resumed["grad_norm"]}
    result["resumed_step3"] = second.train(batch)["loss"]
    result["fresh_second_step"] = fresh

    if rank.rank == 0:
        (ckpt / "COMPLETE").unlink()
    dist.barrier()
    try:
        second.load_model(ckpt)
        raise AssertionError("an incomplete checkpoint was loaded")
    except FileNotFoundError as exc:
        result["incomplete_error"] = str(exc)
    dist.barrier()
    out.write_text(json.dumps(result))
    second.close()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    kind, arch, spec = scenario.split(":")
    a, b = spec.split("->")
    parse = lambda s: tuple(int(x) for x in s.split(","))
    assert kind == "reshard", scenario
    reshard(arch, parse(a), parse(b), out)


if __name__ == "__main__":
    main()
