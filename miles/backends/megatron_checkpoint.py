"""Megatron checkpoints through megatron-core's `dist_checkpointing` (torch_dist format).

Design decisions:
- The model's own `sharded_state_dict()` names every tensor by its GLOBAL shape and this rank's
  offset in it (TP splits, global layer numbers under PP, expert offsets under EP), so a checkpoint
  saved at one layout loads at another (TP=2 -> TP=1 x DP=2, -> PP=2): dist_checkpointing reads
  each rank's slice from whatever ranks wrote it.
- The optimizer state is sharded like the parameter it belongs to. On CUDA, megatron's optimizer
  builds that itself (`MegatronOptimizer.sharded_state_dict`, distributed optimizer included). On
  a CPU host the optimizer is our torch AdamW over main copies (megatron_step.LocalAdamW), so each
  main param and Adam moment becomes a ShardedTensor with its parameter's sharding under
  `optimizer.<state>.<param key>` (megatron's `make_sharded_optimizer_tensor`); Adam's step count
  is one number per optimizer, kept with the common (rank-0) state. The moments are read and
  restored through the inner optimizer's state_dict / load_state_dict, so with optimizer offload
  (OffloadedAdamW) they go between the checkpoint and host memory or the offload files without
  ever landing on the device, under the same keys: a checkpoint saved with offload "cpu" resumes
  with "nvme" and back, and on a CPU host with "none" too (on CUDA, "none" is megatron's
  optimizer, the other kind below).
- megatron's DistributedOptimizer over torch's Adam (CUDA without TE/apex FusedAdam) cannot load
  into a never-stepped optimizer as shipped (0.16, 0.19): `init_distributed_adam_state` gives it
  Adam's zero state first, and `adam_step_kept_while_loading` lets its parameter-state copy skip
  the `step` it takes from the param groups (tests/backends/test_megatron_checkpoint_distopt.py
  runs that path on gloo).
- A checkpoint written by one optimizer kind is not loaded by the other (their key sets differ);
  the mismatch surfaces as dist_checkpointing's missing-key error, prefixed with our context.
- Everything else of the checkpoint contract is the backend's: trainer_state.json (step,
  `extra_state` for the loop), per-rank RNG files and the COMPLETE marker written last, so an
  interrupted save never reads as complete. A PPO critic saves its own sharded dict under
  `critic/` before that marker (megatron_critic.py), through the same two functions.
- Vocab padding depends on TP (`padded_vocab_size`): layouts whose padded vocab differs cannot
  exchange a checkpoint; dist_checkpointing refuses the shape mismatch naming the tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.backends.base import MAIN_PHASE
from miles.backends.checkpoint import _load_rng, _save_rng

log = logging.getLogger(__name__)

OPTIM_PREFIX = "optimizer"
FORMAT = "miles-megatron-checkpoint/2"
DIST_DIR = "dist"   # dist_checkpointing (torch_dist) of the policy and its optimizer


def save_backend(backend, root: Path, extra_state: dict[str, Any] | None) -> None:
    """The MegatronBackend's checkpoint (collective): policy + optimizer, the critic, RNG, loop state,
    then COMPLETE."""
    r = backend.rank.rank
    if r == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / "COMPLETE").unlink(missing_ok=True)
        shutil.rmtree(root / DIST_DIR, ignore_errors=True)  # dist_checkpointing writes into an empty dir
    dist.barrier()
    save(backend.chunks, backend._optimizers[MAIN_PHASE], root / DIST_DIR)
    if backend.critic is not None:  # before COMPLETE: a checkpoint that reads complete has its critic
        backend.critic.save(root)
    _save_rng(root / "rng", r)
    if r == 0:
        state = {"format": FORMAT, "step": backend.step, "world_size": backend.rank.world_size,
                 "layout": backend._layout(), "extra_state": extra_state or {}}
        (root / "trainer_state.json").write_text(json.dumps(state, indent=2))
    dist.barrier()
    if r == 0:
        (root / "COMPLETE").touch()
    dist.barrier()


def load_backend(backend, root: Path) -> dict[str, Any]:
    """Inverse of `save_backend`, at any layout; returns the loop's extra_state."""
    if not (root / "COMPLETE").exists():
        raise FileNotFoundError(f"checkpoint {str(root)!r} is missing or incomplete (no COMPLETE marker)")
    state = json.loads((root / "trainer_state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(root)!r}: format {state.get('format')!r}, expected {FORMAT!r}")
    load(backend.chunks, backend._optimizers[MAIN_PHASE], root / DIST_DIR)
    if backend.critic is not None:
        backend.critic.load(root)
    backend._steps[MAIN_PHASE] = int(state["step"])
    if (state["world_size"], state["layout"]) == (backend.rank.world_size, backend._layout()):
        _load_rng(root / "rng", backend.rank.rank)   # per-rank streams: only the same ranks continue them
    else:
        log.info("checkpoint %s: saved by %d ranks with layout %s, resumed by %d with %s (resharded; "
                 "RNG streams start fresh)", root, state["world_size"], state["layout"],
                 backend.rank.world_size, backend._layout())
    dist.barrier()
    return dict(state.get("extra_state", {}))


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """{"model": ...} for one chunk, {"model0": ..., "model1": ...} for virtual pipeline chunks."""
    modules = [getattr(c, "module", c) for c in chunks]
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict(prefix="")}
    return {f"model{i}": m.sharded_state_dict(prefix="") for i, m in enumerate(modules)}


