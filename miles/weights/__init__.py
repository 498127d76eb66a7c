"""Weights out of the trainer into the engines: transports (nccl, colocated, disk, disk_delta) and
the publisher that runs them between a pause and a resume. See README.md in this directory.

Names are imported lazily so that `miles.weights.<module>` stays cheap to import (the embedded
engine uses the CUDA IPC codec and the delta format).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "WeightTransport": "miles.weights.base",
    "TransferStats": "miles.weights.base",
    "TransportTraits": "miles.weights.base",
    "send_weights": "miles.weights.base",
    "WeightsConfig": "miles.weights.config",
    "make_transport": "miles.weights.factory",
    "WeightPublisher": "miles.weights.publisher",
    "WeightPublishError": "miles.weights.publisher",
    "PublishReport": "miles.weights.publisher",
    "WeightsMismatch": "miles.weights.checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'miles.weights' has no attribute {name!r}")
