"""WeightPublisher against fake engines (in-process aiohttp) and a recording transport: the order of
the session, timeouts, engines always resumed, failures reported by step, check_weights."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from aiohttp import web

from miles.weights import WeightPublisher, WeightPublishError, WeightsConfig
import msgspec

from miles.weights.base import (BucketStream, DelegatingTransport, GateClosed, TransferStats,
                                TransportTraits, send_weights)
from miles.weights.checks import ChecksumTap, WeightsMismatch, tensor_sha256

FAST = dict(pause_timeout_s=1.0, control_timeout_s=1.0, transfer_timeout_s=2.0, check_timeout_s=1.0,
            prepare_timeout_s=1.0, commit_timeout_s=1.0)


class FakeEngine:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name
        self.fail: dict[str, int] = {}       # path -> HTTP status to answer
        self.hang: set[str] = set()          # paths that never answer
        self.delay: dict[str, float] = {}    # path -> seconds before answering
        self.checksums: dict[str, str] = {}
        self.url = ""

    def app(self) -> web.Application:
        async def handle(request: web.Request):
            path = request.path
            body = await request.json() if request.can_read_body else None
            self.log.append((self.name, path, body))
            if path in self.hang:
                await asyncio.sleep(2.0)  # longer than the publisher's 1 s timeouts
            await asyncio.sleep(self.delay.get(path, 0.0))
            if path in self.fail:
                return web.json_response({"error": {"message": f"{self.name} says no"}},
                                         status=self.fail[path])
            if path == "/model_info":
                return web.json_response({"dtype": "float32", "weight_version": "default"})
            if path == "/weights_checksum":
                return web.json_response({"algorithm": "sha256", "checksums": self.checksums})
            return web.json_response({"success": True, "message": "ok", "status": "ok"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app


@pytest.fixture
async def engines():
    log: list = []
    runners, fakes = [], []
    for i in range(2):
        fake = FakeEngine(log, f"e{i}")
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        runners.append(runner)
        fakes.append(fake)
    yield fakes, log
    for r in runners:
        await r.cleanup()


class Recording(BucketStream):
    def __init__(self, log: list, pauses_engines: bool = True):
        self.log = log
        self.traits = TransportTraits(pauses_engines=pauses_engines)
        self.fail_at: str | None = None
        self._stats = TransferStats(tensors=2, bytes=24, buckets=1, payload_bytes=24)

    def _step(self, what: str):
        self.log.append(("transport", what, None))
        if self.fail_at == what:
            raise RuntimeError(f"{what} broke")

    def connect(self, engine_urls):
        self._step("connect")

    def begin(self, version):
        self._step("begin")

    def send_bucket(self, named_tensors):
        self._step("bucket")

    def finish(self, version):
        self._step("finish")

    def prepare(self, version):
        self._step("prepare")

    def commit(self, version):
        self._step("commit")

    def abandon(self, version):
        self._step("abandon")


class Gated(Recording):
    """Gathers before the engines are paused; touches them only after the gate opens."""

    def __init__(self, log: list):
        super().__init__(log)
        self.traits = TransportTraits(send_gate=True)

    def send_bucket(self, named_tensors):
        self.log.append(("transport", "gathered", None))
        try:
            self.send_gate.wait(5.0)
        except GateClosed as e:
            self.log.append(("transport", f"gate closed: {e}", None))
            return
        self._step("bucket")


def run_update(tr, version=1):
    """A backend's update_weights on the sender rank: one bucket through send_weights."""
    return lambda: send_weights(tr, version, [[("a", torch.ones(2)), ("b", torch.zeros(1))]])


def steps(log):
    """The session as one list: engine paths (deduplicated across engines) and transport steps."""
    out = []
    for who, what, _ in log:
        item = what if who == "transport" else what.lstrip("/")
        if not out or out[-1] != item:
            out.append(item)
    return out


