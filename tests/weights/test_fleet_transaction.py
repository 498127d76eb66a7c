"""Fleet-transactional weight versions (issue 40, item 4) with injected faults: every engine
switches to version v, or every engine stays on v-1.

Two real CPU embedded engines and a disk_delta publisher (check_weights on). One module-scoped
fleet, its versions counting up across the cases; the case that kills an engine runs last.
- a corrupted bucket (a chunk's bytes changed on disk after the trainer wrote them): every
  engine refuses it in prepare, nothing is swapped, the next delta is again against v-1;
- one engine's apply fails after both prepared (it lost what it staged):
  the engine that applied rolls back, both serve v-1 with v-1's exact weights, and the next
  publish goes through;
- an engine killed as prepare starts: the version is abandoned, the survivor stays on v-1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from miles.engines.client import EngineClient
from miles.weights import WeightPublisher, WeightsConfig, make_transport
from miles.weights.publisher import WeightPublishError
from weights_helpers import start_engines, stop_engines

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]


class Fleet:
    def __init__(self, model, engines, transport, publisher, clients):
        self.model, self.engines, self.transport = model, engines, transport
        self.publisher, self.clients = publisher, clients
        self.version = 0

    def run_update(self, version, after=None):
        def run():
            self.transport.send(version, [[(n, p.detach()) for n, p in self.model.named_parameters()]])
            if after is not None:
                after()
        return run

    def step(self, seed: int) -> None:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-2)

    async def publish(self, after=None):
        self.version += 1
        return await self.publisher.publish(self.version, self.run_update(self.version, after))

    async def versions(self, clients=None) -> list[str]:
        return [str((await c.model_info())["weight_version"]) for c in clients or self.clients]

    async def checksums(self, clients=None) -> list[dict]:
        return [await c.weights_checksum() for c in clients or self.clients]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory):
    from miles.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("fleet")
    path = build_tiny_model(num_hidden_layers=2)
    engines = await start_engines(path, 2, tmp)
    clients = [EngineClient(e.url, timeout_s=30, max_retries=0) for e in engines]
    cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp / "d"),
                        delta_threads=2, control_timeout_s=10.0, prepare_timeout_s=30.0,
                        commit_timeout_s=30.0)
    transport = make_transport(cfg, rank=0)
    publisher = WeightPublisher(cfg, [e.url for e in engines], transport)
    await publisher.connect()
    f = Fleet(AutoModelForCausalLM.from_pretrained(path).eval(), engines, transport, publisher, clients)
    assert (await f.publish()).checked                                   # v1, raw
    try:
        yield f
    finally:
        await publisher.close()
        transport.close()
        for c in clients:
            await c.close()
        await stop_engines(engines)


async def test_a_corrupted_bucket_is_refused_by_every_engine_and_nothing_moves(fleet):
    before_sums = await fleet.checksums()
    before = await fleet.versions()
    fleet.step(1)

    def corrupt():
        chunk = max(Path(fleet.transport.delta_dir).glob("*.bin"), key=lambda p: p.stat().st_size)
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))

    with pytest.raises(WeightPublishError, match=r"failed at step 'prepare'.*they hold their previous "
                                                 r"weights and version"):
        await fleet.publish(after=corrupt)
    assert await fleet.versions() == before
    assert await fleet.checksums() == before_sums
    report = await fleet.publish()           # the same weights again: a delta against v-1 still
    assert report.checked and fleet.transport.last_manifest.base_version == int(before[0])
    assert await fleet.versions() == [str(fleet.version)] * 2


async def test_a_commit_that_fails_on_one_engine_is_rolled_back_on_the_others(fleet):
    before = await fleet.versions()
    before_sums = await fleet.checksums()
    fleet.step(2)
    prepare = fleet.transport.prepare

    def prepare_then_interfere(version):
        prepare(version)
        # after both engines prepared, engine 1 loses what it staged: its apply refuses
        fleet.transport._calls.call_all("update_weights_from_delta", "discard", indices=[1])

    fleet.transport.prepare = prepare_then_interfere
    try:
        with pytest.raises(WeightPublishError, match=r"failed at step 'commit'.*"
                                                     r"nothing is prepared.*"
                                                     r"rolled back on \['http://127.0.0.1:\d+'\]"):
            await fleet.publish()
    finally:
        fleet.transport.prepare = prepare
    assert fleet.transport.rolled_back == [fleet.engines[0].url]
    assert await fleet.versions() == before                  # both on v-1 ...
    assert await fleet.checksums() == before_sums            # ... with v-1's exact bytes
    report = await fleet.publish()                           # and the next version goes through
    assert report.checked and fleet.transport.last_manifest.base_version == int(before[0])
    assert await fleet.versions() == [str(fleet.version)] * 2


async def test_an_engine_killed_as_prepare_starts_aborts_the_version(fleet):
    survivor = fleet.clients[0]
    before = await fleet.versions([survivor])
    before_sums = await fleet.checksums([survivor])
    fleet.step(3)
    prepare = fleet.transport.prepare

    def kill_then_prepare(version):
        fleet.engines[1].process.kill()
        prepare(version)

    fleet.transport.prepare = kill_then_prepare
    try:
        with pytest.raises(WeightPublishError, match=r"failed at step 'prepare'"):
            await fleet.publish()
    finally:
        fleet.transport.prepare = prepare
    assert await fleet.versions([survivor]) == before
    assert await fleet.checksums([survivor]) == before_sums
    with pytest.raises(Exception, match="rollback|nothing is kept"):   # nothing was applied
        await asyncio.wait_for(survivor.update_weights_from_delta("rollback"), 10)
