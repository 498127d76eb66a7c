"""Sample provenance: stamp each sample where it is made, log it where it is trained.

    rollout worker:  Stamper.stamp(sample, times)      -> Sample.provenance (travels with it,
                                                          journalled by the buffer)
    driver:          ProvenanceLog.write(step, batch)   -> <run>/provenance.jsonl (trained_step set)
                     ProvenanceLog.version(...)         -> <run>/weights/versions.jsonl
    `miles trace`:   read_lineage(run_dir)              (miles/trace.py prints it)

Design decisions:
- The record (`miles.wire.messages.Provenance`) is a positional msgspec Struct with defaults
  omitted: a few hundred bytes per sample on the wire and in the journal (bench/provenance.py).
- Everything a stamp needs is already on the sample or in the recipe: the engine's id and
  process id come in `/generate`'s meta_info (the embedded engine sends them; an engine that
  does not leaves them empty), the sandbox and session ids in `metadata`, the routing digest is
  a hash of the R3 array the sample carries anyway. Nothing is asked of any other actor.
- The publisher's weight digest is known only where the publish computed checksums
  (`weights.check_weights`): the digest of version v is sha256 over the sorted (name, checksum)
  pairs the trainer sent, and each engine's digest is the same over what `/weights_checksum`
  answered (`miles.weights.publisher`, in `Published`). Both go to `weights/versions.jsonl`; a sample generated on an engine whose digest
  for its version differs from the publisher's is a mismatch (`miles trace`, metric
  `provenance/digest_mismatch`). They are computed after the engines resumed, never under an
  engine's step lock.
- The run-directory log is one JSON line per trained sample, written by the driver after the
  step (a few hundred lines, well under a millisecond of encoding); it is the lineage file,
  `episodes.jsonl` keeps the transcripts.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from miles.wire.messages import Provenance, Sample

FILE = "provenance.jsonl"
VERSIONS = "weights/versions.jsonl"


def routing_digest(routed: np.ndarray | None) -> str:
    if routed is None:
        return ""
    return hashlib.sha256(np.ascontiguousarray(routed).view(np.uint8)).hexdigest()[:16]


def _module_version(path: str) -> str:
    """`__version__` of the module a `module:function` path names, else its package's."""
    module = path.split(":", 1)[0]
    if not module or ":" not in path:
        return ""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a version is a nicety; the plug-in loaded elsewhere
        return ""
    version = getattr(mod, "__version__", "")
    if not version:
        try:
            from importlib.metadata import version as dist_version
            version = dist_version(module.split(".")[0])
        except Exception:  # noqa: BLE001
            version = ""
    return str(version)


def _miles_version() -> str:
    try:
        from importlib.metadata import version as dist_version
        return dist_version("miles")
    except Exception:  # noqa: BLE001
        return ""


class Stamper:
    """The rollout worker's: what every sample of this worker shares, computed once."""

    def __init__(self, recipe):
        r = recipe.rollout
        # the format the engines hold: a quantized one, else the engines' dtype (unquantized)
        self.quant_format = recipe.quant.format or recipe.engine.dtype
        self.env_name = r.agent or r.generate or r.function or "single_turn"
        self.env_version = _module_version(self.env_name) or _miles_version()
        self.verifier_name = r.reward
        self.verifier_version = _module_version(r.reward) or _miles_version()

    def stamp(self, s: Sample, sampling, *, queued_at: float, started_at: float,
              admitted_version: int = -1) -> None:
        """Fill `s.provenance` from the finished sample (keeps what generate_sample set)."""
        p = s.provenance or Provenance()
        versions = sorted({int(v.version) for v in s.weight_versions})
        p.versions = versions
        p.policy_version = versions[0] if versions else admitted_version
        p.sampling = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                      "top_k": float(sampling.top_k), "max_new_tokens": float(sampling.max_new_tokens),
                      "seed": float(sampling.sampling_seed or 0)}
        p.quant_format = self.quant_format
        p.routing_digest = routing_digest(s.routed_experts)
        meta = s.metadata
        p.session_id = str(meta.get("session_id", "") or "")
        p.sandbox_id = str(meta.get("sandbox_id", "") or "")
        image = str(meta.get("sandbox_image", "") or "")
        p.image_digest = image.split("@", 1)[1] if "@" in image else image
        p.env_name, p.env_version = self.env_name, self.env_version
        p.verifier_name, p.verifier_version = self.verifier_name, self.verifier_version
        if isinstance(s.reward, dict):
            p.reward_components = {k: float(v) for k, v in s.reward.items()
                                   if isinstance(v, (int, float))}
        elif s.reward is not None:
            p.reward_components = {"reward": float(s.reward)}
        p.queued_at, p.started_at, p.finished_at = queued_at, started_at, time.time()
        s.provenance = p


