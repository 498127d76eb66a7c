"""dist_checkpointing of megatron's own DistributedOptimizer over torch's Adam (no TE/apex FusedAdam),
the optimizer a CUDA host without Transformer Engine trains with, on 2 gloo ranks (DP=2).

The backend uses megatron's optimizer only on CUDA (megatron_step.MegatronAdam); here it is built
on the CPU anyway, so the load path that failed on the H200 runs in CI. Three CUDA assumptions of
megatron's optimizer are bridged for that, only inside this test's worker and only around the calls
that make them: `param.type()` must read 'torch.cuda.*Tensor' while the optimizer is built, its
overflow buffer is a `device='cuda'` tensor, and the save gathers shards with `.cuda()`.

The worker (this file, run as a script by backend_helpers.run_ranks) saves a stepped optimizer with
known moments and step, then loads the checkpoint into a freshly built model + optimizer (never
stepped: what `load_model` meets on a new backend) and reports whether every main param, moment
and step came back. It also checks that megatron alone cannot load into the fresh optimizer
(its state_dict() asserts one Adam step and finds none), so the test shows the fix is needed.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

if __name__ != "__main__":
    pytest.importorskip("megatron.core")


def test_distributed_optimizer_checkpoint_loads_into_a_fresh_optimizer(tmp_path):
    from backend_helpers import run_ranks

    ranks = run_ranks("distopt", tmp_path, world_size=2, timeout_s=280, worker=Path(__file__))
    for r in ranks:
        assert r["optimizer_kind"] == "DistributedOptimizer/" + r["inner"]
        assert r["fresh_state_dict_asserts"] in (True, None)   # None: TE/apex present, no assert there
        assert r["sharded_params"] > 0 and r["sharded_params"] < r["model_params"]  # DP=2 splits them
        assert r["model_equal"] and r["main_equal"] and r["moments_equal"], r
        assert r["steps"] == [5.0], r
        assert r["fresh_differs"], r   # the fresh model started elsewhere: the load did something


# ---------------------------------------------------------------- worker (run as a script)
@contextlib.contextmanager
def _megatron_optimizer_on_cpu():
    real_type, real_tensor = torch.Tensor.type, torch.tensor

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name if args or kwargs or name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    def tensor(*args, device=None, **kwargs):
        return real_tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.Tensor.type, torch.tensor = cuda_type, tensor
    try:
        yield
    finally:
        torch.Tensor.type, torch.tensor = real_type, real_tensor


@contextlib.contextmanager
def _cuda_is_identity():
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real


class _Opt:   # what megatron_checkpoint expects of an optimizer wrapper (MegatronAdam's .optimizer)
    def __init__(self, optimizer):
        self.optimizer = optimizer


def _build(path, cfg):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from miles.backends.megatron_model import build_gpt_model

    model = build_gpt_model(path, cfg)
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False))
    with _megatron_optimizer_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=False,
                                                     params_dtype=torch.float32, use_distributed_optimizer=True),
                                     [ddp])
    return ddp, opt


def _mains(opt):
    inner = opt.chained_optimizers[0].optimizer
    return inner, [p for g in inner.param_groups for p in g["params"]]


def _distopt(out: Path) -> None:
    import torch.distributed as dist
    from megatron.core.optimizer import distrib_optimizer

    from miles.backends import megatron_checkpoint
    from miles.backends.base import RankInfo
    from miles.backends.config import TrainConfig
    from miles.backends.megatron_model import destroy_parallel, init_parallel
    from miles.tiny import build_tiny_model

    cfg = TrainConfig(backend="megatron", param_dtype="float32")
    rank = RankInfo.from_env()
    init_parallel(cfg, rank)
    path = build_tiny_model(arch="qwen3")
    ckpt = out.parent / "ckpt"
    first, opt = _build(path, cfg)
    inner, mains = _mains(opt)
    megatron_checkpoint.init_distributed_adam_state(opt)   # as after a step: every main param has state
    gen = torch.Generator().manual_seed(100 + rank.rank)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(0.5)          # the main params are views of these fp32 params
        for main in mains:
            state = inner.state[main]
            state["step"].fill_(5.0)
            state["exp_avg"].copy_(torch.randn(main.shape, generator=gen))
            state["exp_avg_sq"].copy_(torch.rand(main.shape, generator=gen))
    if rank.rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with _cuda_is_identity():
        megatron_checkpoint.save([first], _Opt(opt), ckpt)

    second, fresh = _build(path, cfg)
    inner2, mains2 = _mains(fresh)
    asserts = None
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        try:
            fresh.chained_optimizers[0].state_dict()
            asserts = False
        except AssertionError:
            asserts = True
    fresh_differs = any(not torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    megatron_checkpoint.load([second], _Opt(fresh), ckpt)
    result = {
        "optimizer_kind": f"{type(fresh.chained_optimizers[0]).__name__}/{type(inner2).__name__}",
        "inner": type(inner2).__name__,
        "fresh_state_dict_asserts": asserts,
        "model_params": sum(p.numel() for p in second.parameters()),
        "sharded_params": sum(m.numel() for m in mains2),
        "model_equal": all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters())),
        "main_equal": all(torch.equal(a, b) for a, b in zip(mains, mains2)),
        "moments_equal": all(torch.equal(inner.state[a][k], inner2.state[b][k])
                             for a, b in zip(mains, mains2) for k in ("exp_avg", "exp_avg_sq")),
        "steps": sorted({float(inner2.state[m]["step"]) for m in mains2}),
        "fresh_differs": fresh_differs,
    }
    out.write_text(json.dumps(result))
    destroy_parallel()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.set_num_threads(1)
    if sys.argv[1] != "distopt":
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
    _distopt(Path(sys.argv[2]))
