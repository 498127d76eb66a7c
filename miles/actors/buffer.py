"""The bounded buffer between rollout and training, and the policy boundary.

Design decisions:
- Capacity is counted in groups. `PutGroup` waits while the buffer is full: backpressure on the
  rollout, never a drop. A group accepted into the queue is handed to the trainer or explicitly
  decided on by the policy (retry/drop/stale), and every decision is counted.
- Staleness is controlled by admission. Groups are admitted in slots (0, 1, 2, ...); with G groups
  per step, slot `s` is due for training at version `s // G`. Two rules, both needed:
  (A) `trainable slots < (version + 1 + max_staleness) * G`: nothing starts that could only be
      trained more than `max_staleness` versions late (`max_staleness = 0` is exactly synchronous
      on-policy RL: the next batch starts only once the new weights are published);
  (B) fewer than `(max_staleness + 1) * G` groups (not counting handed-back ones) were admitted
      after the oldest group still generating: a slow group holds the window, so faster groups
      overtake it by at most that much, and a long trajectory is trained within bounds instead
      of being overtaken until it is stale (starved). Completed groups waiting in the queue do
      not hold the window: they go out in the next batches anyway (holding it on them would
      deadlock a trainer that needs more groups than are queued).
  Slots of dropped groups are handed back, so dynamic sampling refills the batch.
- Batches are taken oldest slot first. A group that is nevertheless too stale when taken (it was
  overtaken while retried, say) meets the reject-stale backstop: `buffer.stale_action` decides
  (retry the prompt, or drop).
- The policy is a small class (`BufferPolicy`) a user subclasses and names in the recipe
  (`buffer.policy = "my_pkg.policy:MyPolicy"`): `on_put(group) -> Decision` and
  `on_stale(group, staleness) -> Decision`. The dynamic-sampling filter (`buffer.filter`) is a
  function `(group) -> bool` (keep?).
- Idle time: the time the trainer spent waiting in `GetBatch` is the trainer's idle time; the
  rollout reports engine idle time itself.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass

from miles.actors.base import Actor
from miles.rl.rewards import load_function
from miles.wire.messages import (Batch, BufferMetricsRequest, GetBatch, GetQueuedPrompts, Group,
                                 Metrics, PutGroup, PutReply, QueuedPrompts, ReleaseSlot,
                                 Reservation, Reserve, SetVersion)


@dataclass
class Decision:
    action: str          # "keep" | "retry" | "drop" | "stale"
    reason: str = ""


def group_version(group: Group) -> int:
    """The oldest weights version any token of the group was generated with."""
    versions = [span.version for s in group.samples for span in s.weight_versions]
    return min(versions) if versions else group.admitted_version


def _rewards(group: Group) -> list[float]:
    out = []
    for s in group.samples:
        r = s.reward
        out.append(float(next(iter(r.values()))) if isinstance(r, dict) and r else float(r or 0.0))
    return out


def nonzero_std(group: Group) -> bool:
    """Dynamic sampling: keep a group only if its rewards differ (else its advantages are all 0)."""
    rewards = _rewards(group)
    return max(rewards) - min(rewards) > 1e-9 if rewards else False


FILTERS = {"none": lambda group: True, "nonzero_std": nonzero_std}


class BufferPolicy:
    """What to do with a finished group. Subclass and name it in `buffer.policy`."""

    def __init__(self, max_retries: int = 2, stale_action: str = "retry"):
        self.max_retries, self.stale_action = max_retries, stale_action

    def on_put(self, group: Group) -> Decision:
        bad = [s for s in group.samples if s.status in ("failed", "aborted")]
        if bad:
            retries = int(group.samples[0].metadata.get("retries", 0))
            action = "retry" if retries < self.max_retries else "drop"
            return Decision(action, f"{len(bad)} sample(s) {bad[0].status}")
        return Decision("keep")

    def on_stale(self, group: Group, staleness: int) -> Decision:
        return Decision(self.stale_action if self.stale_action == "drop" else "retry",
                        f"staleness {staleness}")


class Buffer(Actor):
    def __init__(self, name: str = "buffer"):
        super().__init__(name)
        self.version = 0
        self.base_version: int | None = None  # the version slot 0 was admitted at
        self.next_slot = 0
        self.handed_back = 0          # slots dropped/filtered/stale: never trained
        self.live: set[int] = set()   # admitted slots not yet trained nor handed back
        self.generating: set[int] = set()   # admitted slots whose group is not back yet
        self.back_slots: list[int] = []     # handed-back slots above the oldest generating one
        self.queue: list[tuple[int, Group]] = []  # heap by slot
        self.counts = {"kept": 0, "retried": 0, "dropped": 0, "stale": 0, "filtered": 0,
                       "batches": 0, "groups_out": 0}
        self.staleness_sum, self.staleness_max = 0, 0
        self.trainer_wait_s = 0.0
        self.stale_prompts: list[int] = []   # prompt indices rejected as stale (retried by policy)
        self._changed = asyncio.Condition()
        self.configure()

    def configure(self, capacity_groups: int = 64, groups_per_step: int = 8, max_staleness: int = 2,
                  filter_spec: str = "none", policy: BufferPolicy | None = None) -> None:
        self.capacity_groups, self.groups_per_step = capacity_groups, groups_per_step
        self.max_staleness = max_staleness
        self.keep_group = FILTERS.get(filter_spec) or load_function(filter_spec, "buffer.filter")
        self.policy = policy or BufferPolicy()

    async def on_start(self) -> None:
        if self.recipe is None:
            return
        r = self.recipe
        policy_cls = BufferPolicy
        if r.buffer.policy:
            from miles.actors.host import load_class
            policy_cls = load_class(r.buffer.policy, BufferPolicy)
        self.configure(r.buffer.capacity_groups, r.loop.groups_per_step, r.loop.staleness,
                       r.buffer.filter, policy_cls(r.rollout.max_retries, r.buffer.stale_action))

    # ----- admission ---------------------------------------------------------------------------

    def _admissible(self) -> bool:
        window = (self.max_staleness + 1) * self.groups_per_step
        trainable = self.next_slot - self.handed_back
        steps_published = self.version - (self.base_version or 0)
        if trainable >= (steps_published + 1 + self.max_staleness) * self.groups_per_step:
            return False                                      # rule A
        if not self.generating:
            return True
        oldest = min(self.generating)
        self.back_slots = [b for b in self.back_slots if b > oldest]
        overtakers = self.next_slot - oldest - 1 - len(self.back_slots)
        return overtakers < window                            # rule B

    async def on_reserve(self, msg: Reserve) -> Reservation:
        if self.base_version is None:  # a warm-start or a resume need not start at version 0
            self.base_version = self.version
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(self._admissible),
                                   msg.timeout_s or None)
            slot = self.next_slot
            self.next_slot += 1
            self.live.add(slot)
            self.generating.add(slot)
            retry = self.stale_prompts.pop(0) if self.stale_prompts else -1
            return Reservation(slot=slot, version=self.version, retry_prompt=retry)

    def _hand_back(self, slot: int) -> None:
        self.live.discard(slot)
        self.generating.discard(slot)
        self.handed_back += 1
        self.back_slots.append(slot)

    async def _finish(self, slot: int, handed_back: bool) -> None:
        async with self._changed:
            if handed_back:
                self._hand_back(slot)
            self._changed.notify_all()

    async def on_release_slot(self, msg: ReleaseSlot) -> None:
        self.counts["dropped"] += 1
        await self._finish(msg.slot, handed_back=True)

    async def on_set_version(self, msg: SetVersion) -> None:
        async with self._changed:
            self.version = msg.version
            self._changed.notify_all()

    # ----- put / get ---------------------------------------------------------------------------

    async def on_put_group(self, msg: PutGroup) -> PutReply:
        decision = self.policy.on_put(msg.group)
        if decision.action == "keep" and not self.keep_group(msg.group):
            self.counts["filtered"] += 1
            await self._finish(msg.slot, handed_back=True)
            return PutReply(decision="drop", reason="filtered by buffer.filter")
        if decision.action != "keep":
            key = {"retry": "retried", "drop": "dropped", "stale": "stale"}[decision.action]
            self.counts[key] += 1
            if decision.action != "retry":  # a retried group keeps its slot
                await self._finish(msg.slot, handed_back=True)
            return PutReply(decision=decision.action, reason=decision.reason)
        async with self._changed:
            self.generating.discard(msg.slot)
            self._changed.notify_all()
            await self._changed.wait_for(lambda: len(self.queue) < self.capacity_groups)
            heapq.heappush(self.queue, (msg.slot, msg.group))
            self.counts["kept"] += 1
            self._changed.notify_all()
        return PutReply(decision="keep")

    async def on_get_batch(self, msg: GetBatch) -> Batch:
        t0 = time.monotonic()
        groups, staleness = [], []
        async with self._changed:
            while len(groups) < msg.n_groups:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.queue),
                                       msg.timeout_s or None)
                slot, group = heapq.heappop(self.queue)
                lag = self.version - group_version(group)
                if lag > self.max_staleness + 1:  # backstop; admission normally prevents it
                    decision = self.policy.on_stale(group, lag)
                    self.counts["stale"] += 1
                    self._hand_back(slot)
                    if decision.action == "retry":  # the next reservation regenerates it
                        self.stale_prompts.append(group.prompt_index)
                    self._changed.notify_all()  # the window moved: admission may go on
                    continue
                groups.append(group)
                staleness.append(lag)
                self.live.discard(slot)
            self._changed.notify_all()
        self.trainer_wait_s += time.monotonic() - t0
        self.counts["batches"] += 1
        self.counts["groups_out"] += len(groups)
        self.staleness_sum += sum(staleness)
        self.staleness_max = max([self.staleness_max, *staleness])
        return Batch(groups=groups, version=self.version, staleness=staleness)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({f"buffer/{k}": float(v) for k, v in self.counts.items()})
        out.update({"buffer/queue_groups": float(len(self.queue)),
                    "buffer/live_slots": float(len(self.live)),
                    "buffer/version": float(self.version),
                    "buffer/staleness_avg": self.staleness_sum / max(1, self.counts["groups_out"]),
                    "buffer/staleness_max": float(self.staleness_max),
                    "buffer/trainer_wait_s": self.trainer_wait_s})
        return out

    def on_get_queued_prompts(self, msg: GetQueuedPrompts) -> QueuedPrompts:
        return QueuedPrompts(indices=[g.prompt_index for _, g in self.queue] + list(self.stale_prompts))

    def on_buffer_metrics_request(self, msg: BufferMetricsRequest) -> Metrics:
        return Metrics(actor=self.name, values=self.metrics())
