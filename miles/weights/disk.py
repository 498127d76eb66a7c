"""`transport = "disk"`: a full HF safetensors export per version, loaded by `/update_weights_from_disk`.

Design decisions:
- The directory is an ordinary HF checkpoint (HF names and layout, `config.json` and tokenizer
  files copied from the model's own directory, `model.safetensors.index.json` when sharded), so
  SGLang, the embedded engine or `from_pretrained` can all load it, and it doubles as a snapshot.
- A version is written under `v000007.tmp/` and renamed when complete: an engine never sees half a
  checkpoint. One shard per `bucket_bytes`, written as the buckets arrive (rank 0 never holds the
  whole model).
- Only the last `keep_versions` directories are kept; the one the engines serve is never deleted.
- This is the path for engines that share a filesystem with the trainer and nothing else; it
  moves every byte every time (disk_delta moves only what changed).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from miles.weights.base import BucketStream, TransferStats, TransportTraits
from miles.weights.config import WeightsConfig
from miles.weights.engine_calls import EngineCalls

_COPIED_PREFIXES = ("tokenizer", "special_tokens", "vocab", "merges", "generation_config",
                    "chat_template", "added_tokens")


def version_dir(root: str | Path, version: int, prefix: str = "v") -> Path:
    return Path(root) / f"{prefix}{version:06d}"


def copy_model_files(source_dir: str | Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """config.json (with the exported dtype) and the tokenizer files of the model's directory."""
    src = Path(source_dir)
    config = json.loads((src / "config.json").read_text())
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(_COPIED_PREFIXES):
            shutil.copy2(f, out_dir / f.name)


def prune(root: Path, prefix: str, keep: int, current: int) -> None:
    """Keep `current` and the newest `keep` - 1 version directories below it (`<prefix>NNNNNN`).
    Directories numbered above `current` are stale, left by an earlier run that got further (a run
    resumed from an older checkpoint publishes those numbers again): they go too, or they would
    count as newer and push out the version just written."""
    dirs = sorted((int(p.name[len(prefix):]), p) for p in root.glob(f"{prefix}[0-9]*")
                  if p.is_dir() and p.name[len(prefix):].isdigit())
    older = [p for v, p in dirs if v < current]
    stale = [p for v, p in dirs if v > current]
    for p in stale + older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)


class DiskTransport(BucketStream):
    def __init__(self, config: WeightsConfig, *, source_dir: str | Path | None, is_sender: bool = True):
        self.cfg = config
        self.source_dir = Path(source_dir) if source_dir else None
        self.traits = TransportTraits(sender=is_sender)
        self.root = Path(config.disk_dir)
        self._calls: EngineCalls | None = None
        self._stats = TransferStats()
        self._error: BaseException | None = None
        self._tmp: Path | None = None

    def connect(self, engine_urls: list[str]) -> None:
        if not self.traits.sender:
            return
        if self.source_dir is None or not (self.source_dir / "config.json").is_file():
            raise ValueError(f"transport={self.cfg.transport!r} copies config.json from the model's "
                             f"directory; model_path={str(self.source_dir)!r} has none")
        self.root.mkdir(parents=True, exist_ok=True)
        self._calls = EngineCalls(engine_urls, timeout_s=self.cfg.commit_timeout_s, name="weights-disk")

    def begin(self, version: int) -> None:
        if self._calls is None:
            raise RuntimeError("begin: the disk transport is not connected; call connect(engine_urls)")
        self._stats, self._error = TransferStats(), None
        self._final = version_dir(self.root, version)
        self._tmp = self._final.with_name(self._final.name + ".tmp")
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._open: dict[str, torch.Tensor] = {}
        self._open_bytes = 0
        self._shards: list[tuple[Path, list[str], int]] = []
        self._dtype: torch.dtype | None = None

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._tmp is None:
            raise RuntimeError("send_bucket before begin")
        for name, t in named_tensors:
            nbytes = t.numel() * t.element_size()
            self._stats.tensors += 1
            self._stats.bytes += nbytes
            if self._error is not None:
                continue  # keep the backend iterating (collective gather); finish() reports
            try:
                if self._open and self._open_bytes + nbytes > self.cfg.bucket_bytes:
                    self._write_shard()
                self._open[name] = t.detach().contiguous().cpu()
                self._open_bytes += nbytes
                self._dtype = self._dtype or t.dtype
            except Exception as e:  # noqa: BLE001
                self._error = e

    def _write_shard(self) -> None:
        from safetensors.torch import save_file
        path = self._tmp / f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._open, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._open), self._open_bytes))
        self._stats.buckets += 1
        self._open, self._open_bytes = {}, 0

    def finish(self, version: int) -> None:
        if self._tmp is None:
            raise RuntimeError("finish before begin")
        try:
            if self._error is not None:
                raise self._error
            if self._open:
                self._write_shard()
            self._seal()
            self._stats.payload_bytes = self._stats.bytes
            t = time.perf_counter()
            self._calls.call_all("update_weights_from_disk", str(self._final), weight_version=str(version),
                                 what=f"version {version}: /update_weights_from_disk {self._final}",
                                 timeout_s=self.cfg.commit_timeout_s)
            self._stats.load_s = time.perf_counter() - t
            prune(self.root, "v", self.cfg.keep_versions, version)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        finally:
            self._tmp = None

    def _seal(self) -> None:
        n = len(self._shards)
        weight_map = {}
        for k, (path, names, _) in enumerate(self._shards):
            fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self._tmp / fname)
            weight_map.update(dict.fromkeys(names, fname))
        if n > 1:
            (self._tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": sum(b for _, _, b in self._shards)},
                 "weight_map": weight_map}, indent=2))
        copy_model_files(self.source_dir, self._tmp, self._dtype)
        shutil.rmtree(self._final, ignore_errors=True)
        self._tmp.rename(self._final)

    def abandon(self, version: int) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        if self._calls is not None:
            self._calls.close()
            self._calls = None
