"""WeightsConfig: how new weights reach the engines, as one msgspec Struct with its defaults here.

Design decisions:
- The recipe picks the path with one key, `transport` (nccl | colocated | disk | disk_delta |
  p2p: every trainer rank sends each embedded-engine TP rank only its slices, miles/weights/p2p.py);
  every other key has a default that suits it, and keys of other transports are simply unused.
- Every engine-facing step has its own timeout, because each fails differently: a pause that
  hangs means a wedged engine, a bucket that hangs means a broken group, a slow prepare means a
  slow disk. Nothing waits forever; the defaults are generous, tests set them short.
- `pause_mode` is `in_place` or `retract` only: `abort` throws in-flight work away, which Miles
  never does for a weight update (MISSION, capability 2).
- msgspec only type-checks on decode, so `__post_init__` re-checks ranges and choices: a config
  built in Python fails as clearly as one decoded from TOML, naming the key and the bad value.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

TransportName = Literal["nccl", "colocated", "disk", "disk_delta", "p2p"]
PauseMode = Literal["in_place", "retract"]
GroupBackend = Literal["auto", "nccl", "gloo"]
DeltaCodec = Literal["zlib", "lzma", "zstd"]
ChecksumName = Literal["auto", "device", "sha256"]

TRANSPORTS: tuple[str, ...] = TransportName.__args__  # type: ignore[attr-defined]
PAUSE_MODES: tuple[str, ...] = PauseMode.__args__  # type: ignore[attr-defined]
GROUP_BACKENDS: tuple[str, ...] = GroupBackend.__args__  # type: ignore[attr-defined]
DELTA_CODECS: tuple[str, ...] = DeltaCodec.__args__  # type: ignore[attr-defined]
CHECKSUM_NAMES: tuple[str, ...] = ChecksumName.__args__  # type: ignore[attr-defined]


class WeightsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `[weights]` section of a recipe."""

    # how weights reach the engines: nccl broadcast, colocated CUDA IPC, disk, disk_delta, p2p
    transport: TransportName = "nccl"
    bucket_bytes: int = 1 << 30          # tensors coalesced per engine call / broadcast
    # in_place: in-flight requests pause and continue on the new weights; retract: they are re-prefilled
    pause_mode: PauseMode = "in_place"
    check_weights: bool = False          # compare every engine parameter's checksum after a publish
    checksum: ChecksumName = "auto"      # auto: device when the trainer's tensors are on a GPU

    # --- timeouts (seconds) ---
    connect_timeout_s: float = 120.0     # engines join the weight-update group / answer model_info
    pause_timeout_s: float = 60.0        # /pause_generation on every engine
    transfer_timeout_s: float = 1800.0   # the whole run_update (gather + every bucket)
    bucket_timeout_s: float = 300.0      # one bucket's engine call (and a send-queue slot)
    control_timeout_s: float = 60.0      # /update_weight_version, /continue_generation
    prepare_timeout_s: float = 1800.0    # disk_delta: engines decode and verify the delta
    commit_timeout_s: float = 600.0      # disk / disk_delta: engines load or swap the new weights
    check_timeout_s: float = 600.0       # /weights_checksum

    # --- nccl: one process group of trainer rank 0 and every engine rank (p2p: of every trainer
    #     rank and every engine rank; the same address, port, backend and timeouts) ---
    master_address: str = "127.0.0.1"    # the trainer's address as the engines reach it
    master_port: int = 0                 # 0: pick a free port
    # the torch.distributed group name the engines join
    group_name: str = "miles_weights"
    group_backend: GroupBackend = "auto"  # auto: nccl when the trainer has CUDA, else gloo
    group_timeout_s: float = 600.0       # torch-side timeout of each collective in the group
    queue_depth: int = 2                 # buckets gathered ahead of the one on the wire
    inflight_buckets: int = 3            # buckets on the wire at once (embedded engines; SGLang: 1)
    direct_min_bytes: int = 8 << 20      # embedded engines: tensors this large go zero-copy, each
    #   straight into the engine's parameter (0: all flattened). Smaller ones cost more as NCCL ops
    #   of their own than their copies do (H200, 7B: 1 MiB 0.061 s, 8 MiB 0.054 s, flat 0.062 s)
    colocated_direct: bool = True        # colocated: write into the engine's own weights (CUDA IPC
    #   views it shares once), one device copy per byte; false: flat buckets the engine copies out
    colocated_batch_below_bytes: int = 1 << 20  # colocated direct writes: tensors smaller than this
    #   (norms, biases) go in one _foreach_copy_ per write, the rest a copy_ each (0: all a copy_
    #   each); the trainer's CPU issuing 339 copies one by one was the 7B publish's bound

    # --- disk / disk_delta ---
    disk_dir: str = ""                   # where versions are written (shared with the engines)
    keep_versions: int = 2               # older version directories are deleted
    delta_codec: DeltaCodec = "zlib"     # zstd needs the `zstandard` package
    # zlib level of disk_delta's payload
    delta_level: int = 1
    delta_chunk_bytes: int = 64 << 20    # compressed independently (parallel, bounded memory)
    # threads that encode and decode disk_delta chunks
    delta_threads: int = 4
    # disk_delta: a fleet transaction. Each engine keeps the version it replaces for one version
    # (host memory: one more copy of the changed tensors, copied while it prepares, off the
    # swap's lock), so a commit that fails on some engines is rolled back on the others: all
    # engines switch to v, or all stay on v-1 (docs/provenance.md). false: no copy kept, and a
    # partial commit leaves the fleet mixed until the next publish (written raw)
    rollback: bool = True

    def __post_init__(self) -> None:
        _choice("transport", self.transport, TRANSPORTS)
        _choice("pause_mode", self.pause_mode, PAUSE_MODES)
        _choice("group_backend", self.group_backend, GROUP_BACKENDS)
        _choice("delta_codec", self.delta_codec, DELTA_CODECS)
        _choice("checksum", self.checksum, CHECKSUM_NAMES)
        _count("bucket_bytes", self.bucket_bytes, low=1)
        _count("queue_depth", self.queue_depth, low=1)
        _count("inflight_buckets", self.inflight_buckets, low=1)
        _count("direct_min_bytes", self.direct_min_bytes, low=0)
        _count("colocated_batch_below_bytes", self.colocated_batch_below_bytes, low=0)
        _count("keep_versions", self.keep_versions, low=1)
        _count("delta_chunk_bytes", self.delta_chunk_bytes, low=1)
        _count("delta_threads", self.delta_threads, low=1)
        _count("master_port", self.master_port, low=0)
        if self.master_port > 65535:
            raise ValueError(f"weights.master_port={self.master_port!r} must be <= 65535")
        for name in ("connect_timeout_s", "pause_timeout_s", "transfer_timeout_s", "bucket_timeout_s",
                     "control_timeout_s", "prepare_timeout_s", "commit_timeout_s", "check_timeout_s",
                     "group_timeout_s"):
            _positive(name, getattr(self, name))
        if not self.master_address:
            raise ValueError("weights.master_address is empty; it must be the trainer's address")
        if not self.group_name:
            raise ValueError("weights.group_name is empty")
        levels = {"zlib": (0, 9), "lzma": (0, 9), "zstd": (1, 22)}[self.delta_codec]
        if isinstance(self.delta_level, bool) or not isinstance(self.delta_level, int) or \
                not levels[0] <= self.delta_level <= levels[1]:
            raise ValueError(f"weights.delta_level={self.delta_level!r} must be an integer in "
                             f"[{levels[0]}, {levels[1]}] for delta_codec={self.delta_codec!r}")
        if self.transport in ("disk", "disk_delta") and not self.disk_dir:
            raise ValueError(f"weights.disk_dir is empty; transport={self.transport!r} needs a "
                             "directory the engines can read")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"weights.{name}={value!r} is not one of {', '.join(allowed)}")


def _count(name: str, value: int, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"weights.{name}={value!r} must be an integer >= {low}")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"weights.{name}={value!r} must be a finite number > 0")
