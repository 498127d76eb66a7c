"""The bounded buffer between rollout and training, and the policy boundary.

Design decisions:
- The buffer owns the slots, an explicit state machine (`Buffer.slot_table()` reads it; metrics
  count slots per state). Groups are admitted in slots (0, 1, 2, ...); batches are taken in slot
  order. A slot not yet admitted is free; a trained or handed-back one leaves the table.

      state         entered by (message)                    leaves to
      free          -                                       reserved | generating   (Reserve)
      reserved      Reserve without a prompt                queued | retry | back   (PutGroup, ReleaseSlot)
      generating    Reserve naming its prompt               queued | retry | back   (PutGroup, ReleaseSlot)
      retry         PutGroup, policy said retry             queued | retry | back   (PutGroup of the next attempt)
      queued        PutGroup, policy said keep              out | back (stale)      (GetBatch)
      out           GetBatch with a request id              trained                 (ConfirmBatch)
      trained       ConfirmBatch (or GetBatch without id)   -
      back          dropped / filtered / stale / released   - (its prompt may be regenerated)

  The worker regenerates a retried group in its slot at once, never through admission: in sync
  mode no new slot opens until the version advances, which needs that very group.
- Capacity is counted in queued groups. `PutGroup` waits while the buffer is full: backpressure
  on the rollout, never a drop. A group waiting for room no longer holds the window (rule B).
- Staleness is controlled by admission; with G groups per step, slot `s` is due for training at
  version `s // G`. Two rules on the table, both needed (written once, as a pure function:
  `miles/actors/admission.py:admits`, which the capacity model `miles plan` runs too):
  (A) `slots admitted - slots handed back < (version + 1 + max_staleness) * G`: nothing starts
      that could only be trained more than `max_staleness` versions late (`max_staleness = 0` is
      exactly synchronous on-policy RL: the next batch starts only once the new weights are
      published);
  (B) fewer than `(max_staleness + 1) * G` slots, not counting handed-back ones, were admitted
      after the oldest slot still reserved / generating / retry: a slow group holds the window,
      so faster groups overtake it by at most that much, and a long trajectory is trained within
      bounds instead of being overtaken until it is stale (starved). Queued groups do not hold
      the window: they go out in the next batches anyway (holding it on them would deadlock a
      trainer that needs more groups than are queued).
  Slots of dropped groups are handed back, so dynamic sampling refills the batch.
- A group that is nevertheless too stale when taken (it was overtaken while retried, say) meets
  the reject-stale backstop: `buffer.stale_action` decides (retry the prompt, or drop).
- Journal (`<output_dir>/buffer/journal.bin`, `miles.wire.journal`; the records are in
  `miles.actors.slots`): every transition is one record written before the reply, and the same `_apply` replays it, so a restarted buffer
  (SIGKILL at any point) comes back with every group it accepted, its slot table, its version
  and the rollout's data position. It is rewritten as one snapshot every
  `buffer.journal_compact_records` records. Incarnation 0 (a new job, or a resume from a
  checkpoint, which replays its own prompts) starts from an empty journal. Only a buffer placed
  by a recipe journals; one built in-process (tests, scripts) keeps its state in memory.
- Nothing is lost or trained twice across a buffer restart: `Reserve` and `PutGroup` are
  idempotent (a request id; the group id), and `GetBatch` with a request id is two-phase, its
  groups "out" until `ConfirmBatch`; a re-sent `GetBatch` gets the same groups. A `GetBatch`
  cancelled midway puts back what it had popped. Handlers change state only after their last
  await, so a cancelled one leaves nothing half done.
- A restarted rollout worker asks `GetRolloutResume`: it becomes the owner of the slots it must
  regenerate in place (puts and reservations of the dead incarnation are refused from then on)
  and reads on from the data position journalled with the last reservation.
- The policy is a small class (`BufferPolicy`) a user subclasses and names in the recipe
  (`buffer.policy = "my_pkg.policy:MyPolicy"`): `on_put(group) -> Decision` and
  `on_stale(group, staleness) -> Decision`. The dynamic-sampling filter (`buffer.filter`) is a
  function `(group) -> bool` (keep?).
- A group is all the samples of its prompt's rollouts, and a rollout may have produced several
  (a trajectory tree: siblings share `rollout_id`), so a group's size varies; nothing here counts
  samples against `n_samples_per_prompt`. The filter looks at one reward per rollout.
- The prompt ledger (`<output_dir>/buffer/ledger.bin`, `miles.actors.ledger`): each prompt's
  event is appended before the transition it comes with is journalled, so a buffer killed
  between the two has the event twice at worst (the checker counts a fact once), never not at all.
- Idle time: the time the trainer spent waiting in `GetBatch` is the trainer's idle time; the
  rollout reports engine idle time itself.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.actors.admission import admits
from miles.actors.ledger import Ledger
from miles.runtime import Actor, ActorError
from miles.wire.journal import Journal
from miles.actors.slots import (HOLDING, STATES, JournalBatchOut, JournalBatchTrained,
                                JournalHandedBack, JournalQueued, JournalReserved, JournalRetry,
                                JournalRollout, JournalSnapshot, JournalVersion, SlotRow)
from miles import plugins
from miles.wire.messages import (Batch, BufferMetricsRequest, ConfirmBatch, GetBatch,
                                 GetQueuedPrompts, GetRolloutResume, Group, Message, Metrics,
                                 NoteRolloutStart, OrphanSlot, PutGroup, PutReply, QueuedPrompts,
                                 ReleaseSlot, Reservation, Reserve, RolloutResume, SetVersion,
                                 StartJob)

# The buffer journal's format (miles.wire.journal.JournalFormat): 2 = samples carry a
# `provenance` record. Format 1 files (no header) read as they are: the field is None there.
JOURNAL_FORMAT = 2


@dataclass
class Decision:
    action: str          # "keep" | "retry" | "drop" | "stale"
    reason: str = ""


def group_version(group: Group) -> int:
    """The oldest weights version any token of the group was generated with."""
    versions = [span.version for s in group.samples for span in s.weight_versions]
    return min(versions) if versions else group.admitted_version


def rollout_rewards(group: Group, reward_key: str = "") -> list[float]:
    """One reward per rollout of the group, in order of first appearance.

    Siblings (samples sharing a `rollout_id`: one trajectory tree) share their rollout's reward; the
    first one's stands for them (the trainer refuses siblings that disagree, naming them). A sample
    without a `rollout_id` is a rollout of its own."""
    rewards: dict[str, float] = {}
    for i, s in enumerate(group.samples):
        rewards.setdefault(s.rollout_id or f"\0sample{i}", s.scalar_reward(reward_key))
    return list(rewards.values())


def nonzero_std(group: Group, reward_key: str = "") -> bool:
    """Dynamic sampling: keep a group only if its rollouts' rewards differ (else every advantage is
    0). Over rollouts, not samples: one rollout split into many samples is still one reward."""
    rewards = rollout_rewards(group, reward_key)
    return max(rewards) - min(rewards) > 1e-9 if rewards else False


def keep_all(group: Group, reward_key: str = "") -> bool:
    """`buffer.filter = "none"`: train every group."""
    return True


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
        self.next_slot = 0                    # slots below it are not free
        self.handed_back = 0                  # slots dropped/filtered/stale: never trained
        self.table: dict[int, SlotRow] = {}   # every slot admitted and not yet trained/handed back
        self.back_slots: list[int] = []       # handed-back slots above the oldest live one
        self.queue: list[int] = []            # heap of queued slots
        self.batches: dict[str, tuple[list[int], list[int], int]] = {}  # id -> (slots, lags, version)
        self.by_request: dict[str, int] = {}  # Reserve request id -> slot
        self.waiting_room: set[int] = set()   # slots whose put waits for capacity (not journalled)
        self.counts = {"kept": 0, "retried": 0, "dropped": 0, "stale": 0, "filtered": 0,
                       "batches": 0, "groups_out": 0, "trained": 0}
        self.staleness_sum, self.staleness_max = 0, 0
        self.trainer_wait_s = 0.0
        self.stale_prompts: list[int] = []    # prompt indices rejected as stale (retried by policy)
        self.rollout_owner, self.rollout_started = -1, False
        self.rollout_data: dict[str, Any] = {}
        self.rollout_replay: list[int] = []
        self.journal: Journal | None = None
        self.ledger: Ledger | None = None     # every prompt's fate (miles/actors/ledger.py)
        self.compact_records = 2000
        self._changed = asyncio.Condition()
        self.configure()

    def configure(self, capacity_groups: int = 64, groups_per_step: int = 8, max_staleness: int = 2,
                  filter_spec: str = "none", policy: BufferPolicy | None = None,
                  reward_key: str = "") -> None:
        self.capacity_groups, self.groups_per_step = capacity_groups, groups_per_step
        self.filter_spec = filter_spec
        self.max_staleness = max_staleness
        keep = plugins.load("buffer.filter", filter_spec)
        # the built-ins read the trained reward key; a user's filter takes the group only
        self.keep_group = (functools.partial(keep, reward_key=reward_key)
                           if plugins.is_builtin("buffer.filter", filter_spec) else keep)
        self.policy = policy or BufferPolicy()

    async def on_start(self) -> None:
        if self.recipe is None:
            return
        r = self.recipe
        policy_cls = BufferPolicy
        if r.buffer.policy:
            policy_cls = plugins.load("buffer.policy", r.buffer.policy)
        self.configure(r.buffer.capacity_groups, r.loop.groups_per_step, r.loop.staleness,
                       r.buffer.filter, policy_cls(r.rollout.max_retries, r.buffer.stale_action),
                       r.train.reward_key)
        if r.buffer.journal and self.spec is not None:
            self.compact_records = r.buffer.journal_compact_records
            self.open_journal(Path(r.output_dir) / "buffer" / "journal.bin",
                              restore=self.incarnation > 0)
            self.ledger = Ledger(Path(r.output_dir) / "buffer" / "ledger.bin")

    async def on_stop(self) -> None:
        if self.journal is not None:
            self.journal.close()
        if self.ledger is not None:
            self.ledger.close()

    def _note(self, prompt: int, fate: str, reason: str = "", step: int = 0) -> None:
        if self.ledger is not None:
            self.ledger.note(prompt, fate, reason, step)

    def on_start_job(self, msg: StartJob) -> None:
        if self.ledger is not None:
            self.ledger.start_job(msg.resumed_step, msg.fresh, msg.driver)

    # ----- the journal -------------------------------------------------------------------------

    def open_journal(self, path: Path, restore: bool) -> None:
        self.journal = Journal(path, "buffer", JOURNAL_FORMAT)
        if not restore:
            self.journal.remove()
            return
        records = self.journal.read()
        for rec in records:
            self._apply(rec)
        self._compact()
        print(f"[buffer] restored from {path} ({len(records)} records): version {self.version}, "
              f"{len(self.queue)} queued groups, slots {self.state_counts()}", flush=True)

    def _commit(self, rec: Message) -> None:
        """Journal a transition, then make it: the one way state changes."""
        if self.journal is not None:
            self.journal.append(rec)
        self._apply(rec)
        if self.journal is not None and self.journal.records >= self.compact_records:
            self._compact()

    def _compact(self) -> None:
        if self.journal is not None:
            self.journal.rewrite([self._snapshot()])

    def _snapshot(self) -> JournalSnapshot:
        return JournalSnapshot(
            version=self.version, base_version=self.base_version, next_slot=self.next_slot,
            handed_back=self.handed_back, back_slots=list(self.back_slots),
            stale_prompts=list(self.stale_prompts), slots=list(self.table.values()),
            batches=dict(self.batches), counts=dict(self.counts),
            staleness_sum=self.staleness_sum, staleness_max=self.staleness_max,
            rollout_owner=self.rollout_owner, rollout_started=self.rollout_started,
            data_state=self.rollout_data, replay=self.rollout_replay)

    def _apply(self, rec: Message) -> None:
        if isinstance(rec, JournalReserved):
            if self.base_version is None:  # a warm-start or a resume need not start at version 0
                self.base_version = rec.version
            self.next_slot = max(self.next_slot, rec.slot + 1)
            self.table[rec.slot] = SlotRow(
                slot=rec.slot, state="generating" if rec.prompt_index >= 0 else "reserved",
                prompt_index=rec.prompt_index, attempt=rec.attempt, owner=rec.owner,
                request_id=rec.request_id)
            if rec.request_id:
                self.by_request[rec.request_id] = rec.slot
            if rec.stale_prompt:
                self.stale_prompts.remove(rec.prompt_index)
            if rec.data_state is not None:
                self.rollout_data, self.rollout_replay = rec.data_state, list(rec.replay)
                self.rollout_started = True
        elif isinstance(rec, JournalRetry):
            row = self.table[rec.slot]
            row.state, row.attempt = "retry", rec.attempt
            self.counts["retried"] += 1
        elif isinstance(rec, JournalQueued):
            row = self.table[rec.slot]
            row.state, row.group, row.prompt_index = "queued", rec.group, rec.group.prompt_index
            heapq.heappush(self.queue, rec.slot)
            self.counts["kept"] += 1
        elif isinstance(rec, JournalHandedBack):
            self._forget(rec.slot)
            self.handed_back += 1
            self.back_slots.append(rec.slot)
            self.counts[rec.why] += 1
            if rec.retry_prompt >= 0:
                self.stale_prompts.append(rec.retry_prompt)
        elif isinstance(rec, JournalBatchOut):
            for slot in rec.slots:
                if slot in self.queue:
                    self.queue.remove(slot)
                    heapq.heapify(self.queue)
                self.table[slot].state, self.table[slot].batch = "out", rec.request_id
            if rec.request_id:
                self.batches[rec.request_id] = (list(rec.slots), list(rec.staleness), rec.version)
            else:
                self._trained(rec.slots)
            self.counts["batches"] += 1
            self.counts["groups_out"] += len(rec.slots)
            self.staleness_sum += sum(rec.staleness)
            self.staleness_max = max([self.staleness_max, *rec.staleness])
        elif isinstance(rec, JournalBatchTrained):
            self._trained(self.batches.pop(rec.request_id)[0])
        elif isinstance(rec, JournalVersion):
            self.version = rec.version
        elif isinstance(rec, JournalRollout):
            self.rollout_owner = max(self.rollout_owner, rec.owner)
            if rec.data_state is not None:
                self.rollout_data, self.rollout_replay = rec.data_state, list(rec.replay)
                self.rollout_started = True
            for row in self.table.values():  # the slots it will regenerate are now its own
                if row.state in HOLDING:
                    row.owner = rec.owner
        elif isinstance(rec, JournalSnapshot):
            self.version, self.base_version = rec.version, rec.base_version
            self.next_slot, self.handed_back = rec.next_slot, rec.handed_back
            self.back_slots, self.stale_prompts = list(rec.back_slots), list(rec.stale_prompts)
            self.table = {row.slot: row for row in rec.slots}
            self.queue = sorted(row.slot for row in rec.slots if row.state == "queued")
            self.by_request = {row.request_id: row.slot for row in rec.slots if row.request_id}
            self.batches = {k: (list(a), list(b), v) for k, (a, b, v) in rec.batches.items()}
            self.counts.update(rec.counts)
            self.staleness_sum, self.staleness_max = rec.staleness_sum, rec.staleness_max
            self.rollout_owner, self.rollout_started = rec.rollout_owner, rec.rollout_started
            self.rollout_data, self.rollout_replay = dict(rec.data_state), list(rec.replay)
        else:
            raise TypeError(f"not a buffer journal record: {type(rec).__name__}")

    def _forget(self, slot: int) -> None:
        row = self.table.pop(slot, None)
        if row is not None and row.request_id:
            self.by_request.pop(row.request_id, None)
        if slot in self.queue:
            self.queue.remove(slot)
            heapq.heapify(self.queue)
        low = min(self.table, default=self.next_slot)  # no slot below it can hold the window again
        self.back_slots = [b for b in self.back_slots if b > low]

    def _trained(self, slots: list[int]) -> None:
        for slot in slots:
            self._forget(slot)
        self.counts["trained"] += len(slots)

    # ----- the slot table ----------------------------------------------------------------------

    def slot_table(self) -> list[dict[str, Any]]:
        """Every live slot, oldest first: slot, state, prompt, attempt, owner, batch."""
        return [{"slot": r.slot, "state": r.state, "prompt_index": r.prompt_index,
                 "attempt": r.attempt, "owner": r.owner, "batch": r.batch}
                for r in sorted(self.table.values(), key=lambda r: r.slot)]

    def state_counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for row in self.table.values():
            out[row.state] += 1
        out["trained"], out["back"] = self.counts["trained"], self.handed_back
        return out

    # ----- admission ---------------------------------------------------------------------------

    def _admissible(self) -> bool:
        """Rules A and B (miles/actors/admission.py) on the slot table."""
        steps_published = self.version - (self.base_version if self.base_version is not None
                                          else self.version)
        oldest = min((s for s, r in self.table.items()
                      if r.state in HOLDING and s not in self.waiting_room), default=None)
        return admits(admitted=self.next_slot, handed_back=self.handed_back,
                      versions_published=steps_published, groups_per_step=self.groups_per_step,
                      max_staleness=self.max_staleness, oldest_holding=oldest,
                      back_after_oldest=0 if oldest is None else
                      sum(1 for b in self.back_slots if b > oldest))

    def _reservation(self, slot: int, asked_prompt: int) -> Reservation:
        row = self.table[slot]
        retry = row.prompt_index if row.prompt_index != asked_prompt else -1
        return Reservation(slot=slot, version=self.version, retry_prompt=retry)

    async def on_reserve(self, msg: Reserve) -> Reservation:
        if msg.request_id in self.by_request:  # re-sent after a restart: the same slot
            return self._reservation(self.by_request[msg.request_id], msg.prompt_index)
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(self._admissible),
                                   msg.timeout_s or None)
            if 0 <= msg.owner < self.rollout_owner:
                raise ActorError(f"Reserve from rollout incarnation {msg.owner}: incarnation "
                                 f"{self.rollout_owner} owns the rollout now")
            stale = self.stale_prompts[0] if self.stale_prompts else -1
            self._note(stale if stale >= 0 else msg.prompt_index, "read")
            self._commit(JournalReserved(
                slot=self.next_slot, version=self.version,
                prompt_index=stale if stale >= 0 else msg.prompt_index,
                attempt=0 if stale >= 0 else msg.attempt, owner=msg.owner,
                request_id=msg.request_id, stale_prompt=stale >= 0,
                data_state=None if stale >= 0 else msg.data_state,
                replay=[] if stale >= 0 else msg.replay))
            reservation = self._reservation(self.next_slot - 1, msg.prompt_index)
            if stale >= 0:  # old callers that name no prompt learn it this way
                reservation.retry_prompt = stale
            return reservation

    async def on_release_slot(self, msg: ReleaseSlot) -> None:
        async with self._changed:
            row = self.table.get(msg.slot)
            if row is not None and row.state in HOLDING:  # else: released already (a re-send)
                self._note(row.prompt_index, "dropped", msg.reason or "released by the rollout worker")
                self._commit(JournalHandedBack(slot=msg.slot, why="dropped"))
            self._changed.notify_all()

    async def on_set_version(self, msg: SetVersion) -> None:
        async with self._changed:
            if msg.version != self.version:
                self._commit(JournalVersion(version=msg.version))
            self._changed.notify_all()

    # ----- put / get ---------------------------------------------------------------------------

    def _refuse_put(self, msg: PutGroup) -> PutReply | None:
        """A put that may not change the slot: a re-send, or one from a superseded worker."""
        row = self.table.get(msg.slot)
        if row is None:
            return PutReply(decision="drop", reason=f"slot {msg.slot} is no longer live "
                                                    f"(handed back or trained)")
        if row.state in ("queued", "out"):
            if row.group is not None and row.group.group_id == msg.group.group_id:
                return PutReply(decision="keep", reason="already accepted")
            raise ValueError(f"PutGroup slot {msg.slot}: the slot already holds group "
                             f"{row.group.group_id if row.group else '?'}")
        if msg.owner >= 0 and row.owner >= 0 and msg.owner != row.owner:
            return PutReply(decision="drop", reason=f"slot {msg.slot} belongs to rollout "
                                                    f"incarnation {row.owner} now")
        return None

    async def on_put_group(self, msg: PutGroup) -> PutReply:
        async with self._changed:
            if msg.slot >= self.next_slot:  # a put without a reservation: admitted as it comes
                self._note(msg.group.prompt_index, "read")
                self._commit(JournalReserved(slot=msg.slot, version=self.version, owner=msg.owner))
            refused = self._refuse_put(msg)
            if refused is not None:
                return refused
            decision = self.policy.on_put(msg.group)
            if decision.action == "keep" and not self.keep_group(msg.group):
                self._note(msg.group.prompt_index, "filtered", f"buffer.filter = {self.filter_spec}")
                self._commit(JournalHandedBack(slot=msg.slot, why="filtered"))
                self._changed.notify_all()
                return PutReply(decision="drop", reason="filtered by buffer.filter")
            if decision.action == "retry":  # a retried group keeps its slot
                attempt = int(msg.group.samples[0].metadata.get("retries", 0)) + 1 \
                    if msg.group.samples else self.table[msg.slot].attempt + 1
                self._commit(JournalRetry(slot=msg.slot, attempt=attempt))
                return PutReply(decision="retry", reason=decision.reason)
            if decision.action != "keep":
                why = {"drop": "dropped", "stale": "stale"}[decision.action]
                self._note(msg.group.prompt_index, why, f"buffer policy: {decision.reason or why}")
                self._commit(JournalHandedBack(slot=msg.slot, why=why))
                self._changed.notify_all()
                return PutReply(decision=decision.action, reason=decision.reason)
            self.waiting_room.add(msg.slot)
            self._changed.notify_all()
            try:
                await self._changed.wait_for(lambda: len(self.queue) < self.capacity_groups)
            finally:
                self.waiting_room.discard(msg.slot)
            refused = self._refuse_put(msg)  # the world may have moved while it waited
            if refused is not None:
                return refused
            self._commit(JournalQueued(slot=msg.slot, group=msg.group))
            self._changed.notify_all()
        return PutReply(decision="keep")

    def _batch(self, request_id: str) -> Batch:
        slots, staleness, version = self.batches[request_id]
        return Batch(groups=[self.table[s].group for s in slots], version=version,
                     staleness=list(staleness))

    async def on_get_batch(self, msg: GetBatch) -> Batch:
        if msg.request_id and msg.request_id in self.batches:  # re-sent: the same groups
            return self._batch(msg.request_id)
        t0 = time.monotonic()
        taken: list[tuple[int, int]] = []  # (slot, staleness) popped, not yet committed
        async with self._changed:
            try:
                while len(taken) < msg.n_groups:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.queue),
                                           msg.timeout_s or None)
                    slot = heapq.heappop(self.queue)
                    group = self.table[slot].group
                    lag = self.version - group_version(group)
                    if lag > self.max_staleness + 1:  # backstop; admission normally prevents it
                        decision = self.policy.on_stale(group, lag)
                        retry = group.prompt_index if decision.action == "retry" else -1
                        self._note(group.prompt_index, "stale" if retry >= 0 else "dropped",
                                   f"{decision.reason or 'stale'}" + (": re-issued" if retry >= 0 else ""))
                        self._commit(JournalHandedBack(slot=slot, why="stale", retry_prompt=retry))
                        self._changed.notify_all()  # the window moved: admission may go on
                        continue
                    taken.append((slot, lag))
                groups = [self.table[s].group for s, _ in taken]
                self._commit(JournalBatchOut(request_id=msg.request_id,
                                             slots=[s for s, _ in taken],
                                             staleness=[lag for _, lag in taken],
                                             version=self.version))
                batch = Batch(groups=groups, version=self.version,
                              staleness=[lag for _, lag in taken])
                taken = []
            finally:
                for slot, _ in taken:  # cancelled or timed out midway: nothing popped is lost
                    heapq.heappush(self.queue, slot)
                self._changed.notify_all()
        self.trainer_wait_s += time.monotonic() - t0
        return batch

    async def on_confirm_batch(self, msg: ConfirmBatch) -> None:
        async with self._changed:
            if msg.request_id in self.batches:  # else confirmed already (a re-send)
                for slot in self.batches[msg.request_id][0]:
                    self._note(self.table[slot].prompt_index, "trained", step=msg.step)
                self._commit(JournalBatchTrained(request_id=msg.request_id))
            self._changed.notify_all()

    # ----- the rollout's position --------------------------------------------------------------

    def on_note_rollout_start(self, msg: NoteRolloutStart) -> None:
        self._commit(JournalRollout(owner=msg.owner, data_state=msg.data_state, replay=msg.replay))

    async def on_get_rollout_resume(self, msg: GetRolloutResume) -> RolloutResume:
        async with self._changed:
            for row in [r for r in self.table.values() if r.state == "reserved"]:
                self._commit(JournalHandedBack(slot=row.slot, why="dropped"))  # no prompt to redo
            self._commit(JournalRollout(owner=msg.owner))
            self._changed.notify_all()
            orphans = [OrphanSlot(slot=r.slot, prompt_index=r.prompt_index, attempt=r.attempt)
                       for r in sorted(self.table.values(), key=lambda r: r.slot)
                       if r.state in HOLDING]
        return RolloutResume(started=self.rollout_started, data_state=self.rollout_data,
                             replay=list(self.rollout_replay), orphans=orphans)

    # ----- metrics -----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({f"buffer/{k}": float(v) for k, v in self.counts.items()})
        out.update({f"buffer/slots_{k}": float(v) for k, v in self.state_counts().items()})
        out.update({"buffer/queue_groups": float(len(self.queue)),
                    "buffer/live_slots": float(sum(r.state != "out" for r in self.table.values())),
                    "buffer/version": float(self.version),
                    "buffer/staleness_avg": self.staleness_sum / max(1, self.counts["groups_out"]),
                    "buffer/staleness_max": float(self.staleness_max),
                    "buffer/trainer_wait_s": self.trainer_wait_s})
        return out

    def on_get_queued_prompts(self, msg: GetQueuedPrompts) -> QueuedPrompts:
        # "out": a batch handed to a driver that will not train it (a drain abandoned its wait)
        queued = [r.prompt_index for r in self.table.values() if r.state in ("queued", "out")]
        return QueuedPrompts(indices=queued + list(self.stale_prompts))

    def on_buffer_metrics_request(self, msg: BufferMetricsRequest) -> Metrics:
        return Metrics(actor=self.name, values=self.metrics())
