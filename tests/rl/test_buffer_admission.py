"""One admission rule: the buffer and the capacity model (`miles plan`) decide alike.

The buffer keeps its slot table from real messages (Reserve, PutGroup, ReleaseSlot, GetBatch,
SetVersion over real sockets); the plan keeps its simulated one (`plan._Window`). Both hand
their figures to `miles.actors.admission.admits`. Random scripts over a grid of groups per step
and staleness bounds must find them agreeing at every step, and the buffer must answer a
Reserve exactly when they say it may.
"""

import random

import pytest

from miles.actors.admission import admits
from miles.plan import _Window
from miles.wire.messages import GetBatch, PutGroup, ReleaseSlot, Reserve, SetVersion

from test_buffer import buf, group, reserve_nowait  # noqa: F401 - the fixture and helpers


def test_the_rules_on_plain_values():
    base = dict(handed_back=0, versions_published=0, groups_per_step=2, max_staleness=1,
                oldest_holding=None, back_after_oldest=0)
    assert admits(admitted=3, **base) and not admits(admitted=4, **base)             # rule A
    assert admits(admitted=5, **{**base, "handed_back": 2})                          # refilled
    assert not admits(admitted=5, **{**base, "versions_published": 1, "oldest_holding": 0})  # B
    assert admits(admitted=5, **{**base, "versions_published": 1, "oldest_holding": 0,
                                 "back_after_oldest": 1})


@pytest.mark.parametrize("groups_per_step,max_staleness", [(1, 0), (2, 0), (2, 1), (3, 2), (1, 3)])
async def test_buffer_and_plan_admit_alike(buf, groups_per_step, max_staleness):  # noqa: F811
    b, ref = buf
    G = groups_per_step
    b.configure(capacity_groups=1000, groups_per_step=G, max_staleness=max_staleness)
    window = _Window(G, max_staleness)
    rng = random.Random(100 * G + max_staleness)
    open_slots: list[int] = []   # reserved, not yet put or released
    started: dict[int, int] = {}  # slot -> the version it was reserved at
    queued = version = 0
    checks = opened = refused = 0
    for _ in range(200):
        expected = window.admits(version)
        assert b._admissible() == expected, (window.next_slot, version, open_slots)
        checks += 1
        op = rng.choice(["reserve"] * 3 + ["put", "put", "release", "train"])
        if op == "reserve":
            got = await reserve_nowait(ref, timeout_s=0.05 if not expected else 5.0)
            assert (got is not None) == expected
            refused += got is None
            if got is not None:
                assert got.slot == window.open()
                open_slots.append(got.slot)
                started[got.slot] = got.version
                opened += 1
        elif op in ("put", "release") and open_slots:
            slot = open_slots.pop(rng.randrange(len(open_slots)))
            window.done(slot)
            if op == "put":
                await ref.call(PutGroup(group=group(f"g{slot}", version=started[slot]), slot=slot))
                queued += 1
            else:
                await ref.call(ReleaseSlot(slot=slot, reason="test"))
                window.hand_back(slot)
        elif op == "train" and queued >= G:  # a step, then its publish (as the loop does)
            batch = await ref.call(GetBatch(n_groups=G, timeout_s=5.0), timeout_s=10.0)
            assert len(batch.groups) == G   # admission kept every group trainable
            queued -= G
            version += 1
            await ref.call(SetVersion(version=version))
    assert checks == 200 and opened > 5 and refused > 0  # open and closed windows both met
