"""The buffer over real sockets: backpressure, admission-based staleness control, policies."""

import asyncio

import numpy as np
import pytest

from miles.runtime import Registry, Runtime
from miles.actors.buffer import Buffer, BufferPolicy, Decision
from miles.wire.messages import (BufferMetricsRequest, ConfirmBatch, GetBatch, GetRolloutResume,
                                 Group, NoteRolloutStart, PutGroup, ReleaseSlot, Reserve, Sample,
                                 SetVersion, VersionSpan)


def group(gid, version=0, rewards=(1.0, 0.0), status="completed"):
    return Group(group_id=gid, samples=[
        Sample(tokens=np.arange(4, dtype=np.int32), response_length=2, reward=r, status=status,
               weight_versions=[VersionSpan(version, 0, 2)], group_id=gid) for r in rewards])


@pytest.fixture
async def buf():
    rt = Runtime()
    reg = Registry()
    rt.registry_endpoint = await reg.start(rt, register=False)
    b = Buffer()
    await b.start(rt)
    client = Runtime(registry=rt.registry_endpoint)
    yield b, client.ref("buffer")
    client.close()
    await b.close()
    await reg.close()
    rt.close()


async def reserve_nowait(ref, timeout_s=0.3):
    try:
        return await ref.call(Reserve(timeout_s=timeout_s), timeout_s=timeout_s + 5)
    except Exception:
        return None


async def test_admission_sync_allows_one_step_then_waits_for_the_version(buf):
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=0)
    slots = [await ref.call(Reserve()) for _ in range(2)]
    assert [s.slot for s in slots] == [0, 1] and all(s.version == 0 for s in slots)
    assert await reserve_nowait(ref) is None            # a third would be off-policy
    for s in slots:
        await ref.call(PutGroup(group=group(f"g{s.slot}"), slot=s.slot))
    batch = await ref.call(GetBatch(n_groups=2))
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]
    assert await reserve_nowait(ref) is None            # consumed, but weights not published yet
    await ref.call(SetVersion(version=1))
    assert (await ref.call(Reserve())).version == 1


async def test_admission_window_grows_with_staleness(buf):
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=2)
    got = [await reserve_nowait(ref) for _ in range(7)]
    assert sum(g is not None for g in got) == 6         # (0 + 1 + 2) * 2 groups ahead


async def test_put_waits_when_full_backpressure_not_drop(buf):
    b, ref = buf
    b.configure(capacity_groups=2, groups_per_step=1, max_staleness=10)
    slots = [(await ref.call(Reserve())).slot for _ in range(3)]
    for s in slots[:2]:
        assert (await ref.call(PutGroup(group=group(f"g{s}"), slot=s))).decision == "keep"
    third = asyncio.create_task(ref.call(PutGroup(group=group("g2"), slot=slots[2])))
    await asyncio.sleep(0.3)
    assert not third.done()                             # blocked: the buffer is full
    batch = await ref.call(GetBatch(n_groups=1))
    assert batch.groups[0].group_id == "g0"
    assert (await asyncio.wait_for(third, 5)).decision == "keep"
    rest = await ref.call(GetBatch(n_groups=2))
    assert [g.group_id for g in rest.groups] == ["g1", "g2"]    # nothing lost, in slot order


async def test_slow_group_is_trained_not_starved(buf):
    """A slow group holds the admission window: faster ones overtake it by a bounded amount, and
    it is trained within max_staleness + 1 versions instead of being overtaken forever."""
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=1)
    slots = [(await ref.call(Reserve())).slot for _ in range(4)]
    assert slots == [0, 1, 2, 3]
    for s in slots[1:]:                                  # slot 0 is the straggler
        await ref.call(PutGroup(group=group(f"fast{s}"), slot=s))
    batch = await ref.call(GetBatch(n_groups=2))
    assert [g.group_id for g in batch.groups] == ["fast1", "fast2"]
    await ref.call(SetVersion(version=1))
    assert (await ref.call(Reserve())).slot == 4        # a 4th group may overtake the straggler
    assert await reserve_nowait(ref) is None            # a 5th may not: it holds the window
    get = asyncio.create_task(ref.call(GetBatch(n_groups=2)))
    await asyncio.sleep(0.2)
    assert not get.done()                               # fast3 alone is not a batch
    await ref.call(PutGroup(group=group("slow", version=0), slot=0))
    batch = await asyncio.wait_for(get, 5)
    assert sorted(g.group_id for g in batch.groups) == ["fast3", "slow"]
    assert max(batch.staleness) <= 1
    await ref.call(SetVersion(version=2))
    assert (await ref.call(Reserve())).slot == 5        # the window moves on