def _sharded_params(model_sd: dict[str, Any]) -> dict[int, Any]:
    """id(parameter) -> its ShardedTensor (or factory) in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    return {id(t.data): t for t in nested_values(tensors)}


def _adam_states(opt, *, is_loading: bool) -> list[dict[str, Any]]:
    """LocalAdamW's {exp_avg, exp_avg_sq, step} per main param (in `opt.mains` order).

    Through the inner optimizer's own `state_dict()`, so an OffloadedAdamW hands out its moments
    from host memory or its files (never onto the device). Before the first step: zeros, as
    AdamW starts from. When loading, the moments are only the buffers dist_checkpointing reads
    into: an offloaded optimizer's then are fresh host tensors (not a pointless read of its
    files); a plain AdamW's are its own state tensors, filled in place."""
    from miles.backends.optim_offload import OffloadedAdamW

    inner = opt.optimizer
    offloaded = isinstance(inner, OffloadedAdamW)
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    saved = {} if offloaded and is_loading else inner.state_dict()["state"]
    out = []
    for main in opt.mains:
        state = saved.get(index[id(main)])
        if not state:
            where = dict(device="cpu") if offloaded else dict(device=main.device)
            state = {"exp_avg": torch.zeros(main.shape, dtype=main.dtype, **where),
                     "exp_avg_sq": torch.zeros(main.shape, dtype=main.dtype, **where),
                     "step": torch.zeros(())}
        out.append(state)
    return out


