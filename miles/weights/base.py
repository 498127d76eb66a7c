"""The weight-transport contract: how a trainer hands new weights to rollout engines.

A transport moves named tensors (HF checkpoint names, full unsharded tensors) in buckets. The
training backend drives it from `update_weights`: every trainer rank takes part in gathering the
shards, and the ranks for which `is_sender` is true call `send_bucket`. The WeightPublisher owns
the engine session around it (pause -> begin -> buckets -> version -> continue).

The methods are synchronous because they run on trainer ranks next to blocking torch code; a
transport that must talk HTTP to engines while a collective is in flight uses its own thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class WeightTransport(ABC):
    is_sender: bool = True

    @abstractmethod
    def connect(self, engine_urls: list[str]) -> None:
        """Set up whatever links the engines (a process group, a directory); once per run."""

    @abstractmethod
    def begin(self, version: int) -> None:
        """Start publishing `version`; engines are already paused by the publisher."""

    @abstractmethod
    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Move one bucket of full tensors (HF names) to every engine."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """Complete `version` on every engine (the engines then report it)."""
