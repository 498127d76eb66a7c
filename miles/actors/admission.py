"""The buffer's admission rule, once: may the next slot open? Used by the buffer
(miles/actors/buffer.py) and by the capacity model (miles/plan.py), so the two cannot disagree.

Design decisions:
- A pure function over plain values (counts and slot numbers), not over either caller's state:
  the buffer counts from its journalled slot table, the plan from its simulated one, and each
  hands over the same six figures.
- With G groups per step, slot `s` is due for training at version `s // G`. Two rules, both
  needed (the buffer's docstring tells why):
  (A) `admitted - handed_back < (versions_published + 1 + max_staleness) * G`: nothing starts
      that could only be trained more than `max_staleness` versions late;
  (B) fewer than `(max_staleness + 1) * G` slots, not counting handed-back ones, were admitted
      after the oldest slot still holding the window (reserved / generating / retry): a slow
      group is overtaken by at most that much.
"""

from __future__ import annotations


def admits(*, admitted: int, handed_back: int, versions_published: int, groups_per_step: int,
           max_staleness: int, oldest_holding: int | None, back_after_oldest: int) -> bool:
    """Whether slot `admitted` (the number of slots admitted so far) may open now.

    `handed_back`: slots dropped, filtered or stale (never trained); `versions_published`:
    versions published since slot 0 was admitted; `oldest_holding`: the oldest slot still
    reserved, generating or retried (None: none); `back_after_oldest`: handed-back slots above it.
    """
    if admitted - handed_back >= (versions_published + 1 + max_staleness) * groups_per_step:
        return False                                                    # rule A
    if oldest_holding is None:
        return True
    overtakers = admitted - oldest_holding - 1 - back_after_oldest
    return overtakers < (max_staleness + 1) * groups_per_step          # rule B