async def test_policies_retry_drop_filter_and_stale_are_counted(buf):
    b, ref = buf
    b.configure(groups_per_step=1, max_staleness=0, filter_spec="nonzero_std",
                policy=BufferPolicy(max_retries=1, stale_action="drop"))
    s0 = (await ref.call(Reserve())).slot
    failed = group("bad", status="failed")
    assert (await ref.call(PutGroup(group=failed, slot=s0))).decision == "retry"
    failed.samples[0].metadata["retries"] = 1
    assert (await ref.call(PutGroup(group=failed, slot=s0))).decision == "drop"
    s1 = (await ref.call(Reserve())).slot                # the dropped slot was handed back
    reply = await ref.call(PutGroup(group=group("flat", rewards=(1.0, 1.0)), slot=s1))
    assert reply.decision == "drop" and "filter" in reply.reason
    s2 = (await ref.call(Reserve())).slot
    await ref.call(PutGroup(group=group("old", version=0), slot=s2))
    await ref.call(SetVersion(version=5))                # far beyond max_staleness + 1
    get = asyncio.create_task(ref.call(GetBatch(n_groups=1)))
    s3 = (await ref.call(Reserve(timeout_s=5), timeout_s=10)).slot  # "old" was rejected: window free
    await ref.call(PutGroup(group=group("fresh", version=5), slot=s3))
    batch = await asyncio.wait_for(get, 5)
    assert [g.group_id for g in batch.groups] == ["fresh"]
    m = (await ref.call(BufferMetricsRequest())).values
    assert (m["buffer/retried"], m["buffer/dropped"], m["buffer/filtered"], m["buffer/stale"]) == (1, 1, 1, 1)
    assert m["buffer/kept"] == 2 and m["buffer/groups_out"] == 1


async def test_completed_groups_in_the_queue_do_not_hold_the_window(buf):
    """Regression: with heavy filtering the queue held fewer groups than a batch while the
    anti-starvation window was anchored on them: the trainer and the rollout waited forever."""
    b, ref = buf
    b.configure(groups_per_step=4, max_staleness=0, filter_spec="nonzero_std")
    first = (await ref.call(Reserve())).slot
    await ref.call(PutGroup(group=group("kept"), slot=first))
    for _ in range(30):                                  # everything else is filtered out
        s = (await ref.call(Reserve(timeout_s=2), timeout_s=5)).slot
        assert (await ref.call(PutGroup(group=group("flat", rewards=(0.0, 0.0)), slot=s))).decision == "drop"
    assert (await ref.call(Reserve(timeout_s=2), timeout_s=5)).slot == 31


async def test_release_slot_and_user_policy(buf):
    b, ref = buf

    class KeepOnlyEven(BufferPolicy):
        def on_put(self, g):
            return Decision("keep") if int(g.group_id[1:]) % 2 == 0 else Decision("drop", "odd")

    b.configure(groups_per_step=1, max_staleness=0, policy=KeepOnlyEven())
    s = (await ref.call(Reserve())).slot
    assert (await ref.call(PutGroup(group=group("g1"), slot=s))).reason == "odd"
    s = (await ref.call(Reserve())).slot
    await ref.call(ReleaseSlot(slot=s, reason="prompt failed for good"))
    s = (await ref.call(Reserve())).slot
    assert (await ref.call(PutGroup(group=group("g2"), slot=s))).decision == "keep"


# ----- the slot state machine, two-phase batches, idempotent re-sends (issue 15) ---------------

def states(b):
    return {row["slot"]: row["state"] for row in b.slot_table()}


async def test_slot_table_follows_the_state_machine(buf):
    b, ref = buf
    b.configure(groups_per_step=1, max_staleness=1)
    r = await ref.call(Reserve(prompt_index=7, data_state={"position": 8}))
    assert states(b) == {0: "generating"} and b.slot_table()[0]["prompt_index"] == 7
    assert (await ref.call(PutGroup(group=group("bad", status="failed"), slot=r.slot))).decision == "retry"
    assert states(b) == {0: "retry"} and b.slot_table()[0]["attempt"] == 1
    assert (await ref.call(PutGroup(group=group("good"), slot=r.slot))).decision == "keep"
    assert states(b) == {0: "queued"}
    batch = await ref.call(GetBatch(n_groups=1, request_id="step1"))
    assert states(b) == {0: "out"} and [g.group_id for g in batch.groups] == ["good"]
    again = await ref.call(GetBatch(n_groups=1, request_id="step1"))   # a re-send: the same groups
    assert [g.group_id for g in again.groups] == ["good"]
    m = (await ref.call(BufferMetricsRequest())).values
    assert (m["buffer/slots_out"], m["buffer/slots_queued"], m["buffer/trained"]) == (1, 0, 0)
    await ref.call(ConfirmBatch(request_id="step1"))
    await ref.call(ConfirmBatch(request_id="step1"))                   # idempotent
    m = (await ref.call(BufferMetricsRequest())).values
    assert states(b) == {} and m["buffer/trained"] == 1 and m["buffer/batches"] == 1


