"""The training-backend contract: what the trainer actor calls, and the factory by name.

The core, six members every backend implements (the trainer calls each of them):

    init(config, rank, loss)            build model, optimizer, parallel layout
    train(samples, phase, index) -> metrics   one batch: log-prob recompute, loss, backward, step(s)
    update_weights(transport, version)  push the current weights through a WeightTransport
    save_model(path, hf=False, ...)     resumable checkpoint, or an HF directory
    load_model(path) -> extra_state     resume from save_model(hf=False)
    step                                optimizer steps of the main phase (a property)

Optional, each with a default that refuses or does nothing, naming the backend:

    quantize_training(quant)            `quant.train` (fp8 / int4 QAT forward), before `init`
    memory_state() / load_memory_state  the in-memory snapshot (`loop.snapshot`)
    close()                             release the process group and device memory

And one protocol, `Offloadable` (`sleep()` / `wake_up()`), which both built-in backends
implement: with `train.sleep_between_steps` the trainer puts its rank to sleep after each publish
and wakes it before its next call, so engines colocated on the same GPUs get the memory while
they generate.

Design decisions:
- Every trainer rank runs the same calls in the same order (the ranks form one torch distributed
  group; most methods are collectives). `train` receives the WHOLE step's batch on every rank and
  the backend picks each rank's share: only the backend knows its parallel layout (data-parallel
  ranks for FSDP; DP x TP x PP for Megatron), so nothing above this line needs to.
- Nothing above this line knows which backend runs: `make_backend(config.backend)` is the only
  place a name turns into a class (`train.backend`'s contract in `miles.plugins`), and it imports
  the backend module lazily (Megatron's imports must not be needed to run FSDP).
- The trainer calls `train(samples, phase, index)` with all three, always: no signature sniffing.
- A `TrainPhase` (name, loss, config) says which objective and schedule a `train` call runs; the
  caller passes it with every call instead of setting attributes on the backend, so no call can
  run with another call's config. `phase=None` is the main phase that `init` was given (named
  "rl"). Each phase name has its OWN optimizer state and step count, hence its own lr schedule
  position: an SFT warm-start neither shifts the RL schedule nor hands its Adam moments to RL.
  `step`, `save_model` and `load_model` cover the main phase; another phase's optimizer state is
  transient (dropped when the main phase next trains) and never checkpointed.
- `RankInfo` comes from torchrun's environment variables; the node daemon sets them when it
  spawns trainer ranks, and tests set them by hand.
- This package never imports `miles.actors`: actors host backends, not the other way round.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from miles import plugins
from miles.algo import LossConfig
from miles.backends.config import TrainConfig
from miles.quant.config import QuantConfig
from miles.weights.base import WeightTransport
from miles.wire.messages import BatchIndex, Sample

Metrics = dict[str, float]


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the trainer group (torchrun's variables)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0           # 0 with world_size 1: an in-process store, no port needed

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RankInfo":
        env = os.environ if env is None else env
        try:
            info = cls(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                       local_rank=int(env.get("LOCAL_RANK", 0)),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", 0)))
        except ValueError as exc:
            raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT must be integers: {exc}") from None
        info.check()
        return info

    def check(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RankInfo: rank={self.rank} world_size={self.world_size}; need "
                             "0 <= rank < world_size")
        if self.world_size > 1 and not 0 < self.master_port < 65536:
            raise ValueError(f"RankInfo: MASTER_PORT={self.master_port} must be set (1-65535) when "
                             f"WORLD_SIZE={self.world_size} > 1")


MAIN_PHASE = "rl"


@dataclass(frozen=True)
class TrainPhase:
    """One training phase: its objective and its optimizer/schedule knobs (lr, warmup, decay, ...).

    The model-defining parts of `config` (model path, dtypes, attention) are the ones `init` was
    given; a phase changes how it trains, not what."""
    name: str
    loss: LossConfig
    config: TrainConfig


class TrainingBackend(ABC):
    """One trainer rank's view of the model. Every rank makes the same calls in the same order."""

    name: str = ""

    @abstractmethod
    def init(self, config: TrainConfig, rank: RankInfo, loss: LossConfig | None = None) -> None:
        """Join the trainer group, load `config.model_path`, shard it, build the optimizer."""

    @abstractmethod
    def train(self, samples: Sequence[Sample], phase: TrainPhase | None = None,
              index: BatchIndex | None = None) -> Metrics:
        """Train on one batch; return step metrics (same on all ranks).

        `index` None: `samples` is the whole batch, on every rank. Set: `samples` is this rank's
        data-parallel share at `index.positions` of the batch the index describes (what the
        driver sends, `miles.loop.shard_batch`); the result is the same as from the whole batch.

        `phase`: which objective, schedule and optimizer state (None: the main phase of `init`).
        Refuses a bad batch with ValueError naming the sample and field, before any optimizer step.
        """

    @abstractmethod
    def update_weights(self, transport: WeightTransport, version: int) -> None:
        """Send the current weights (HF names, full tensors, in buckets) as `version`.

        Every rank: `send_weights(transport, version, buckets)` (miles/weights/base.py), which
        hands them to `transport.send` where `transport.traits.sender`.
        Engines are paused around this call by the publisher, not here.
        """

    @abstractmethod
    def save_model(self, path: str | Path, hf: bool = False,
                   extra_state: dict[str, Any] | None = None) -> None:
        """hf=False: resumable checkpoint (model, optimizer, step, RNG, `extra_state` JSON).
        hf=True: an HF safetensors directory (weights only) loadable by `from_pretrained`."""

    @abstractmethod
    def load_model(self, path: str | Path) -> dict[str, Any]:
        """Resume from a `save_model(hf=False)` directory; returns the saved `extra_state`."""

    @property
    @abstractmethod
    def step(self) -> int:
        """Optimizer steps of the main phase so far (restored by load_model)."""

    def close(self) -> None:
        """Release the process group and device memory (optional)."""

    def quantize_training(self, quant: QuantConfig) -> None:
        """Train the policy's linear layers in `quant.train`'s format (miles/quant/train.py);
        called before `init`. Optional: the default refuses, naming the backend."""
        raise ValueError(f"quant.train = {quant.train!r} is not wired for train.backend = "
                         f"{self.name!r} (only 'fsdp')")

    def memory_state(self, train_call: int, metrics: dict[str, float]) -> tuple[dict, list]:
        """This rank's state as (a msgpack-able table, host arrays) for the in-memory snapshot
        (`loop.snapshot`, miles/wire/snapshot.py). Optional: NotImplementedError (the default)
        leaves a dead rank to the disk checkpoint."""
        raise NotImplementedError(f"train.backend = {self.name!r} takes no in-memory snapshot; "
                                  "set loop.snapshot = false (a dead rank restarts the job from disk)")

    def load_memory_state(self, image) -> None:
        """Put back what `memory_state` gave (a `miles.wire.snapshot.Image`), in place."""
        raise NotImplementedError(f"train.backend = {self.name!r} takes no in-memory snapshot")


@runtime_checkable
class Offloadable(Protocol):
    """A backend whose device memory can be lent out between steps (`train.sleep_between_steps`):
    the trainer calls `sleep` after a publish and `wake_up` before the rank's next call."""

    def sleep(self) -> None:
        """Move parameters, gradients and optimizer state off the device."""

    def wake_up(self) -> None:
        """Bring back what `sleep` moved; training continues exactly where it was."""


def make_backend(name: str) -> TrainingBackend:
    """The backend named by `train.backend` (`miles.plugins` names them), not yet initialized."""
    return plugins.load("train.backend", name)()
