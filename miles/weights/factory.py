"""make_transport: the one place a `weights.transport` name becomes a transport object.

Design decisions:
- Transports are imported lazily: the CUDA IPC or delta code is not loaded by a run that uses
  NCCL, and `miles.weights` stays cheap to import (the embedded engine imports parts of it).
- The trainer rank decides who sends: trainer rank 0 for nccl, disk and disk_delta (the others
  still gather, collectively, and drop the tensors); every rank for colocated (each feeds the
  engine on its own GPU).
- With `check_weights` the sender's transport is wrapped in a ChecksumTap, which records the
  sha256 of every tensor it sends for the publisher to compare with the engines'.
"""

from __future__ import annotations

from typing import Any

from miles.weights.base import WeightTransport
from miles.weights.config import WeightsConfig


def make_transport(config: WeightsConfig, *, rank: Any = 0, world_size: int | None = None,
                   model_path: str | None = None, recipe: Any = None) -> WeightTransport:
    """The transport `config.transport` names, for trainer rank `rank` (an int or a RankInfo).

    `model_path` (or `recipe.train.model_path`) is the model's HF directory; the disk transport
    copies its config.json and tokenizer files next to every exported version.
    """
    r = int(getattr(rank, "rank", rank))
    world = int(world_size if world_size is not None else getattr(rank, "world_size", 1))
    if model_path is None and recipe is not None:
        model_path = getattr(getattr(recipe, "train", None), "model_path", None) or None
    name = config.transport
    if name == "nccl":
        from miles.weights.nccl import NcclTransport
        transport: WeightTransport = NcclTransport(config, is_sender=r == 0)
    elif name == "colocated":
        from miles.weights.colocated import ColocatedTransport
        transport = ColocatedTransport(config, rank=r, world_size=world)
    elif name == "disk":
        from miles.weights.disk import DiskTransport
        transport = DiskTransport(config, source_dir=model_path, is_sender=r == 0)
    elif name == "disk_delta":
        from miles.weights.disk_delta import DiskDeltaTransport
        transport = DiskDeltaTransport(config, is_sender=r == 0)
    else:
        raise ValueError(f"weights.transport={name!r} is not one of nccl, colocated, disk, disk_delta")
    if config.check_weights and transport.is_sender:
        from miles.weights.checks import ChecksumTap
        transport = ChecksumTap(transport, config.checksum)
    return transport
