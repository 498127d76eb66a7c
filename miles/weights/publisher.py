"""WeightPublisher: the engine session around a weight transport, on trainer rank 0.

    report = await publisher.publish(version, run_update)

    pause (in_place | retract) -> run_update (transport.send) -> prepare -> commit
    [-> update_weight_version, unless traits.sets_version] -> continue_generation [-> check_weights]

For a transport whose engines keep serving throughout (disk_delta, `traits.pauses_engines`
False), the same phases without the pause:

    run_update -> prepare (engines decode + verify) -> commit (each engine swaps between two of
    its steps) [-> update_weight_version, unless the commit set it] [-> check_weights]

Every transport goes through the same phases (miles/weights/base.py); what differs is read off
its `TransportTraits`, never probed.

Design decisions:
- Plain async Python, not an actor: the Trainer actor on rank 0 owns one and awaits `publish`.
  `run_update` is a callable that runs `backend.update_weights(transport, version)` on this rank
  (the other trainer ranks run theirs at the same time, the gather is collective); it is blocking
  torch code, so it runs in a worker thread and the event loop keeps serving heartbeats.
- Transports that promise not to touch an engine before a gate opens (`traits.send_gate`: nccl,
  colocated) start gathering at once; the gate opens when every engine has paused. The pause
  round trip and the first buckets' gather overlap instead of adding up.
- With paused engines, prepare and commit run in run_update's own thread right after it (no
  extra thread hop in the stall: ~0.17 ms on a loaded 2-core CPU), under the transfer's timeout;
  their time counts as load time. Unpaused (disk_delta), each is its own step with its own
  timeout, as the engines serve meanwhile.
- Every step has its own timeout (WeightsConfig). A thread cannot be killed: when `run_update`
  overruns, the publisher abandons the version (the transport tears its link down, which also
  unblocks the thread) and reports it.
- Engines are always resumed, whatever failed (every engine gets `/continue_generation`, also one
  whose pause timed out, since it may have paused late); then the failure is raised as one
  `WeightPublishError` that names the version, the step, the transport and the cause, and says
  what the engines now hold.
- The version is set on every engine with `/update_weight_version` after the transfer (by the
  transport itself when its traits say `sets_version`), so requests that crossed the update report both
  versions in their `weight_versions` spans.
- The publisher publishes to the set it was made with. Surviving an engine that dies during a
  publish is the trainer's job (actors/trainer.py): it asks `reachable_engines()`, reconnects the
  transport to the survivors and publishes again, because the gather that feeds the transport is
  a collective that every trainer rank must repeat.
- Stall time is the figure (`PublishReport.metrics`): pause request -> resume answer, split into
  pause, transfer, load, version and resume on one clock, so the parts add up to it exactly.
  A transport whose traits say `pauses_engines = False` is never paused: the engine's commit
  lands between two of its scheduler steps (held under its step lock, which is all a pause
  buys), requests in flight continue on the new weights, and its stall is the commit (`load_s`)
  plus the version call if the commit did not set it; pause, transfer and resume are 0.
- `check_weights` compares every engine parameter's checksum (`/weights_checksum`, the
  `weights.checksum` algorithm) with what the trainer sent (checks.py) after the engines are
  resumed, and raises on the first mismatch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from miles.engines.client import EngineClient, EngineError
from miles.weights.base import SendGate, WeightTransport
from miles.weights.checks import DTYPES, ChecksumTap, WeightsMismatch, compare_checksums
from miles.weights.config import WeightsConfig
from miles.weights.factory import make_transport  # noqa: F401 - the public entry point lives here too

log = logging.getLogger(__name__)


class WeightPublishError(RuntimeError):
    """A publish failed; engines were resumed. `.step` is where it failed, `.version` what."""

    def __init__(self, message: str, *, version: int, step: str):
        super().__init__(message)
        self.version, self.step = version, step


class PublishReport(msgspec.Struct, kw_only=True):
    version: int
    transport: str
    seconds: float          # the whole publish() call
    paused_s: float         # engines paused (pause answered -> continue answered); 0 never paused
    transfer_s: float       # run_update (with a send gate it starts together with the pause)
    prepare_s: float = 0.0  # disk_delta: engines decoding while they serve
    check_s: float = 0.0
    tensors: int = 0
    bytes: int = 0          # full tensor bytes
    payload_bytes: int = 0  # bytes that moved (a delta is smaller)
    buckets: int = 0
    direct_tensors: int = 0  # nccl: sent zero-copy, straight into engine parameters
    checked: bool = False
    # Stall time: the engines serve nothing from the pause request to the resume answer.
    # stall_s = pause_s + stall_transfer_s + load_s + version_s + resume_s, exactly (one clock,
    # consecutive timestamps). With a send gate the gather starts with the pause, so only the
    # transfer that outlasts the pause counts. disk_delta is never paused: its transfer and
    # prepare run while the engines serve (transfer_s, prepare_s) and its stall is the commit's
    # round trip (load_s; the engines hold their step lock for part of it, the swap), with
    # pause_s, stall_transfer_s and resume_s 0.
    stall_s: float = 0.0
    pause_s: float = 0.0          # pause request -> every engine answered paused
    stall_transfer_s: float = 0.0  # paused -> transfer done, less load_s
    load_s: float = 0.0           # engines loading what was sent (the transport's last wait, or commit)
    version_s: float = 0.0        # /update_weight_version on every engine
    resume_s: float = 0.0         # /continue_generation on every engine
    background_s: float = 0.0     # disk_delta: transfer + prepare while the engines serve
    changed_frac: float | None = None  # disk_delta: fraction of elements the version changed
    # provenance (check_weights only): miles.rl.provenance.weights_digest of what was sent, and
    # of what each engine answered (url -> digest); computed after the engines resumed
    digest: str = ""
    engine_digests: dict[str, str] = {}

    def metrics(self) -> dict[str, float]:
        """The step metrics of this publish (`weights/...`), as the driver logs them."""
        return {"weights/stall_s": self.stall_s, "weights/pause_s": self.pause_s,
                "weights/transfer_s": self.stall_transfer_s, "weights/load_s": self.load_s,
                "weights/version_s": self.version_s, "weights/resume_s": self.resume_s,
                "weights/background_s": self.background_s,
                "weights/publish_s": self.seconds, "weights/bytes": float(self.bytes),
                "weights/payload_bytes": float(self.payload_bytes),
                **({} if self.changed_frac is None else {"weights/changed_frac": self.changed_frac})}


class WeightPublisher:
    def __init__(self, config: WeightsConfig, engine_urls: list[str], transport: WeightTransport):
        if not engine_urls:
            raise ValueError("WeightPublisher: engine_urls is empty")
        self.cfg = config
        self.engine_urls = list(engine_urls)
        self.engine_digests: dict[str, str] = {}              # check(): url -> digest
        self.last_digests: tuple[str, dict[str, str]] = ("", {})
        self.transport = transport
        self._clients: list[EngineClient] | None = None
        self._lock = asyncio.Lock()
        self.last_report: PublishReport | None = None

    def clients(self) -> list[EngineClient]:
        if self._clients is None:
            cfg = self.cfg
            longest = max(cfg.pause_timeout_s, cfg.control_timeout_s, cfg.check_timeout_s)
            self._clients = [EngineClient(u, timeout_s=longest, weight_update_timeout_s=longest)
                             for u in self.engine_urls]
        return self._clients

    async def connect(self) -> None:
        """`transport.connect(engine_urls)` in a thread (if the caller has not done it already)."""
        await self._in_thread(self.transport.connect, self.engine_urls,
                              timeout_s=self.cfg.connect_timeout_s + 30.0, what="connect")

    async def close(self) -> None:
        for c in self._clients or []:
            await c.close()
        self._clients = None

    async def reachable_engines(self) -> list[str]:
        return await reachable_engines(self.engine_urls, timeout_s=self.cfg.control_timeout_s)

    # ---- publish -----------------------------------------------------------------------------

    async def publish(self, version: int, run_update: Callable[[], Any]) -> PublishReport:
        async with self._lock:
            return await self._publish(version, run_update)

    async def _publish(self, version: int, run_update: Callable[[], Any]) -> PublishReport:
        cfg, tr = self.cfg, self.transport
        t0 = time.perf_counter()
        if cfg.check_weights:
            await self._prepare_check(version)
        step, failure = "pause", None
        paused_at = resumed_at = swap_at = None
        transfer_s = prepare_s = load_s = 0.0
        asked_at = transferred_at = versioned_at = None  # stall clock (see PublishReport)
        pauses, phase, commit_s = tr.traits.pauses_engines, [], []  # see _send_then_commit
        gated = pauses and tr.traits.send_gate
        update = (lambda: self._send_then_commit(run_update, version, phase, commit_s)) \
            if pauses else run_update
        try:
            t = time.perf_counter()
            transfer = None
            if gated:  # gather the first buckets while the engines pause
                tr.send_gate = SendGate()
                transfer = asyncio.ensure_future(self._in_thread(
                    update, timeout_s=cfg.transfer_timeout_s,
                    what=f"run_update (gather + send of version {version})"))
            if pauses:
                paused_at = asked_at = time.perf_counter()
                try:
                    await self._pause(version)
                except BaseException:
                    if transfer is not None:  # it sends nothing now, but must finish (collective)
                        tr.send_gate.close(f"version {version}: the engines could not be paused")
                        await asyncio.gather(transfer, return_exceptions=True)
                    raise
                paused_at = time.perf_counter()
                if transfer is not None:
                    tr.send_gate.open()
            step = "transfer"
            if transfer is None:
                t = time.perf_counter()
                transfer = self._in_thread(update, timeout_s=cfg.transfer_timeout_s,
                                           what=f"run_update (gather + send of version {version})")
            await transfer
            transferred_at = time.perf_counter()
            transfer_s = transferred_at - t
            load_s = tr.stats.load_s + sum(commit_s)  # paused: commit ran in the transfer's thread
            if not pauses:
                step = "prepare"
                t = time.perf_counter()
                await self._in_thread(tr.prepare, version, timeout_s=cfg.prepare_timeout_s + 30.0,
                                      what="prepare")
                prepare_s = time.perf_counter() - t
                step = "commit"
                swap_at = time.perf_counter()  # never paused: the stall clock starts at the commit
                await self._in_thread(tr.commit, version, timeout_s=cfg.commit_timeout_s + 30.0,
                                      what="commit")
                transferred_at = time.perf_counter()
                load_s = transferred_at - swap_at
            step = "version"
            if not tr.traits.sets_version:
                await self._each("update_weight_version", version, timeout_s=cfg.control_timeout_s)
            versioned_at = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - CancelledError too: engines must resume
            failure = e
            if step == "transfer" and phase:
                step = phase[-1]
            try:
                await asyncio.wait_for(asyncio.to_thread(tr.abandon, version), cfg.control_timeout_s)
            except BaseException as ae:  # noqa: BLE001
                log.warning("abandoning version %d: %r", version, ae)
        finally:
            if gated:
                tr.send_gate = None
            resume_error = None
            if paused_at is not None:
                resume_error = await self._resume()
                resumed_at = time.perf_counter()
        if failure is not None:
            if not isinstance(failure, Exception):  # cancelled, interrupted: as it came
                raise failure
            raise WeightPublishError(self._failure_message(version, step, failure, resume_error),
                                     version=version, step=step) from failure
        if resume_error:
            raise WeightPublishError(f"publish of version {version}: the weights are in, but "
                                     f"{resume_error}", version=version, step="continue")
        check_s = 0.0
        self.engine_digests = {}
        if cfg.check_weights:
            t = time.perf_counter()
            try:
                await self.check(version)
            finally:
                self.last_digests = (_digest(getattr(self.transport, "sent_checksums", {})),
                                     dict(self.engine_digests))
            check_s = time.perf_counter() - t
        stats = tr.stats
        report = PublishReport(
            version=version, transport=cfg.transport, seconds=time.perf_counter() - t0,
            paused_s=(resumed_at - paused_at) if paused_at is not None and resumed_at else 0.0,
            transfer_s=transfer_s, prepare_s=prepare_s, check_s=check_s, tensors=stats.tensors,
            bytes=stats.bytes, payload_bytes=stats.payload_bytes, buckets=stats.buckets,
            direct_tensors=stats.direct_tensors, checked=cfg.check_weights)
        if cfg.check_weights:
            report.digest, report.engine_digests = self.last_digests
        if not pauses:
            report.background_s = transfer_s + prepare_s
        if stats.elements:
            report.changed_frac = stats.changed_elements / stats.elements
        if asked_at is not None and resumed_at is not None:
            _stall_parts(report, asked_at, paused_at, transferred_at, versioned_at, resumed_at, load_s)
        elif swap_at is not None and versioned_at is not None:  # never paused: nothing to resume
            _stall_parts(report, swap_at, swap_at, transferred_at, versioned_at, versioned_at, load_s)
        self.last_report = report
        log.info("published version %d via %s: %.1f MiB (%.1f MiB moved) in %.3f s, paused %.3f s",
                 version, cfg.transport, report.bytes / 2**20, report.payload_bytes / 2**20,
                 report.seconds, report.paused_s)
        return report

    def _failure_message(self, version: int, step: str, error: BaseException, resume_error) -> str:
        cause = str(error) or type(error).__name__
        if step == "pause" or (step == "prepare" and not self.transport.traits.pauses_engines):
            held = "their previous weights and version (nothing was changed)"
        elif step == "version":
            held = (f"the new weights, but not every engine reports version {version} (their "
                    "weight_version is stale until the next publish)")
        elif self.cfg.transport == "disk_delta":
            held = "their previous weights and version (the delta was not swapped in everywhere)"
        elif self.cfg.transport == "disk":
            held = "their previous version (the checkpoint was not loaded everywhere)"
        else:
            held = ("their previous weight_version; their weights may be partially updated until "
                    "the next publish overwrites them")
        if not self.transport.traits.pauses_engines:
            resumed = "Engines were never paused"
        else:
            resumed = "Engines were resumed" if resume_error is None else f"Resuming failed too: {resume_error}"
        return (f"publish of version {version} failed at step {step!r} (transport "
                f"{self.cfg.transport!r}): {cause}. {resumed}; they hold {held}.")

    def _send_then_commit(self, run_update: Callable[[], Any], version: int, phase: list[str],
                          commit_s: list[float]) -> None:
        """(engines paused) run_update, then prepare and commit in the same thread, so the
        phases cost the stall no extra thread hop. Behind a send gate, the send may return
        before every engine has paused: the gate is waited for first. `phase` says which phase
        ran last (for the error), `commit_s` what prepare + commit took (load time)."""
        run_update()
        gate = self.transport.send_gate
        if gate is not None:
            gate.wait(self.cfg.pause_timeout_s + 30.0)
        t = time.perf_counter()
        phase.append("prepare")
        self.transport.prepare(version)
        phase.append("commit")
        self.transport.commit(version)
        commit_s.append(time.perf_counter() - t)

    # ---- engine calls ------------------------------------------------------------------------

    async def _each(self, method: str, *args, timeout_s: float, **kwargs) -> list[Any]:
        """Call every engine concurrently; raise naming the engines that failed."""
        clients = self.clients()

        async def one(c: EngineClient):
            return await asyncio.wait_for(getattr(c, method)(*args, **kwargs), timeout_s)

        results = await asyncio.gather(*(one(c) for c in clients), return_exceptions=True)
        errors = [f"{c.base_url}: {_reason(r, timeout_s)}" for c, r in zip(clients, results)
                  if isinstance(r, BaseException)]
        errors += [f"{c.base_url}: {r.get('message')}" for c, r in zip(clients, results)
                   if isinstance(r, dict) and r.get("success") is False]
        if errors:
            raise RuntimeError(f"/{method} failed on {len(errors)} of {len(clients)} engine(s): "
                               + "; ".join(errors))
        return results

    async def _pause(self, version: int) -> None:
        await self._each("pause_generation", self.cfg.pause_mode, timeout_s=self.cfg.pause_timeout_s)

    async def _resume(self) -> str | None:
        try:
            await self._each("continue_generation", timeout_s=self.cfg.control_timeout_s)
        except Exception as e:  # noqa: BLE001 - reported, never masks the first failure
            log.error("resuming engines: %s", e)
            return str(e)
        return None

    async def _in_thread(self, fn: Callable, *args, timeout_s: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} did not finish within {timeout_s} s") from None

    # ---- check_weights -----------------------------------------------------------------------

    async def _prepare_check(self, version: int) -> None:
        tr = self.transport
        if not isinstance(tr, ChecksumTap):
            raise ValueError("weights.check_weights=true needs a transport built by make_transport() "
                             "(it records what is sent); got " + type(tr).__name__)
        if tr.checksum_dtype is None:
            infos = await self._each("model_info", timeout_s=self.cfg.control_timeout_s)
            dtypes = {str(i.get("dtype")) for i in infos}
            if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
                raise ValueError(f"weights.check_weights=true needs engines that report their dtype "
                                 f"in /model_info and serve /weights_checksum (the embedded engine); "
                                 f"got dtypes {sorted(dtypes)}")
            tr.checksum_dtype = DTYPES[dtypes.pop()]

    async def check(self, version: int) -> None:
        """Every engine's parameters equal what the trainer sent for `version`, or WeightsMismatch."""
        tap = self.transport
        if not isinstance(tap, ChecksumTap):
            raise WeightsMismatch(f"check_weights: version {version}: the transport records no "
                                  f"checksums ({type(tap).__name__}; make_transport() wraps it)")
        sent = dict(tap.sent_checksums)
        if not sent:
            raise WeightsMismatch(f"check_weights: version {version}: the trainer sent nothing "
                                  "(did run_update call the transport on this rank?)")
        try:
            sums = await self._each("weights_checksum", algorithm=tap.algorithm,
                                    timeout_s=self.cfg.check_timeout_s)
        except RuntimeError as e:
            raise WeightsMismatch(f"check_weights: version {version}: could not read engine "
                                  f"checksums ({e}); /weights_checksum is an embedded-engine "
                                  "extension") from None
        self.engine_digests = {url: _digest(engine) for url, engine in zip(self.engine_urls, sums)}
        for url, engine in zip(self.engine_urls, sums):
            compare_checksums(sent, engine, url=url, version=version)


