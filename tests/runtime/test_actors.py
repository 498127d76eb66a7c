"""Actors over real ZeroMQ sockets: calls, errors, timeouts, streams with backpressure, fuzzing."""

import asyncio
import random
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from miles.runtime import Actor, ActorTimeout, Registry, RemoteError, Runtime
from miles.wire.codec import encode
from miles.wire.messages import (GetMetrics, Header, ListActors, Message, Ok, Ping, Pong, Sample,
                                 SampleBatch, StreamSummary)


class Add(Message):
    a: int
    b: int


class Sum(Message):
    value: int


class Boom(Message):
    pass


class Sleep(Message):
    seconds: float


class Note(Message):
    text: str


class Unhandled(Message):
    pass


class Calc(Actor):
    def __init__(self, name="calc"):
        super().__init__(name)
        self.notes: list[str] = []
        self.consumed = 0

    async def on_add(self, msg: Add) -> Sum:
        return Sum(value=msg.a + msg.b)

    async def on_boom(self, msg: Boom) -> Ok:
        raise KeyError("no such thing")

    async def on_sleep(self, msg: Sleep) -> Ok:
        await asyncio.sleep(msg.seconds)
        return Ok()

    async def on_note(self, msg: Note) -> None:
        self.notes.append(msg.text)

    async def on_stream(self, topic, items):
        n = 0
        async for batch in items:
            if topic == "slow":
                await asyncio.sleep(0.02)
            n += len(batch.samples)
            self.consumed = n
        return StreamSummary(topic=topic, items=n)


@pytest.fixture
async def system():
    rt = Runtime()
    registry = Registry()
    rt.registry_endpoint = await registry.start(rt, register=False)
    calc = Calc()
    await calc.start(rt)
    client = Runtime(registry=rt.registry_endpoint)
    yield client, calc, registry
    client.close()
    await calc.close()
    await registry.close()
    rt.close()


async def test_call_tell_and_typed_dispatch(system):
    client, calc, _ = system
    ref = client.ref("calc")
    assert await ref.call(Add(a=2, b=3), timeout_s=5) == Sum(value=5)
    assert (await ref.call(Ping(payload=b"x"))).payload == b"x"
    await ref.tell(Note(text="hello"))
    for _ in range(100):
        if calc.notes:
            break
        await asyncio.sleep(0.01)
    assert calc.notes == ["hello"]
    results = await asyncio.gather(*(ref.call(Add(a=i, b=i)) for i in range(200)))
    assert [r.value for r in results] == [2 * i for i in range(200)]


async def test_remote_errors_and_timeouts_are_clear(system):
    client, _, _ = system
    ref = client.ref("calc")
    with pytest.raises(RemoteError, match="KeyError in actor calc: 'no such thing'"):
        await ref.call(Boom())
    with pytest.raises(RemoteError, match="no handler for Unhandled"):
        await ref.call(Unhandled())
    t = time.monotonic()
    with pytest.raises(ActorTimeout, match="did not answer Sleep within 0.2s"):
        await ref.call(Sleep(seconds=5), timeout_s=0.2)
    assert time.monotonic() - t < 1.0
    with pytest.raises(ActorTimeout, match="not available"):
        await client.ref("nobody").call(Ping(), timeout_s=0.3)
    assert (await ref.call(Add(a=1, b=1))).value == 2  # still serving


async def test_registry_wait_for_and_listing(system):
    client, _, registry = system

    async def late_start():
        await asyncio.sleep(0.3)
        late = Calc("late")
        await late.start(client)
        return late

    task = asyncio.create_task(late_start())
    info = await client.lookup("late", wait_s=5)
    assert info.alive and info.endpoint.startswith("tcp://127.0.0.1:")
    assert (await client.ref("late").call(Add(a=1, b=2))).value == 3
    names = [a.name for a in (await client.registry.call(ListActors())).actors]
    assert names == ["calc", "late"]
    await (await task).close()


async def test_stream_backpressure_slows_producer_and_drops_nothing(system):
    client, calc, _ = system
    ref = client.ref("calc")
    batch = SampleBatch(samples=[Sample(tokens=np.zeros(1024, np.int32), response_length=0)] * 4)
    lead = []
    async with ref.stream("slow") as s:
        for _ in range(60):
            await s.send(batch)
            lead.append(s.sent * 4 - calc.consumed)
    assert s.result == StreamSummary(topic="slow", items=240)
    # the sender never ran more than the credit window (16 batches of 4) ahead of the consumer
    assert max(lead) <= (calc.stream_window + 1) * 4
    assert min(lead[20:]) > 0


async def test_stream_handler_error_reaches_sender(system):
    client, _, _ = system
    with pytest.raises(RemoteError, match="AttributeError in actor calc: 'Boom' object has no attribute"):
        async with client.ref("calc").stream("x") as s:
            await s.send(Boom())  # Calc iterates and reads .samples of a Boom: AttributeError
            await asyncio.sleep(0.1)
            await s.send(Boom())


async def test_fuzz_10000_bad_frames_are_counted_and_calls_still_answered(system):
    client, calc, _ = system
    rng = random.Random(0)
    good = [bytes(f) for f in encode("call", Add(a=1, b=2), 1)]
    kinds = []
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(calc.server.endpoint)
    ref = client.ref("calc")
    sent_bad = 0
    for i in range(10_000):
        choice = rng.randrange(6)
        if choice == 0:
            frames = [rng.randbytes(rng.randrange(1, 64))]
        elif choice == 1:
            frames = [good[0], good[1][: rng.randrange(len(good[1]))]]
        elif choice == 2:
            frames = [good[0], msgspec.msgpack.encode({"type": "Add", "a": "x", "b": 2})]
        elif choice == 3:
            frames = [msgspec.msgpack.encode(Header(1, "call", i, "fz", 3)), good[1]]
        elif choice == 4:
            frames = [msgspec.msgpack.encode(Header(7, "call", i, "fz", 0)), good[1]]
        else:
            frames = [rng.randbytes(8), rng.randbytes(rng.randrange(0, 200)), rng.randbytes(4)]
        kinds.append(choice)
        await sock.send_multipart(frames)
        sent_bad += 1
        if i % 500 == 0:
            assert (await ref.call(Add(a=i, b=1), timeout_s=10)).value == i + 1
    for _ in range(400):
        if calc.server.bad_frames >= sent_bad:
            break
        await asyncio.sleep(0.025)
    assert calc.server.bad_frames == sent_bad
    metrics = (await ref.call(GetMetrics())).values
    assert metrics["bad_frames"] == sent_bad
    assert (await ref.call(Add(a=40, b=2))).value == 42
    # refused calls whose header was readable got an error reply naming the problem
    replies = 0
    while await sock.poll(50):
        frames = await sock.recv_multipart()
        replies += 1
    assert replies >= kinds.count(2)
    sock.close(0)


async def test_loop_lag_is_measured(system):
    client, calc, _ = system
    time.sleep(0.3)  # block the shared loop on purpose
    await asyncio.sleep(0.1)
    metrics = (await client.ref("calc").call(GetMetrics())).values
    assert metrics["loop_lag_max_ms"] >= 200
