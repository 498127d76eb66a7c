"""make_transport: the one place a `weights.transport` name becomes a transport object.

Design decisions:
- Transports are imported lazily, by the class `miles.plugins` names for `weights.transport`: the CUDA IPC or delta code is not loaded by a run that uses
  NCCL, and `miles.weights` stays cheap to import (the embedded engine imports parts of it).
- The trainer rank decides who sends: trainer rank 0 for nccl, disk and disk_delta (the others
  still gather, collectively, and drop the tensors); every rank for colocated (each feeds the
  engine on its own GPU) and for p2p (each sends the rows it holds to the engine ranks that need
  them).
- With `quant.rollout` set the transport is wrapped in a QuantizingTransport (miles/quant), which
  sends each bucket in that format; the checksum tap then checks the dequantized values.
- With `check_weights` the sender's transport is wrapped in a ChecksumTap, which records the
  sha256 of every tensor it sends for the publisher to compare with the engines'.
"""

from __future__ import annotations

from typing import Any

from miles import plugins
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
    cls = plugins.load("weights.transport", name)  # the class its name is registered to
    if name == "colocated":
        transport: WeightTransport = cls(config, rank=r, world_size=world)
    elif name == "disk":
        transport = cls(config, source_dir=model_path, is_sender=r == 0)
    elif name == "p2p":
        transport = cls.for_engines(config, rank=r, world_size=world)
    else:  # nccl, disk_delta
        transport = cls(config, is_sender=r == 0)
    quant = getattr(recipe, "quant", None)
    if name == "p2p" and quant is not None and quant.format is not None:
        raise ValueError(f"weights.transport='p2p' with quant.format={quant.format!r}: quantized "
                         "updates are not wired for the P2P transfer (its plan cuts the tensors "
                         "the engine holds); use weights.transport='nccl'")
    if quant is not None and quant.format is not None:  # miles/quant/export.py
        from miles.quant.export import QuantizingTransport
        from miles.quant.keep import KeepList
        # float8 goes over a process group as its bytes: gloo has no float8 type, and bytes
        # are what NCCL moves anyway (the engine reinterprets them; it knows its format)
        raw_fp8 = name == "nccl"
        transport = QuantizingTransport(transport, quant.format, KeepList(quant.keep_bf16),
                                        group_size=quant.int4_group_size, raw_fp8=raw_fp8)
    if config.check_weights and transport.traits.sender:
        from miles.weights.checks import ChecksumTap
        from miles.quant.export import QuantizingTransport
        view = transport.engine_view if isinstance(transport, QuantizingTransport) else None
        transport = ChecksumTap(transport, config.checksum, engine_view=view)
    return transport
