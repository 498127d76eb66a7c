"""Same-host bulk arrays through shared memory (miles/wire/shm.py), across real processes."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import numpy as np
import pytest

from miles.runtime import ActorDied, Runtime
from miles.config import ClusterConfig
from miles.wire import shm
from miles.wire.codec import Codec, ShmUnavailable, WireError
from miles.wire.messages import Sample, TrainStep
from tests.ports import cluster_port

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

# The receiver: a real actor in its own process. It answers a TrainStep with what it saw: a
# checksum of every array, whether all were read-only, and whether all were views of a mapping.
SINK = r'''
import asyncio, mmap, sys
import numpy as np
from miles.runtime import Actor, Runtime, run_event_loop
from miles.wire.messages import TrainResult, TrainStep

def mapped(a):
    while a is not None and not isinstance(a, mmap.mmap):  # ndarray -> memoryview -> mmap
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return a is not None

def checksum(arrays):
    return float(sum(int(a.view(np.uint8).sum(dtype=np.uint64)) for a in arrays))

def arrays_of(msg):
    return [a for s in msg.samples for a in (s.tokens, s.rollout_logprobs, s.routed_experts)]

class Sink(Actor):
    kept = []  # phase "sft" steps are kept: their arrays stay alive after the reply

    def on_train_step(self, msg: TrainStep) -> TrainResult:
        if msg.phase == "sft":
            self.kept.append(msg)
        arrays = arrays_of(msg)
        return TrainResult(metrics={
            "checksum": checksum(arrays),
            "read_only": float(all(not a.flags.writeable for a in arrays)),
            "mapped": float(all(mapped(a) for a in arrays)),
            "kept_checksum": sum(checksum(arrays_of(m)) for m in self.kept)})

async def main():
    actor = Sink("sink")
    print(await actor.start(Runtime(), register=False), flush=True)
    await actor.serve_forever()

run_event_loop(main())
'''


def _step(n_samples: int = 8, tokens: int = 2048, seed: int = 0, phase: str = "rl") -> TrainStep:
    rng = np.random.default_rng(seed)
    return TrainStep(phase=phase, samples=[Sample(
        tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), response_length=tokens // 2,
        rollout_logprobs=-rng.random(tokens // 2, dtype=np.float32),
        routed_experts=rng.integers(0, 64, (tokens - 1, 8, 8), dtype=np.uint8))
        for _ in range(n_samples)])


def _checksum(step: TrainStep) -> float:
    return float(sum(int(a.view(np.uint8).sum(dtype=np.uint64)) for s in step.samples
                     for a in (s.tokens, s.rollout_logprobs, s.routed_experts)))


def _array_bytes(step: TrainStep) -> int:
    return sum(s.tokens.nbytes + s.rollout_logprobs.nbytes + s.routed_experts.nbytes
               for s in step.samples)


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.job_prefix()))


@pytest.fixture
def job(monkeypatch):
    monkeypatch.setenv("MILES_JOB_ID", f"test-{uuid.uuid4().hex[:8]}")
    yield shm.job_prefix()
    shm.sweep(shm.job_prefix())


@pytest.fixture
def sink(job):
    proc = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        line = proc.stdout.readline()  # the endpoint; an exit gives "" at once
        assert line.startswith("tcp://") and time.monotonic() < deadline, \
            f"the sink process did not print its endpoint within 60 s (got {line!r})"
        yield proc, line.strip()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _call(endpoint: str, step: TrainStep, shm_min_bytes: int, timeout_s: float = 30.0):
    async def go():
        rt = Runtime(shm_min_bytes=shm_min_bytes)
        try:
            return await rt.ref_at(endpoint, "sink").call(step, timeout_s=timeout_s)
        finally:
            rt.close()
    return asyncio.run(go())


def test_round_trip_across_processes_is_zero_copy_and_read_only(sink):
    _, endpoint = sink
    step = _step()
    reply = _call(endpoint, step, shm_min_bytes=1 << 20)
    assert _array_bytes(step) > 1 << 20
    assert reply.metrics == {"checksum": _checksum(step), "read_only": 1.0, "mapped": 1.0,
                             "kept_checksum": 0.0}
    assert _leftovers() == [] and shm.owned() == frozenset()


def test_calls_reuse_pooled_segments_and_never_overwrite_arrays_still_held(sink):
    """A connection writes its calls into the same segment once the receiver has dropped the
    last call's arrays (its shm_free frame); a segment whose arrays are still held (a kept step)
    is never written again: the next calls take the second slot, then fresh segments."""
    _, endpoint = sink
    steps = [_step(seed=k) for k in range(3)]
    kept = [_step(seed=10 + k, phase="sft") for k in range(2)]

    async def released_to(pool, busy: int, what: str) -> None:
        deadline = time.monotonic() + 10
        while pool.busy() != busy:
            assert time.monotonic() < deadline, f"{what}: {pool.busy()} slot(s) busy after 10 s, expected {busy}"
            await asyncio.sleep(0.005)

    async def go():
        rt = Runtime(shm_min_bytes=1 << 20)
        try:
            ref = rt.ref_at(endpoint, "sink")
            await ref.call(TrainStep(samples=[]), timeout_s=30)
            pool = rt.connection(endpoint).shm_pool
            pooled = shm.stats["shm_pooled"]
            for k in range(6):
                reply = await ref.call(steps[k % 3], timeout_s=30)
                assert reply.metrics["checksum"] == _checksum(steps[k % 3]), k
                await released_to(pool, 0, f"call {k}")
            assert len(pool.names()) == 1 and shm.stats["shm_pooled"] - pooled == 5
            assert _leftovers() == pool.names()

            total = 0.0
            for j, step in enumerate(kept):  # each holds a slot from now on
                total += _checksum(step)
                reply = await ref.call(step, timeout_s=30)
                assert reply.metrics["kept_checksum"] == total
                await asyncio.sleep(0.2)
                assert pool.busy() == j + 1, "a slot whose arrays are still held was released"
                for k in range(3):  # the free slot (j = 0), then fresh segments (j = 1)
                    reply = await ref.call(steps[k], timeout_s=30)
                    assert reply.metrics["checksum"] == _checksum(steps[k])
                    assert reply.metrics["kept_checksum"] == total, "a held segment was overwritten"
                    await released_to(pool, j + 1, f"call {k} beside {j + 1} kept")
            assert len(pool.names()) == shm.POOL_SLOTS and _leftovers() == sorted(pool.names())
            name = pool.names()[0]
            assert not pool.release(name, 0) and not pool.release("miles-shm-nobody", 1)
        finally:
            rt.close()

    asyncio.run(go())
    assert _leftovers() == [] and shm.owned() == frozenset()


def test_threshold_zero_and_small_messages_travel_as_frames(sink):
    _, endpoint = sink
    step = _step(2, 256)
    for threshold in (0, _array_bytes(step) + 1):
        reply = _call(endpoint, step, shm_min_bytes=threshold)
        assert reply.metrics["checksum"] == _checksum(step) and reply.metrics["mapped"] == 0.0
    codec = Codec()
    plain = [bytes(f) for f in codec.encode("call", step, 3, "me")]
    for threshold in (0, _array_bytes(step) + 1):
        frames, segment = codec.encode_call("call", step, 3, "me", threshold)
        assert segment is None and [bytes(f) for f in frames] == plain
    frames, segment = codec.encode_call("call", step, 3, "me", _array_bytes(step))
    assert segment is not None and len(frames) == 3  # header, body, one reference
    shm.unlink(segment)


def test_a_segment_never_outlives_a_call_whose_receiver_was_sigkilled(sink, job):
    proc, endpoint = sink
    step = _step()

    async def go():
        rt = Runtime(shm_min_bytes=1 << 20)
        ref = rt.ref_at(endpoint, "sink")
        await ref.call(TrainStep(samples=[]), timeout_s=30)  # connected before the receiver stops
        os.kill(proc.pid, signal.SIGSTOP)  # it never reads the call, so it never unlinks
        call = asyncio.ensure_future(ref.call(step, timeout_s=60))
        deadline = time.monotonic() + 10
        while not _leftovers():
            assert time.monotonic() < deadline, "no segment appeared for the call within 10 s"
            await asyncio.sleep(0.01)
        assert len(_leftovers()) == 1 and _leftovers()[0].startswith(job)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(ActorDied):
            await asyncio.wait_for(call, 30)
        rt.close()

    asyncio.run(go())
    assert _leftovers() == [] and shm.owned() == frozenset()


def test_a_timed_out_call_unlinks_its_segment(sink):
    proc, endpoint = sink
    _call(endpoint, TrainStep(samples=[]), 1 << 20)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(Exception, match="did not answer"):
            _call(endpoint, _step(), 1 << 20, timeout_s=0.5)
        assert _leftovers() == []
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _shm_frames(step: TrainStep) -> tuple[list[bytes], str]:
    frames, segment = Codec().encode_call("call", step, 5, "me", 1)
    return [bytes(f) for f in frames], segment


@pytest.mark.parametrize("ref, expected", [
    (msgspec.msgpack.encode(("../../etc/passwd", 64)), "is not a Miles segment name"),
    (msgspec.msgpack.encode(("miles-shm-x-no-such-segment", 64)), "does not exist"),
    (msgspec.msgpack.encode(["only-a-name"]), "is not a shared-memory reference"),
    (b"\xc1", "is not a shared-memory reference"),
])
def test_a_bad_reference_is_a_wire_error_naming_the_field(job, ref, expected):
    frames, segment = _shm_frames(_step(1, 64))
    try:
        with pytest.raises(WireError, match=expected) as err:
            Codec().decode([frames[0], frames[1], ref])
        assert err.value.msg_type == "TrainStep" and err.value.field == "$.samples[0].tokens"
        assert isinstance(err.value, ShmUnavailable) == (expected == "does not exist")
    finally:
        shm.unlink(segment)


def test_a_reference_of_the_wrong_size_or_outside_its_segment_is_refused(job):
    frames, segment = _shm_frames(_step(1, 64))
    try:
        with pytest.raises(WireError, match="the reference says 64"):
            Codec().decode([frames[0], frames[1], msgspec.msgpack.encode((segment, 64))])
        body = msgspec.msgpack.encode({"type": "TrainStep", "samples": [{"type": "Sample",
            "tokens": msgspec.msgpack.Ext(2, msgspec.msgpack.encode((0, 1 << 40, "<i4", [4])))}]})
        with pytest.raises(WireError, match="lies outside") as err:
            Codec().decode([frames[0], body, frames[2]])
        assert err.value.field == "$.samples[0].tokens"
    finally:
        shm.unlink(segment)


def test_a_receiver_that_cannot_see_the_segment_gets_the_call_as_frames(sink, monkeypatch):
    """Host networking with a private /dev/shm: the receiver refuses, the sender re-sends."""
    _, endpoint = sink
    real = shm._create

    def elsewhere(name, size):  # the segment (fresh or pooled) goes where the receiver will not find it
        fd = real(name, size)
        os.rename(os.path.join(shm.SHM_DIR, name), os.path.join(shm.SHM_DIR, name + "-moved"))
        return fd
    monkeypatch.setattr(shm, "_create", elsewhere)
    step = _step()

    async def go():
        rt = Runtime(shm_min_bytes=1 << 20)
        try:
            ref = rt.ref_at(endpoint, "sink")
            first = await ref.call(step, timeout_s=30)
            conn = rt.connection(endpoint)
            return first, conn.shm_min_bytes
        finally:
            rt.close()

    reply, threshold_after = asyncio.run(go())
    assert reply.metrics["checksum"] == _checksum(step) and reply.metrics["mapped"] == 0.0
    assert threshold_after == 0
    for name in os.listdir(shm.SHM_DIR):
        if name.startswith(shm.job_prefix()) and name.endswith("-moved"):
            os.unlink(os.path.join(shm.SHM_DIR, name))


def test_same_host_and_defaults():
    env = {"MILES_HOST": "10.1.2.3"}
    assert shm.same_host("tcp://127.0.0.1:5000", env) and shm.same_host("tcp://[::1]:5000", env)
    assert shm.same_host("tcp://10.1.2.3:5000", env) and shm.same_host("ipc:///tmp/x", env)
    assert not shm.same_host("tcp://10.1.2.4:5000", env)
    assert shm.job_prefix({"MILES_REGISTRY": "tcp://10.0.0.1:29650"}) == "miles-shm-p29650-"
    assert shm.job_prefix({"MILES_JOB_ID": "a/b"}) == "miles-shm-a_b-"
    rt = Runtime()
    assert ClusterConfig().shm_min_bytes == shm.DEFAULT_MIN_BYTES == rt.shm_min_bytes
    rt.close()


def test_an_actor_takes_its_threshold_from_the_recipe():
    from types import SimpleNamespace

    from miles.runtime import Actor

    async def go():
        rt = Runtime()
        actor = Actor("a")
        actor.recipe = SimpleNamespace(cluster=SimpleNamespace(shm_min_bytes=12345))
        await actor.start(rt, register=False)
        try:
            conn = rt.connection("tcp://127.0.0.1:1")  # a same-host endpoint: takes the threshold
            far = rt.connection("tcp://192.0.2.1:1")     # another host: frames always
            return rt.shm_min_bytes, conn.shm_min_bytes, far.shm_min_bytes
        finally:
            await actor.close()
            rt.close()

    assert asyncio.run(go()) == (12345, 12345, 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quickstart_trains_through_shared_memory(tmp_path):
    """The real loop with every array-carrying call through shared memory (threshold 1 byte): the
    driver -> trainer TrainSteps of the SFT warm-start use it with no change at the call site, and
    a stopped run leaves no segment behind."""
    from tests.runtime.conftest import ROOT
    from miles.wire.messages import GetMetrics

    out, head = tmp_path / "run", cluster_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    log = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml"),
         "--set", "sft.steps=3", "--set", "cluster.shm_min_bytes=1",
         "--set", f'run.output_dir="{out}"', "--set", f"cluster.head_port={head}"],
        cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    prefix = shm.job_prefix({"MILES_REGISTRY": f"tcp://127.0.0.1:{head}"})

    async def shm_figures() -> dict[str, dict[str, float]]:
        rt = Runtime(registry=f"tcp://127.0.0.1:{head}")
        try:
            return {name: (await rt.ref(name).call(GetMetrics(), timeout_s=30)).values
                    for name in ("driver", "trainer/0")}
        finally:
            rt.close()

    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if '"sft_steps": 3' in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        tail = log.read_text(errors="replace")[-3000:]
        assert '"sft_steps": 3' in tail, f"the SFT warm-start did not finish within 300 s:\n{tail}"
        figures = asyncio.run(shm_figures())
        assert figures["driver"]["shm_sent"] >= 3, figures["driver"]
        assert figures["trainer/0"]["shm_received"] >= 3, figures["trainer/0"]
        # the trainer drops a step's arrays after it: the driver writes its next steps into the
        # segment it already has (shm.Pool), not into fresh ones
        assert figures["driver"]["shm_pooled"] >= 1, figures["driver"]
        proc.send_signal(signal.SIGTERM)  # the daemon stops every actor; their atexit hooks run
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix)) == []