async def test_session_order_and_report(engines):
    fakes, log = engines
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    report = await pub.publish(7, run_update(tr, 7))
    assert steps(log) == ["pause_generation", "begin", "bucket", "finish", "prepare", "commit",
                          "update_weight_version", "continue_generation"]
    bodies = {(who, what): body for who, what, body in log}
    assert bodies[("e0", "/pause_generation")] == {"mode": "in_place"}
    assert bodies[("e1", "/update_weight_version")] == {"new_version": "7", "abort_all_requests": False}
    assert (report.version, report.transport, report.bytes, report.buckets) == (7, "nccl", 24, 1)
    assert report.paused_s >= report.transfer_s > 0 and not report.checked
    await pub.close()


async def test_retract_mode_is_passed(engines):
    fakes, log = engines
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(pause_mode="retract", **FAST), [f.url for f in fakes], tr)
    await pub.publish(1, run_update(tr))
    assert [b for _, p, b in log if p == "/pause_generation"] == [{"mode": "retract"}] * 2
    await pub.close()


async def test_transfer_failure_resumes_engines_and_says_so(engines):
    fakes, log = engines
    tr = Recording(log)
    tr.fail_at = "bucket"
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    with pytest.raises(WeightPublishError) as err:
        await pub.publish(3, run_update(tr, 3))
    e = err.value
    assert e.step == "transfer" and e.version == 3
    assert "publish of version 3 failed at step 'transfer'" in str(e) and "bucket broke" in str(e)
    assert "Engines were resumed" in str(e) and "partially updated" in str(e)
    assert steps(log) == ["pause_generation", "begin", "bucket", "abandon", "continue_generation"]
    assert not any(p == "/update_weight_version" for _, p, _ in log)
    await pub.close()


async def test_pause_failure_on_one_engine_resumes_every_engine(engines):
    fakes, log = engines
    fakes[1].fail["/pause_generation"] = 400
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    with pytest.raises(WeightPublishError) as err:
        await pub.publish(1, run_update(tr))
    assert err.value.step == "pause" and fakes[1].url in str(err.value) and "e1 says no" in str(err.value)
    assert "nothing was changed" in str(err.value)
    assert {who for who, p, _ in log if p == "/continue_generation"} == {"e0", "e1"}
    assert not any(what == "begin" for _, what, _ in log)
    await pub.close()


async def test_a_hung_pause_times_out_in_seconds(engines):
    fakes, log = engines
    fakes[0].hang.add("/pause_generation")
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    t = time.perf_counter()
    with pytest.raises(WeightPublishError, match=r"no answer within 1.0 s"):
        await pub.publish(1, run_update(tr))
    assert time.perf_counter() - t < 5
    assert {who for who, p, _ in log if p == "/continue_generation"} == {"e0", "e1"}
    await pub.close()


async def test_a_transfer_that_overruns_is_abandoned(engines):
    fakes, log = engines
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(**{**FAST, "transfer_timeout_s": 0.3}), [f.url for f in fakes], tr)
    with pytest.raises(WeightPublishError, match=r"did not finish within 0.3 s") as err:
        await pub.publish(1, lambda: time.sleep(0.6))
    assert err.value.step == "transfer"
    assert steps(log) == ["pause_generation", "abandon", "continue_generation"]
    await pub.close()


async def test_prepare_and_commit_while_serving_never_pause(engines):
    fakes, log = engines
    tr = Recording(log, pauses_engines=False)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    report = await pub.publish(2, run_update(tr, 2))
    assert steps(log) == ["begin", "bucket", "finish", "prepare", "commit", "update_weight_version"]
    assert report.prepare_s > 0 and report.paused_s == 0.0
    # A commit that sets the version itself (disk_delta's, under the engine's step lock) is all.
    log.clear()
    tr.traits = msgspec.structs.replace(tr.traits, sets_version=True)
    await pub.publish(3, run_update(tr, 3))
    assert steps(log) == ["begin", "bucket", "finish", "prepare", "commit"]
    # A refused prepare changes nothing and never pauses.
    log.clear()
    tr.fail_at = "prepare"
    with pytest.raises(WeightPublishError) as err:
        await pub.publish(4, run_update(tr, 4))
    assert err.value.step == "prepare" and "nothing was changed" in str(err.value)
    assert "never paused" in str(err.value)
    assert steps(log) == ["begin", "bucket", "finish", "prepare", "abandon"]
    await pub.close()


