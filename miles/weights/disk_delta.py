"""`transport = "disk_delta"`: publish only the bytes that changed since the engines' version.

Flow of one publish (the publisher drives it; the engines never stop generating):

    run_update   trainer writes <disk_dir>/delta-v000007/ (XOR vs the previous version, compressed,
                 per-tensor sha256)                                      engines serving
    prepare      every engine decodes + verifies the delta and stages it (its GPU or host
                 memory)                                                 engines serving
    commit       every engine swaps the staged tensors in between two scheduler steps and sets
                 the version with them                                   engines serving
    [rollback]   an engine's apply failed: the engines that applied put the previous version
                 back (kept by their prepare), so the fleet is on v-1 again, all of it

Design decisions:
- No pause (`traits.pauses_engines = False`, and the publisher pauses such a transport never):
  the engine's apply holds its step lock for the swap, which is what a pause would buy, and
  sets the version under the same lock (`traits.sets_version`), so requests in flight continue on
  the new weights and their `weight_versions` spans say from which token. The stall is the commit's
  own time (the publisher's `load_s`); `weights/changed_frac` says how much of the model moved.
- Double-buffered on the engine side (miles/engines/embedded_engine/delta.py): a staged tensor
  becomes the live weight where it can (a pointer swap), else it is copied in. Each engine's
  apply answer says how many went each way and how long it held the step lock; `applied` keeps
  them, one per engine, and the trainer logs them.
- The trainer keeps the bytes of the version the engines hold (in the engines' dtype, in host
  memory) and XORs the new bytes against them; the first publish, or the first after a failure
  that may have left engines on different versions, is written raw (it applies to any weights).
  Host memory: two copies of the model while a publish is in flight (base + new).
- The base only moves forward when every engine has committed: a refused or failed `prepare`
  leaves every engine on the old version, so the next delta is again against it.
- A fleet transaction (`weights.rollback`, default on): a version is committed on every engine
  or on none. `prepare` asks each engine to keep the bytes it replaces (`keep_previous`); if
  `apply` fails on any engine, the others roll back to v-1 and the publish fails naming both,
  and the base stays v-1 (the next delta is against it). Only when a rollback fails too (the
  engine died) is the fleet mixed; the next publish is then written raw, and the trainer drops
  a dead engine as for any publish.
- Deltas are in the engines' dtype (read from `/model_info` at connect), because the engine XORs
  against its own bytes; all engines must agree on it. This needs the embedded engine's
  `/update_weights_from_delta` (SGLang has no such endpoint).
- Compression, checksums and change counts run on `delta_threads` threads (zlib/lzma/zstd,
  hashlib and numpy release the GIL), chunk by chunk; the engines decode on as many
  (`prepare` sends the number).
- Each engine's `prepare` answer says where it staged the delta (`staged_on`: its GPU when it has
  room, else "cpu"); `staged_on` keeps them, one per engine, and the trainer logs them, because
  the engine's own line is INFO and engines usually run at `--log-level warning`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from miles.weights.base import BucketStream, TransferStats, TransportTraits
from miles.weights.config import WeightsConfig
from miles.weights.delta_format import DeltaWriter, encode_tensors
from miles.weights.disk import prune, version_dir
from miles.weights.engine_calls import EngineCalls, EngineCallError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A private uint8 copy of `t` in `dtype` (never aliasing a live parameter)."""
    host = t.detach().to(dtype=dtype).contiguous().cpu().reshape(-1)
    out = host.view(torch.uint8).numpy()
    aliases = t.device.type == "cpu" and host.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    return out.copy() if aliases else out