async def test_get_batch_that_times_out_midway_puts_back_what_it_popped(buf):
    """Regression: a GetBatch that popped some groups and then timed out (or was cancelled)
    lost them; the next GetBatch waited for groups that were gone."""
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=1)
    s = (await ref.call(Reserve())).slot
    await ref.call(PutGroup(group=group("g0"), slot=s))
    with pytest.raises(Exception, match="Timeout"):
        await ref.call(GetBatch(n_groups=2, timeout_s=0.3), timeout_s=10)
    assert states(b) == {0: "queued"} and len(b.queue) == 1
    s = (await ref.call(Reserve())).slot
    await ref.call(PutGroup(group=group("g1"), slot=s))
    batch = await ref.call(GetBatch(n_groups=2), timeout_s=5)
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]


async def test_reserve_and_put_re_sent_after_a_lost_reply_change_nothing(buf):
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=0)
    first = await ref.call(Reserve(prompt_index=3, request_id="r-1"))
    again = await ref.call(Reserve(prompt_index=3, request_id="r-1"))
    assert first.slot == again.slot == 0 and b.next_slot == 1
    put = PutGroup(group=group("g"), slot=0)
    assert (await ref.call(put)).decision == "keep"
    assert (await ref.call(put)).reason == "already accepted"
    m = (await ref.call(BufferMetricsRequest())).values
    assert m["buffer/kept"] == 1 and m["buffer/queue_groups"] == 1


async def test_a_restarted_rollout_takes_over_the_orphaned_slots(buf):
    b, ref = buf
    b.configure(groups_per_step=4, max_staleness=0)
    await ref.call(NoteRolloutStart(data_state={"position": 10}, replay=[2], owner=0))
    await ref.call(Reserve(prompt_index=2, data_state={"position": 10}, replay=[], owner=0))
    await ref.call(Reserve(prompt_index=10, data_state={"position": 11}, owner=0))
    await ref.call(Reserve(prompt_index=11, data_state={"position": 12}, owner=0))
    await ref.call(PutGroup(group=group("g", rewards=(1.0, 0.0)), slot=2, owner=0))
    resume = await ref.call(GetRolloutResume(owner=1))
    assert resume.started and resume.data_state == {"position": 12} and resume.replay == []
    assert [(o.slot, o.prompt_index) for o in resume.orphans] == [(0, 2), (1, 10)]
    late = await ref.call(PutGroup(group=group("ghost"), slot=0, owner=0))   # the dead incarnation
    assert late.decision == "drop" and "incarnation 1" in late.reason
    assert (await ref.call(PutGroup(group=group("redo"), slot=0, owner=1))).decision == "keep"
    with pytest.raises(Exception, match="incarnation 1 owns"):
        await ref.call(Reserve(prompt_index=12, owner=0))


async def test_sync_mode_retry_keeps_its_slot_and_needs_no_new_one(buf):
    """The buffer side of the sync-mode deadlock: with max_staleness 0 a retried group keeps its
    slot, no new slot opens, and the retry's put completes the batch."""
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=0)
    s0, s1 = [(await ref.call(Reserve(prompt_index=i))).slot for i in range(2)]
    await ref.call(PutGroup(group=group("a"), slot=s0))
    assert (await ref.call(PutGroup(group=group("b", status="failed"), slot=s1))).decision == "retry"
    assert await reserve_nowait(ref) is None              # no new slot: only the retry can finish
    await ref.call(PutGroup(group=group("b2"), slot=s1))
    assert [g.group_id for g in (await ref.call(GetBatch(n_groups=2))).groups] == ["a", "b2"]


async def test_dynamic_sampling_reads_dict_rewards_by_train_reward_key(buf):
    b, ref = buf
    b.configure(groups_per_step=1, max_staleness=3, filter_spec="nonzero_std", reward_key="acc")
    flat_acc = group("g", rewards=({"len": 1.0, "acc": 1.0}, {"len": 5.0, "acc": 1.0}))
    s = (await ref.call(Reserve())).slot       # the first value differs, the trained one does not
    assert (await ref.call(PutGroup(group=flat_acc, slot=s))).decision == "drop"
    s = (await ref.call(Reserve())).slot
    spread = group("h", rewards=({"len": 1.0, "acc": 0.0}, {"len": 1.0, "acc": 1.0}))
    assert (await ref.call(PutGroup(group=spread, slot=s))).decision == "keep"