async def test_engines_that_do_not_resume_are_reported(engines):
    fakes, log = engines
    fakes[0].fail["/continue_generation"] = 400
    tr = Recording(log)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    with pytest.raises(WeightPublishError, match="the weights are in, but /continue_generation failed"):
        await pub.publish(1, run_update(tr))
    await pub.close()


async def test_check_weights_names_the_first_differing_parameter(engines):
    fakes, log = engines
    tap = ChecksumTap(Recording(log), "sha256")
    good = {"a": tensor_sha256(torch.ones(2)), "b": tensor_sha256(torch.zeros(1))}
    for f in fakes:
        f.checksums = dict(good)
    pub = WeightPublisher(WeightsConfig(check_weights=True, checksum="sha256", **FAST),
                          [f.url for f in fakes], tap)
    report = await pub.publish(1, run_update(tap))
    assert report.checked and tap.checksum_dtype == torch.float32
    fakes[1].checksums["b"] = "0" * 64
    with pytest.raises(WeightsMismatch, match=r"version 2 on engine .*1 of 2 parameters differ .* first: b "):
        await pub.publish(2, run_update(tap, 2))
    fakes[1].checksums = {**good, "c": "1" * 64}
    with pytest.raises(WeightsMismatch,
                       match=r"1 engine parameters were not sent by the trainer, e.g. \['c'\]"):
        await pub.publish(3, run_update(tap, 3))
    # check_weights needs the tap that make_transport adds.
    plain = WeightPublisher(WeightsConfig(check_weights=True, **FAST), [fakes[0].url], Recording(log))
    with pytest.raises(ValueError, match="needs a transport built by make_transport"):
        await plain.publish(4, lambda: None)
    await pub.close()


async def test_a_gated_transport_gathers_while_the_engines_pause(engines):
    fakes, log = engines
    tr = Gated(log)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    await pub.publish(1, run_update(tr))
    order = steps(log)
    # The gather may start before the pause answers; nothing reaches an engine before it has.
    assert order.index("bucket") > order.index("pause_generation")
    assert order[-2:] == ["update_weight_version", "continue_generation"]
    assert tr.send_gate is None  # the gate belongs to one publish
    # Pause refused: the gate closes, the gather still runs to its end (collective), nothing is sent.
    log.clear()
    fakes[0].fail["/pause_generation"] = 400
    with pytest.raises(WeightPublishError) as err:
        await pub.publish(2, run_update(tr, 2))
    assert err.value.step == "pause"
    whats = [what for _, what, _ in log]
    assert "finish" in whats and "bucket" not in whats
    assert any(w.startswith("gate closed: version 2: the engines could not be paused") for w in whats)
    await pub.close()


class Slow(Recording):
    """A transfer of `transfer_s` whose last `load_s` is the engines loading (as nccl's barrier)."""

    def __init__(self, log, transfer_s: float, load_s: float, **kw):
        super().__init__(log, **kw)
        self.transfer_s, self.load = transfer_s, load_s

    def finish(self, version):
        time.sleep(self.transfer_s - self.load)
        t = time.perf_counter()
        time.sleep(self.load)
        self._stats.load_s = time.perf_counter() - t
        self._step("finish")

    def commit(self, version):
        if not self.traits.pauses_engines:  # disk_delta's swap; a paused commit is a no-op
            time.sleep(self.load)
        self._step("commit")


def assert_stall_adds_up(report):
    m = report.metrics()
    parts = ("weights/pause_s", "weights/transfer_s", "weights/load_s", "weights/version_s",
             "weights/resume_s")
    assert m["weights/stall_s"] == pytest.approx(sum(m[k] for k in parts), abs=1e-9)
    assert all(m[k] >= 0 for k in parts)
    assert m["weights/stall_s"] <= m["weights/publish_s"]
    return m


async def test_stall_time_is_pause_transfer_load_version_resume(engines):
    fakes, log = engines
    for f in fakes:
        f.delay = {"/pause_generation": 0.1, "/update_weight_version": 0.05,
                   "/continue_generation": 0.07}
    tr = Slow(log, transfer_s=0.3, load_s=0.12)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    m = assert_stall_adds_up(await pub.publish(3, run_update(tr, 3)))
    assert 0.1 <= m["weights/pause_s"] < 0.3
    assert 0.12 <= m["weights/load_s"] < 0.25
    assert 0.18 <= m["weights/transfer_s"] < 0.35   # the transfer less its load tail
    assert 0.05 <= m["weights/version_s"] < 0.2 and 0.07 <= m["weights/resume_s"] < 0.2
    assert m["weights/background_s"] == 0.0 and m["weights/bytes"] == 24
    await pub.close()