class DiskDeltaTransport(BucketStream):
    def __init__(self, config: WeightsConfig, *, is_sender: bool = True):
        self.cfg = config
        # no pause, nor during the commit (see the module docstring); the engine's apply sets
        # the version, under the lock of the swap
        self.traits = TransportTraits(sender=is_sender, pauses_engines=False, sets_version=True)
        self.root = Path(config.disk_dir)
        self._calls: EngineCalls | None = None
        self._stats = TransferStats()
        self._base: dict[str, np.ndarray] = {}
        self._base_sha: dict[str, str] = {}
        self._base_version: int | None = None
        self._writer: DeltaWriter | None = None
        self._error: BaseException | None = None
        self.engine_dtype = torch.float32
        self.delta_dir: Path | None = None
        self.last_manifest = None
        self.staged_on: list[str] = []  # per engine, from the last prepare: "cuda:0", "cpu"
        self.applied: list[dict] = []   # per engine, from the last commit: swapped, copied, scattered, swap_s
        self.rolled_back: list[str] = []  # engines put back on v-1 after the last commit failed

    def connect(self, engine_urls: list[str]) -> None:
        if not self.traits.sender:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self._calls = EngineCalls(engine_urls, timeout_s=self.cfg.connect_timeout_s, name="weights-delta")
        infos = self._calls.call_all("model_info", what="model_info", timeout_s=self.cfg.connect_timeout_s)
        dtypes = {str(i.get("dtype")) for i in infos}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise ValueError(f"transport='disk_delta' needs engines that report one dtype in /model_info "
                             f"(the embedded engine does); got {sorted(dtypes)} from {engine_urls}")
        self.engine_dtype = _DTYPES[dtypes.pop()]

    # ---- trainer side: write the delta -------------------------------------------------------

    # `delta_dir` is the directory of the version being published; `last_manifest` the manifest
    # of the last one written (its payload_bytes / full_bytes is the delta fraction).

    def begin(self, version: int) -> None:
        if self._calls is None:
            raise RuntimeError("begin: the disk_delta transport is not connected; call connect(engine_urls)")
        self._stats, self._error = TransferStats(), None
        base_version = self._base_version if self._base else None
        self.delta_dir = version_dir(self.root, version, prefix="delta-v")
        self._writer = DeltaWriter(self.delta_dir, version=version, base_version=base_version,
                                   codec=self.cfg.delta_codec)
        self._pool = ThreadPoolExecutor(self.cfg.delta_threads, thread_name_prefix="weights-delta")
        self._next: dict[str, np.ndarray] = {}
        self._next_sha: dict[str, str] = {}

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._writer is None:
            raise RuntimeError("send_bucket before begin")
        self._stats.tensors += len(named_tensors)
        self._stats.bytes += sum(t.numel() * self.engine_dtype.itemsize for _, t in named_tensors)
        if self._error is not None:
            return  # keep the backend iterating (collective gather); finish() reports
        try:
            dtype_name = str(self.engine_dtype).removeprefix("torch.")
            with_base = self._writer.base_version is not None
            news = [(name, t, tensor_bytes(t, self.engine_dtype)) for name, t in named_tensors]
            pairs = [(new, self._base.get(name) if with_base else None) for name, _, new in news]
            counts = [self._pool.submit(self._count_changed, new, base) for new, base in pairs]
            encoded = encode_tensors(pairs, codec=self.cfg.delta_codec, level=self.cfg.delta_level,
                                     chunk_bytes=self.cfg.delta_chunk_bytes, pool=self._pool)
            items = []
            for (name, t, new), (kind, chunks, digest), count in zip(news, encoded, counts):
                changed = count.result()
                self._stats.elements += new.nbytes // self.engine_dtype.itemsize
                self._stats.changed_elements += changed
                items.append((name, dtype_name, list(t.shape), kind, chunks, digest,
                              self._base_sha.get(name) if kind == "xor" else None, changed))
                self._next[name], self._next_sha[name] = new, digest
            self._writer.write_bucket(items)
            self._stats.buckets += 1
        except Exception as e:  # noqa: BLE001
            self._error = e

    def _count_changed(self, new: np.ndarray, base: np.ndarray | None) -> int:
        """Elements of the engine dtype that differ from the base (all of them without one)."""
        size = self.engine_dtype.itemsize
        n = new.nbytes // size
        if base is None or base.nbytes != new.nbytes:
            return n
        as_int = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
        return int(np.count_nonzero(new.view(as_int) != base.view(as_int)))

    def finish(self, version: int) -> None:
        if self._writer is None:
            raise RuntimeError("finish before begin")
        writer, self._writer = self._writer, None
        self._pool.shutdown(wait=True)
        if self._error is not None:
            writer.abort()
            raise self._error
        manifest = writer.close()
        self._stats.payload_bytes = manifest.payload_bytes
        self.last_manifest = manifest
        prune(self.root, "delta-v", self.cfg.keep_versions, version)
        log.info("delta v%d: %.1f MiB of %.1f MiB (%.2f%%), base %s", version,
                 manifest.payload_bytes / 2**20, manifest.full_bytes / 2**20,
                 100 * manifest.payload_bytes / max(manifest.full_bytes, 1), manifest.base_version)

    # ---- engine side: prepare and swap while serving -------------------------------------------

    def prepare(self, version: int) -> None:
        self.staged_on = []
        try:
            answers = self._calls.call_all("update_weights_from_delta", "prepare", str(self.delta_dir),
                                           weight_version=str(version), threads=self.cfg.delta_threads,
                                           keep_previous=self.cfg.rollback,
                                           timeout_s=self.cfg.prepare_timeout_s,
                                           what=f"version {version}: prepare delta {self.delta_dir}")
        except EngineCallError:
            self._discard()
            raise
        self.staged_on = [str(a.get("staged_on", "unknown")) if isinstance(a, dict) else "unknown"
                          for a in answers]
        log.info("delta v%d prepared; staged on %s", version, ", ".join(self.staged_on))

    def commit(self, version: int) -> None:
        self.applied, self.rolled_back = [], []
        what = f"version {version}: apply delta"
        futures = self._calls.submit_all("update_weights_from_delta", "apply", weight_version=str(version),
                                         timeout_s=self.cfg.commit_timeout_s)
        answers, failed = [], []
        for i, fut in enumerate(futures):
            try:
                answers.append(self._calls.wait([fut], what, self.cfg.commit_timeout_s, indices=[i])[0])
            except EngineCallError as e:
                answers.append(None)
                failed.append(e)
        if failed:
            self._abort_commit(version, answers, failed)
        retired = self._base
        self._base, self._base_sha, self._base_version = self._next, self._next_sha, version
        self._next, self._next_sha = {}, {}
        # Freeing the old base (the whole model in host memory: 15 GB at 7B) took 0.4 s; off the
        # commit's clock, which is the publish's stall.
        threading.Thread(target=retired.clear, name="weights-delta-free", daemon=True).start()
        self.applied = [{k: a.get(k) for k in ("swapped", "copied", "scattered", "swap_s")}
                        if isinstance(a, dict) else {} for a in answers]
        log.info("delta v%d applied while serving: %s", version, "; ".join(
            f"{a.get('swapped')} swapped, {a.get('copied')} copied, {a.get('scattered')} scattered in "
            f"{1e3 * float(a.get('swap_s') or 0.0):.1f} ms" for a in self.applied))

    def _abort_commit(self, version: int, answers: list, failed: list[EngineCallError]) -> None:
        """Some engines did not apply `version`: roll the others back to v-1, or (no rollback,
        or it failed) leave the fleet mixed and write the next version raw. Always raises."""
        applied = [i for i, a in enumerate(answers) if a is not None]
        urls = self._calls.engine_urls
        cause = "; ".join(str(e) for e in failed)
        self._next, self._next_sha = {}, {}
        self._discard()
        if applied and self.cfg.rollback:
            try:
                self._calls.call_all("update_weights_from_delta", "rollback", weight_version=str(version),
                                     indices=applied, timeout_s=self.cfg.commit_timeout_s,
                                     what=f"version {version}: roll back")
            except EngineCallError as e:
                self._base, self._base_sha, self._base_version = {}, {}, None
                raise EngineCallError(f"{cause}; rolling the others back failed too ({e}): the "
                                      f"fleet is mixed until the next publish (written raw)") from None
            self.rolled_back = [urls[i] for i in applied]
            raise EngineCallError(f"{cause}; rolled back on {self.rolled_back}: every engine serves "
                                  f"version {self._base_version} again")
        if applied:  # no rollback kept: some engines swapped, some not
            self._base, self._base_sha, self._base_version = {}, {}, None
        raise EngineCallError(cause)

    def abandon(self, version: int) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._next, self._next_sha = {}, {}
        if self._calls is not None:
            self._discard()

    def _discard(self) -> None:
        for fut in self._calls.submit_all("update_weights_from_delta", "discard",
                                          timeout_s=self.cfg.control_timeout_s):
            try:
                fut.result(self.cfg.control_timeout_s)
            except Exception:  # noqa: BLE001 - best effort: a prepared delta only costs memory
                pass

    def close(self) -> None:
        if self._calls is not None:
            self._calls.close()
            self._calls = None
