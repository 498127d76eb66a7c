"""Joining the trainer process group and choosing the device: NCCL on GPUs, gloo on CPU.

Design decisions:
- The group is set up from `RankInfo` explicitly (a TCP store at MASTER_ADDR:MASTER_PORT), not from
  `env://`, so the caller's RankInfo is the one source of truth.
- World size 1 uses an in-process HashStore: a single-process run (a benchmark, a laptop) needs no
  port at all.
- An already initialized default group is reused if it matches, so a test process or a host that
  set up torch.distributed itself can host a backend (and several backends one after another).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from miles.backends.base import RankInfo


def pick_device(rank: RankInfo) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", rank.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(rank: RankInfo, device: torch.device, timeout_s: float = 1800.0) -> None:
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank.rank, rank.world_size):
            raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but RankInfo says {rank.rank} of {rank.world_size}")
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if rank.world_size == 1:
        store = dist.HashStore()
    else:
        store = dist.TCPStore(rank.master_addr, rank.master_port, rank.world_size,
                              is_master=rank.rank == 0, timeout=timeout)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank.rank, world_size=rank.world_size,
                            timeout=timeout, **kwargs)