async def test_a_gated_transfer_stalls_only_for_what_outlasts_the_pause(engines):
    fakes, log = engines
    for f in fakes:
        f.delay = {"/pause_generation": 0.3}
    tr = Slow(log, transfer_s=0.1, load_s=0.0)
    tr.traits = TransportTraits(send_gate=True)  # its finish touches no engine: the gather overlaps the pause fully
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    m = assert_stall_adds_up(await pub.publish(1, run_update(tr)))
    assert m["weights/pause_s"] >= 0.3 and m["weights/transfer_s"] < 0.05
    await pub.close()


async def test_disk_delta_stalls_for_the_swap_only(engines):
    fakes, log = engines
    for f in fakes:  # were they asked, these would show in the stall
        f.delay = {"/pause_generation": 0.3, "/continue_generation": 0.3}
    tr = Slow(log, transfer_s=0.2, load_s=0.1, pauses_engines=False)
    tr.traits = TransportTraits(pauses_engines=False, sets_version=True)
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    m = assert_stall_adds_up(await pub.publish(1, run_update(tr)))
    assert m["weights/transfer_s"] == 0.0 and 0.1 <= m["weights/load_s"] < 0.25  # commit
    assert m["weights/pause_s"] == m["weights/resume_s"] == 0.0  # never paused
    assert m["weights/stall_s"] == pytest.approx(m["weights/load_s"] + m["weights/version_s"])
    assert m["weights/background_s"] >= 0.2  # transfer (and prepare) while serving
    assert m["weights/stall_s"] < m["weights/publish_s"] - 0.15
    await pub.close()


async def test_a_paused_commit_that_fails_is_named_and_abandoned(engines):
    fakes, log = engines
    tr = Recording(log)
    tr.fail_at = "commit"
    pub = WeightPublisher(WeightsConfig(**FAST), [f.url for f in fakes], tr)
    with pytest.raises(WeightPublishError) as err:
        await pub.publish(5, run_update(tr, 5))
    assert err.value.step == "commit" and "Engines were resumed" in str(err.value)
    assert steps(log) == ["pause_generation", "begin", "bucket", "finish", "prepare", "commit",
                          "abandon", "continue_generation"]
    await pub.close()


class Tagging(DelegatingTransport):
    """A user-style wrapper: renames every tensor, states nothing else."""

    def send(self, version, buckets):
        self.inner.send(version, ([("t." + n, t) for n, t in b] for b in buckets))


def test_a_wrapper_forwards_the_traits_whole_and_transforms_the_buckets():
    log = []
    inner = Recording(log, pauses_engines=False)
    inner.traits = TransportTraits(sender=False, pauses_engines=False, sets_version=True,
                                   send_gate=True)
    wrapped = Tagging(inner)
    assert wrapped.traits is inner.traits
    wrapped.send_gate = gate = object()
    assert inner.send_gate is gate
    seen = []
    inner.send_bucket = lambda named: seen.extend(n for n, _ in named)
    inner.traits = TransportTraits()
    send_weights(wrapped, 1, [[("a", torch.ones(1))], [("b", torch.ones(1))]])
    assert seen == ["t.a", "t.b"]


def test_send_weights_iterates_every_bucket_on_every_rank():
    """The gather is collective: a rank that does not send, or whose transport failed, still
    walks every bucket, and the failure is raised afterwards."""
    log, walked = [], []

    def buckets():
        for i in range(4):
            walked.append(i)
            yield [(f"w{i}", torch.ones(1))]

    idle = Recording(log)
    idle.traits = TransportTraits(sender=False)
    send_weights(idle, 1, buckets())
    assert walked == [0, 1, 2, 3] and log == []
    walked.clear()
    failing = Recording(log)
    failing.fail_at = "bucket"
    with pytest.raises(RuntimeError, match="bucket broke"):
        send_weights(failing, 1, buckets())
    assert walked == [0, 1, 2, 3]
