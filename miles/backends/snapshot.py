"""A training backend's state as named host arrays, for the in-memory snapshot
(`loop.snapshot`; the double-buffered file is miles/wire/snapshot.py, the heal miles/rl/heal.py).

Design decisions:
- Each rank copies its own local shards (FSDP2 DTensors' `to_local()`), every phase's AdamW
  state, the step counters and the torch / numpy / python RNGs; a fresh backend of the same
  shape gets them back in place (`restore`), DTensors rebuilt on the parameters' mesh.
- Raw bytes and a msgpack table, no pickle: the same rule as the wire.
- What it does not cover says so in one line (`check_supported`): Megatron, the PPO critic, an
  offloaded optimizer; the heal then falls back to the disk checkpoint.
"""

from __future__ import annotations

import random

import numpy as np

from miles.wire.snapshot import FORMAT, Image

# ----- a backend's state as named tensors (FSDP2: every rank's local shards) ----------------------

def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def capture(backend, train_call: int, metrics: dict[str, float]) -> tuple[dict, list[np.ndarray]]:
    """The backend's state after train call `train_call` (the driver's count), as a meta table and
    host arrays: parameters, every phase's optimizer state, step counters, RNGs, the call's metrics."""
    import torch

    check_supported(backend)
    names = {id(p): n for n, p in backend.policy.named_parameters()}
    entries, arrays = [], []

    def add(name: str, t) -> None:
        t = _local(t).detach()
        host = t.to("cpu") if t.device.type != "cpu" else t
        entries.append([name, str(host.dtype).removeprefix("torch."), list(host.shape)])
        arrays.append(host.contiguous().reshape(-1).view(torch.uint8).numpy())

    for name, p in backend.policy.named_parameters():
        add(f"param/{name}", p)
    scalars = {}
    for phase, opt in backend._optimizers.items():
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(f"optim/{phase}/{names[id(p)]}/{key}", value)
                else:
                    scalars[f"optim/{phase}/{names[id(p)]}/{key}"] = value
    rng = {"torch_cpu": torch.get_rng_state().numpy().tobytes(), "python": _py_state(),
           "numpy": _np_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    meta = {"format": FORMAT, "train_call": train_call, "metrics": metrics,
            "steps": dict(backend._steps), "phases": list(backend._optimizers),
            "rank": backend.rank.rank, "world_size": backend.rank.world_size,
            "tensors": entries, "scalars": scalars, "rng": rng}
    return meta, arrays


def restore(backend, image: Image) -> None:
    """Put `image` back into a freshly initialised backend of the same shape, in place."""
    import torch
    from torch.distributed.tensor import DTensor

    from miles.backends.optim import build_adamw

    check_supported(backend)
    meta = image.meta
    if (meta["rank"], meta["world_size"]) != (backend.rank.rank, backend.rank.world_size):
        raise ValueError(f"snapshot of rank {meta['rank']}/{meta['world_size']} given to rank "
                         f"{backend.rank.rank}/{backend.rank.world_size}")
    params = dict(backend.policy.named_parameters())
    tensors = {}
    for (name, dtype, shape), off in zip(meta["tensors"], meta["offsets"]):
        dt = getattr(torch, dtype)
        n = int(np.prod(shape)) if shape else 1
        nbytes = n * torch.empty((), dtype=dt).element_size()
        raw = torch.frombuffer(image.data, dtype=torch.uint8, count=nbytes, offset=off) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dt).reshape(shape)
    with torch.no_grad():
        for name, p in params.items():
            _local(p).copy_(tensors[f"param/{name}"])
        for phase in meta["phases"]:
            if phase not in backend._optimizers:  # the warm start's: lr is set at every step
                backend._optimizers[phase] = build_adamw(backend.policy, backend.cfg, backend.device)
            opt = backend._optimizers[phase]
            opt.state.clear()
            prefix = f"optim/{phase}/"
            for full, value in [*tensors.items(), *meta["scalars"].items()]:
                if not full.startswith(prefix):
                    continue
                pname, key = full[len(prefix):].rsplit("/", 1)
                p = params[pname]
                if isinstance(value, torch.Tensor):
                    local = _local(p)
                    value = value.to(local.device).clone()
                    if isinstance(p, DTensor) and tuple(value.shape) == tuple(local.shape):
                        value = DTensor.from_local(value, p.device_mesh, p.placements,
                                                   shape=p.shape, stride=p.stride())
                opt.state[p][key] = value
    backend._steps = {k: int(v) for k, v in meta["steps"].items()}
    rng = meta["rng"]
    torch.set_rng_state(torch.frombuffer(bytearray(rng["torch_cpu"]), dtype=torch.uint8))
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(rng["torch_cuda"]), dtype=torch.uint8))
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def check_supported(backend) -> None:
    """What the snapshot knows how to copy: the FSDP backend with a plain AdamW and no critic."""
    import torch

    if getattr(backend, "name", "") != "fsdp":
        raise NotImplementedError(f"in-memory snapshots cover train.backend = 'fsdp', not "
                                  f"{getattr(backend, 'name', type(backend).__name__)!r}; "
                                  "set loop.snapshot = false (a dead rank restarts the job from disk)")
    if backend.critic is not None:
        raise NotImplementedError("in-memory snapshots do not cover the PPO critic yet; set "
                                  "loop.snapshot = false (a dead rank restarts the job from disk)")
    for opt in backend._optimizers.values():
        if type(opt) is not torch.optim.AdamW:
            raise NotImplementedError(f"in-memory snapshots cover torch.optim.AdamW, not "
                                      f"{type(opt).__name__} (train.optimizer_offload); set "
                                      "loop.snapshot = false")


def _py_state() -> list:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def _np_state() -> list:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