def local_adamw_sharded_state_dict(opt, model_sd: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
    """LocalAdamW's main params and moments, each sharded like its model parameter."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_param = _sharded_params(model_sd)
    out: dict[str, Any] = {"main": {}, "exp_avg": {}, "exp_avg_sq": {}}
    steps = []
    for i, (p, main, state) in enumerate(zip(opt.params, opt.mains, _adam_states(opt, is_loading=is_loading))):
        sharded = by_param.get(id(p))
        if sharded is None:
            raise RuntimeError(f"checkpoint: optimizer parameter {i} of shape {tuple(p.shape)} has no entry in "
                               "the model's sharded_state_dict (a parameter megatron does not checkpoint)")
        out["main"][str(i)] = make_sharded_optimizer_tensor(sharded, main, f"{OPTIM_PREFIX}.main")
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][str(i)] = make_sharded_optimizer_tensor(sharded, state[key], f"{OPTIM_PREFIX}.{key}")
        steps.append(float(state["step"]))
    if len(set(steps)) > 1:
        raise RuntimeError(f"checkpoint: AdamW step counts differ between parameters ({sorted(set(steps))})")
    out["step"] = steps[0] if steps else 0.0
    return out


def restore_local_adamw(opt, loaded: dict[str, Any]) -> None:
    """Main params copied in place; the moments and step count through the inner optimizer's
    `load_state_dict` (an OffloadedAdamW writes them into its store, parameter by parameter)."""
    inner = opt.optimizer
    step = torch.tensor(float(loaded["step"]))
    with torch.no_grad():
        for i, (p, main) in enumerate(zip(opt.params, opt.mains)):
            main.copy_(loaded["main"][str(i)])
            if main is not p:
                p.copy_(main)
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    state = {index[id(main)]: {"step": step.clone(), "exp_avg": loaded["exp_avg"][str(i)],
                               "exp_avg_sq": loaded["exp_avg_sq"][str(i)]}
             for i, main in enumerate(opt.mains)}
    groups, start = [], 0
    for g in inner.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    inner.load_state_dict({"state": state, "param_groups": groups})


# The distributed optimizer's state in model space, so that a change of DP size reshards it too.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _distributed_torch_adams(optimizer) -> list:
    """The parts of a megatron optimizer that are a DistributedOptimizer over torch's Adam/AdamW
    (megatron's fallback when neither TE nor apex provides FusedAdam)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(part, DistributedOptimizer)
            and isinstance(getattr(part, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def init_distributed_adam_state(optimizer) -> None:
    """Give every parameter of a never-stepped torch Adam inside megatron's DistributedOptimizer
    the state Adam starts from: zero moments and step 0.

    Without TE/apex's FusedAdam, `DistributedOptimizer.state_dict()` (megatron-core 0.16 and 0.19)
    reads Adam's step from the per-parameter state and asserts it finds exactly one value, and
    `sharded_state_dict()` calls it, when loading too. A freshly built optimizer has no state yet,
    so loading a checkpoint into it (or saving before the first step) failed there. (With TE's or
    apex's FusedAdam, Megatron-LM's usual optimizer, the step lives in the param groups.) A loaded checkpoint overwrites these values; an unloaded one steps exactly as a fresh Adam."""
    for part in _distributed_torch_adams(optimizer):
        inner = part.optimizer
        for group in inner.param_groups:
            # where torch's Adam keeps `step`: on the parameter's device only if fused or capturable
            step_device = None if (group.get("fused") or group.get("capturable")) else "cpu"
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device or p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def adam_step_kept_while_loading(optimizer) -> Iterator[None]:
    """Let megatron's DistributedOptimizer load its parameter state into torch's Adam.

    Its `load_state_dict` first sets every Adam state's `step` from the checkpoint's param groups,
    then copies the per-parameter tensors in (`_set_main_param_and_optimizer_states`, megatron-core
    0.16 and 0.19) for every tensor in the Adam state, `step` included, from a dict that never has
    `step` (the loaders skip it: it came from the param groups), so it raised KeyError('step').
    Here, for torch-Adam parts only and for the duration of one load, that copy keeps the `step`
    already set: the loaded one."""
    patched = []
    for part in _distributed_torch_adams(optimizer):
        getter = getattr(part, "_get_main_param_and_optimizer_states", None)
        setter = getattr(part, "_set_main_param_and_optimizer_states", None)
        if getter is None or setter is None:
            continue

        def set_states(model_param, tensors, _get=getter, _set=setter):
            current = _get(model_param)
            if "step" in current and "step" not in tensors:
                tensors = {**tensors, "step": current["step"]}
            return _set(model_param, tensors)

        part._set_main_param_and_optimizer_states = set_states   # instance attribute: this object only
        patched.append(part)
    try:
        yield
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states


def sharded_state(chunks: Sequence[torch.nn.Module], opt, *, is_loading: bool = False) -> dict[str, Any]:
    """The whole sharded state of one model + its optimizer."""
    model_sd = model_sharded_state_dict(chunks)
    if hasattr(opt, "mains"):
        return {**model_sd, OPTIM_PREFIX: local_adamw_sharded_state_dict(opt, model_sd, is_loading=is_loading)}
    init_distributed_adam_state(opt.optimizer)
    return {**model_sd, OPTIM_PREFIX: opt.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                       metadata=OPTIM_METADATA)}


def save(chunks: Sequence[torch.nn.Module], opt, directory: str | Path) -> None:
    """Collective over every trainer rank: write `directory` (created; must be empty)."""
    from megatron.core import dist_checkpointing

    from miles.backends.megatron_cpu import cuda_sync_is_noop

    Path(directory).mkdir(parents=True, exist_ok=True)
    with cuda_sync_is_noop():
        dist_checkpointing.save(sharded_state(chunks, opt), str(directory), sharded_strategy=("torch_dist", 1))


def load(chunks: Sequence[torch.nn.Module], opt, directory: str | Path) -> None:
    """Collective: read this rank's slices of `directory` into the model and optimizer, whatever
    layout wrote them."""
    from megatron.core import dist_checkpointing

    if not Path(directory, "metadata.json").exists():
        raise FileNotFoundError(f"checkpoint {str(directory)!r} has no dist_checkpointing metadata.json "
                                "(not a torch_dist checkpoint, or an older per-rank safetensors one)")
    try:
        loaded = dist_checkpointing.load(sharded_state(chunks, opt, is_loading=True), str(directory),
                                         strict="assume_ok_unexpected")
    except Exception as exc:
        raise RuntimeError(f"checkpoint {str(directory)!r}: dist_checkpointing could not load it into this "
                           f"layout: {exc}") from exc
    modules = [getattr(c, "module", c) for c in chunks]
    keys = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    for module, key in zip(modules, keys):
        module.load_state_dict(loaded[key], strict=True)
    if hasattr(opt, "mains"):
        restore_local_adamw(opt, loaded[OPTIM_PREFIX])
    else:
        with adam_step_kept_while_loading(opt.optimizer):
            opt.optimizer.load_state_dict(loaded[OPTIM_PREFIX])
