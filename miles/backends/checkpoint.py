"""Resumable training checkpoints: sharded model + optimizer (torch DCP), step, RNG, caller's state.

Layout of a checkpoint directory:
    dcp/                  torch.distributed.checkpoint: every rank writes its own shards
    trainer_state.json    optimizer step, world size, and the caller's `extra_state` (data position)
    rng/rank{r}.json      python / numpy RNG of rank r
    rng/rank{r}.safetensors   torch CPU (and CUDA) RNG of rank r
    COMPLETE              written last by rank 0, after a barrier: a directory without it is refused

Design decisions:
- DCP, not full state dicts: no rank ever holds the whole model or optimizer, and a checkpoint can
  be loaded under a different world size (DCP reshards on load). RNG states stay per rank.
- The learning-rate schedule is a function of the step (optim.py), so the step is all it needs.
- `extra_state` must be JSON (the data position, the rollout id): a checkpoint stays readable
  without unpickling anything of ours. (DCP's own metadata file is torch's format; it is local disk.)
- Paths are shared by all ranks: multi-node runs need a shared filesystem for checkpoints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT = "miles-train-checkpoint/1"


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    step: int, extra_state: dict[str, Any] | None = None) -> None:
    """Collective: every rank calls it with the same path."""
    root = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / "COMPLETE").unlink(missing_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))
    _save_rng(root / "rng", rank)
    if rank == 0:
        state = {"format": FORMAT, "step": step, "world_size": world, "extra_state": extra_state or {}}
        (root / "trainer_state.json").write_text(json.dumps(state, indent=2))
    dist.barrier()
    if rank == 0:
        (root / "COMPLETE").touch()
    dist.barrier()


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective. Restores model and optimizer in place; returns trainer_state.json as a dict."""
    root = Path(path)
    if not (root / "COMPLETE").exists():
        raise FileNotFoundError(f"checkpoint {str(root)!r} is missing or incomplete (no COMPLETE marker)")
    state = json.loads((root / "trainer_state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(root)!r}: format {state.get('format')!r}, expected {FORMAT!r}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(root / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    rank = dist.get_rank()
    if state["world_size"] == dist.get_world_size():
        _load_rng(root / "rng", rank)  # RNG streams are per rank: only meaningful at the same size
    return state


def _save_rng(folder: Path, rank: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(folder / f"rank{rank}.safetensors"))
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    (folder / f"rank{rank}.json").write_text(json.dumps({
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }))


def _load_rng(folder: Path, rank: int) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / f"rank{rank}.safetensors"))
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    saved = json.loads((folder / f"rank{rank}.json").read_text())
    version, py_state, gauss = saved["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