async def reachable_engines(engine_urls: list[str], *, timeout_s: float) -> list[str]:
    """The engines of `engine_urls` that are not dead. Dead means its port refuses or drops the
    connection (`/model_info`): the process is gone, and the fleet restarts it. A slow answer or
    none within `timeout_s` is not a death: such an engine stays in the set (a publish that
    cannot reach it fails loudly rather than leave it serving stale weights)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def alive(url: str) -> bool:
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url.rstrip("/") + "/model_info") as resp:
                    await resp.read()
                    return True
        except asyncio.TimeoutError:
            return True
        except (aiohttp.ClientConnectionError, OSError):
            return False

    verdicts = await asyncio.gather(*(alive(u) for u in engine_urls))
    return [u for u, ok in zip(engine_urls, verdicts) if ok]


def _stall_parts(report: PublishReport, asked_at: float, paused_at: float, transferred_at: float,
                 versioned_at: float, resumed_at: float, load_s: float) -> None:
    """Split asked_at -> resumed_at into its consecutive parts. A gated transfer may end before
    the pause does (then none of it stalled); the transport's load wait is part of its transfer."""
    transferred_at = max(transferred_at, paused_at)
    in_pause = transferred_at - paused_at
    report.pause_s = paused_at - asked_at
    report.load_s = min(max(load_s, 0.0), in_pause)
    report.stall_transfer_s = in_pause - report.load_s
    report.version_s = versioned_at - transferred_at
    report.resume_s = resumed_at - versioned_at
    report.stall_s = resumed_at - asked_at


def _digest(checksums: dict[str, str]) -> str:
    """One digest of a version from its per-parameter checksums, order free (provenance)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(f"{name}\0{checksums[name]}\n".encode())
    return h.hexdigest() if checksums else ""


def _reason(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer within {timeout_s} s"
    if isinstance(e, EngineError):
        return e.message
    return f"{type(e).__name__}: {e}"