def note_engine(s: Sample, meta_info: dict[str, Any]) -> None:
    """Record the engine that answered (from `/generate`'s meta_info) on the sample."""
    engine = meta_info.get("engine_id")
    if not engine:
        return
    p = s.provenance or Provenance()
    p.engine_id = str(engine)
    p.engine_incarnation = int(meta_info.get("engine_incarnation", 0) or 0)
    s.provenance = p


# ----- the run directory -----------------------------------------------------------------------

class LineageRow(msgspec.Struct, omit_defaults=True):
    """One trained sample in `<run>/provenance.jsonl`."""
    step: int
    prompt_index: int
    group_id: str
    rollout_id: str
    index: int
    status: str
    reward: float | dict[str, float] | None = None
    response_tokens: int = 0
    # by field name (the wire's positional form is not for reading by eye); see `as_dict`
    provenance: dict[str, Any] = {}

    def record(self) -> Provenance | None:
        return Provenance(**self.provenance) if self.provenance else None


_DEFAULTS = {f: d for f, d in zip(Provenance.__struct_fields__, Provenance.__struct_defaults__)}


def as_dict(p: Provenance | None) -> dict[str, Any]:
    """The fields of `p` that differ from their defaults, by name."""
    if p is None:
        return {}
    return {f: v for f in Provenance.__struct_fields__
            if (v := getattr(p, f)) != _DEFAULTS[f] and not (isinstance(v, (list, dict)) and not v)}


class VersionRow(msgspec.Struct, omit_defaults=True):
    """One published version in `<run>/weights/versions.jsonl`."""
    version: int
    step: int
    time: float
    transport: str = ""
    digest: str = ""                         # the publisher's ("" when not computed)
    engine_digests: dict[str, str] = {}      # engine url -> digest of what it holds


def engine_key(url: str) -> str:
    """host:port of an engine URL (what the engine calls itself in meta_info)."""
    return url.split("://", 1)[-1].rstrip("/")


class ProvenanceLog:
    """The driver's writer of the two lineage files (plain appends: a few KB per step)."""

    def __init__(self, run_dir: str | Path, fresh: bool):
        self.path = Path(run_dir) / FILE
        self.versions_path = Path(run_dir) / VERSIONS
        self.versions_path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.unlink(missing_ok=True)
            self.versions_path.unlink(missing_ok=True)
        self.digests: dict[int, str] = {}
        self.engine_digests: dict[int, dict[str, str]] = {}
        self.mismatches = 0
        self._enc = msgspec.json.Encoder()

    def version(self, row: VersionRow) -> None:
        self.digests[row.version] = row.digest
        self.engine_digests[row.version] = {engine_key(u): d for u, d in row.engine_digests.items()}
        _append(self.versions_path, self._enc.encode(row) + b"\n")

    def published(self, version: int, step: int, transport: str, reply) -> None:
        """Rank 0's `Published` answer for `version` (its digests, where computed)."""
        self.version(VersionRow(version=version, step=step, time=round(time.time(), 3),
                                transport=transport, digest=getattr(reply, "weight_digest", ""),
                                engine_digests=dict(getattr(reply, "engine_digests", {}) or {})))

    def write(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Append the step's trained samples; returns the step's `provenance/...` metrics."""
        lines, mismatched = [], 0
        for s in samples:
            p = s.provenance
            if p is not None:
                p.trained_step = step
                if not p.weight_digest:
                    p.weight_digest = self.digests.get(p.policy_version, "")
                if mismatch(p, self.digests, self.engine_digests):
                    mismatched += 1
            lines.append(self._enc.encode(LineageRow(
                step=step, prompt_index=int(s.metadata.get("prompt_index", -1)), group_id=s.group_id,
                rollout_id=s.rollout_id, index=s.index, status=str(s.status), reward=s.reward,
                response_tokens=s.response_length, provenance=as_dict(p))))
        if lines:
            _append(self.path, b"\n".join(lines) + b"\n")
        self.mismatches += mismatched
        return {"provenance/digest_mismatch": float(mismatched),
                "provenance/samples": float(sum(s.provenance is not None for s in samples))}


def mismatch(p: Provenance, digests: dict[int, str], engine_digests: dict[int, dict[str, str]]) -> bool:
    """The engine that made the sample held other weights than the publisher's for its version."""
    want = digests.get(p.policy_version, "")
    have = engine_digests.get(p.policy_version, {}).get(p.engine_id, "")
    return bool(want and have and want != have)


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_jsonl(path: Path, typ: type) -> list:
    """Every whole line of a lineage file (a torn last line is skipped)."""
    if not path.exists():
        return []
    dec, out = msgspec.json.Decoder(typ), []
    for line in path.read_bytes().splitlines():
        if line.strip():
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError:
                continue
    return out
