"""The buffer journal: a restarted buffer comes back with every group it accepted, its slot
table, its version and the rollout's data position (issue 15, item 3)."""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from miles.runtime import Registry, Runtime
from miles.actors.buffer import Buffer
from miles.wire.journal import Journal
from miles.config import load_recipe, recipe_to_json
from miles.rl.sources import with_default_actors
from miles.wire.messages import (ConfirmBatch, GetBatch, GetRolloutResume, Group, NoteRolloutStart,
                                 Ok, PutGroup, Reserve, Sample, SetVersion, VersionSpan)

ROOT = Path(__file__).resolve().parents[2]


def group(gid, prompt_index, version=0, rewards=(1.0, 0.0), status="completed"):
    return Group(group_id=gid, prompt_index=prompt_index, samples=[
        Sample(tokens=np.arange(5 + i, dtype=np.int32), response_length=2, reward=r, status=status,
               rollout_logprobs=np.array([-0.5, -0.25], np.float32),
               weight_versions=[VersionSpan(version, 0, 2)], group_id=gid, index=i)
        for i, r in enumerate(rewards)])


async def fill(b):
    """Drive a buffer through every state: out, queued, retry, generating, handed back."""
    b.on_note_rollout_start(NoteRolloutStart(data_state={"position": 0}, owner=0))
    for i in range(5):
        await b.on_reserve(Reserve(prompt_index=i, data_state={"position": i + 1},
                                   request_id=f"0-{i}", owner=0, timeout_s=5))
    await b.on_put_group(PutGroup(group=group("g0", 0), slot=0, owner=0))
    await b.on_put_group(PutGroup(group=group("g1", 1), slot=1, owner=0))
    await b.on_put_group(PutGroup(group=group("g2", 2, status="failed"), slot=2, owner=0))  # retry
    await b.on_put_group(PutGroup(group=group("g4", 4, rewards=(1.0, 1.0)), slot=4, owner=0))  # filtered
    out = await b.on_get_batch(GetBatch(n_groups=1, request_id="step1"))
    await b.on_set_version(SetVersion(version=1))
    return out


def same_state(a, b):
    assert a.slot_table() == b.slot_table()
    assert (a.version, a.next_slot, a.handed_back, sorted(a.queue)) == \
        (b.version, b.next_slot, b.handed_back, sorted(b.queue))
    assert (a.rollout_data, a.batches, a.counts) == (b.rollout_data, b.batches, b.counts)


def new_buffer(path, restore, compact_records=2000):
    b = Buffer()
    b.configure(groups_per_step=2, max_staleness=2, filter_spec="nonzero_std")
    b.compact_records = compact_records
    b.open_journal(path, restore=restore)
    return b


@pytest.mark.parametrize("compact_records", [2000, 3])
async def test_journal_replays_to_the_same_state(tmp_path, compact_records):
    path = tmp_path / "buffer" / "journal.bin"
    a = new_buffer(path, restore=False, compact_records=compact_records)
    out = await fill(a)
    b = new_buffer(path, restore=True)
    same_state(a, b)
    assert [row["state"] for row in b.slot_table()] == ["out", "queued", "retry", "generating"]
    again = await b.on_get_batch(GetBatch(n_groups=1, request_id="step1"))  # the same groups
    assert [g.group_id for g in again.groups] == [g.group_id for g in out.groups] == ["g0"]
    for x, y in zip(again.groups[0].samples, out.groups[0].samples):
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.rollout_logprobs, y.rollout_logprobs)
    if compact_records == 3:
        assert len(Journal(path).read()) < 3  # rewritten as a snapshot, not grown record by record


async def test_incarnation_zero_starts_empty_and_a_torn_tail_is_cut(tmp_path):
    path = tmp_path / "journal.bin"
    a = new_buffer(path, restore=False)
    await fill(a)
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # the start of a record, killed mid-write
    b = new_buffer(path, restore=True)
    same_state(a, b)
    assert new_buffer(path, restore=False).slot_table() == []  # a new job: the old journal goes


def _spawn_buffer(recipe_json: Path, registry: str, incarnation: int):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env.update(MILES_ACTOR_NAME="buffer", MILES_ACTOR_CLASS="miles.actors.buffer:Buffer",
               MILES_ACTOR_ROLE="buffer", MILES_REGISTRY=registry, MILES_RECIPE=str(recipe_json),
               MILES_INCARNATION=str(incarnation))
    return asyncio.create_subprocess_exec(sys.executable, "-m", "miles.runtime.host", cwd=ROOT, env=env)


async def test_sigkilled_buffer_process_comes_back_from_its_journal(tmp_path):
    recipe = with_default_actors(load_recipe(ROOT / "recipes" / "quickstart.toml", overrides=[
        f"run.output_dir={json.dumps(str(tmp_path))}", "loop.groups_per_step=2", "loop.max_staleness=1",
        'buffer.filter="none"']))
    assert "buffer" in recipe.actors
    recipe_json = tmp_path / "recipe.json"
    recipe_json.write_bytes(recipe_to_json(recipe))
    rt, reg = Runtime(), Registry()
    rt.registry_endpoint = await reg.start(rt, register=False)
    client = Runtime(registry=rt.registry_endpoint)
    procs = []
    try:
        procs.append(await _spawn_buffer(recipe_json, rt.registry_endpoint, 0))
        info = await client.lookup("buffer", wait_s=60)
        ref = client.ref_at(info.endpoint, "buffer")
        await ref.call(NoteRolloutStart(data_state={"position": 0}, owner=0))
        slots = [(await ref.call(Reserve(prompt_index=i, data_state={"position": i + 1},
                                         request_id=f"0-{i}", owner=0))).slot for i in range(3)]
        for s in slots:
            await ref.call(PutGroup(group=group(f"g{s}", s), slot=s, owner=0))
        out = await ref.call(GetBatch(n_groups=2, request_id="step1"))
        await ref.call(SetVersion(version=1))
        procs[0].send_signal(signal.SIGKILL)
        await procs[0].wait()

        procs.append(await _spawn_buffer(recipe_json, rt.registry_endpoint, 1))
        info = await client.lookup("buffer", wait_s=60, min_incarnation=1)
        ref = client.ref_at(info.endpoint, "buffer")
        again = await ref.call(GetBatch(n_groups=2, request_id="step1"))     # the driver's re-send
        assert [g.group_id for g in again.groups] == [g.group_id for g in out.groups] == ["g0", "g1"]
        assert again.version == out.version == 0 and again.staleness == out.staleness
        assert isinstance(await ref.call(ConfirmBatch(request_id="step1")), Ok)
        resume = await ref.call(GetRolloutResume(owner=1))
        assert resume.started and resume.data_state == {"position": 3} and resume.orphans == []
        resent = await ref.call(Reserve(prompt_index=2, request_id="0-2"))  # a lost reply's re-send
        assert (resent.slot, resent.version) == (2, 1)                       # the version came back
        nxt = await ref.call(GetBatch(n_groups=1, request_id="step2"), timeout_s=10)
        assert [g.group_id for g in nxt.groups] == ["g2"]                   # nothing lost
        assert (tmp_path / "buffer" / "journal.bin").exists()
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGKILL)
                await p.wait()
        client.close()
        await reg.close()
        rt.close()
