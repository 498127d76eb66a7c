"""Every message that crosses a process boundary, as msgspec Structs in one tagged union.

Design decisions:
- Every message subclasses `Message` (tagged; the tag is the class name, in the field `type`).
  Subclassing registers the class, so a user's actor can define its own messages and the decoder
  learns them; two classes with one tag are refused at import time.
- Numeric arrays are plain `numpy.ndarray` fields. The codec moves them as raw frames beside the
  msgpack body (zero copy both ways); they are never msgpack lists.
- `Sample` follows slime's layout, which RL users know: `tokens` is prompt + response, the response
  is the last `response_length` tokens, and the per-token fields (`loss_mask`, `rollout_logprobs`)
  cover the response only. Version spans are half-open index ranges into the response.
- Nothing here imports anything of ours: `wire/` is the bottom of the dependency graph.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

_REGISTRY: dict[str, type["Message"]] = {}


class Message(msgspec.Struct, tag=True, tag_field="type", kw_only=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """Base of every wire message. Subclasses are registered by tag (the class name)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        tag = cls.__name__  # tag=True tags a struct with its class name
        prior = _REGISTRY.get(tag)
        if prior is not None and prior is not cls and (prior.__module__, prior.__qualname__) != (
                cls.__module__, cls.__qualname__):
            raise TypeError(f"message tag {tag!r} of {cls.__module__}.{cls.__qualname__} is already "
                            f"used by {prior.__module__}.{prior.__qualname__}")
        _REGISTRY[tag] = cls


def registered_messages() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# Envelope: decoded before the body, so a peer of another protocol version is refused up front.

# cancel: the caller gave up on call/stream `id`; probe: an inbox checking that a caller is still
# connected (callers ignore it).
Kind = Literal["call", "tell", "reply", "error", "stream_open", "stream_item", "stream_credit",
               "stream_end", "stream_close", "cancel", "probe", "shm_free"]


class Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    v: int                      # protocol version
    kind: str                   # one of Kind
    id: int = 0                 # call id / stream id, chosen by the caller
    sender: str = ""            # actor or client name, for error messages and logs
    n_arrays: int = 0           # raw frames after the body


# ---------------------------------------------------------------------------------------------
# Generic control messages

class Ok(Message):
    detail: str = ""


class Published(Ok):
    """A trainer rank's answer to PublishWeights; rank 0's carries the publish's `weights/...`
    metrics (stall time and its parts, PublishReport.metrics)."""
    metrics: dict[str, float] = {}
    # provenance: the digest of what the trainer sent and of what each engine holds (engine url
    # -> digest), where the publish computed checksums (weights.check_weights); "" / {} else
    weight_digest: str = ""
    engine_digests: dict[str, str] = {}


class ShmFree(Message):
    """Receiver -> caller (kind "shm_free"): every array of call number `use` of pooled
    shared-memory segment `name` is gone, so the caller may write that segment again."""
    name: str
    use: int


class ErrorReply(Message):
    """A handler raised or a frame was refused; carries the remote error for the caller."""
    error_type: str
    message: str
    actor: str = ""
    retryable: bool = False


class Ping(Message):
    payload: bytes = b""


class Pong(Message):
    payload: bytes = b""
    actor: str = ""
    incarnation: int = 0


class GetMetrics(Message):
    pass


class Metrics(Message):
    actor: str
    values: dict[str, float] = {}


class Shutdown(Message):
    reason: str = ""
    exit_code: int = 0


# ---------------------------------------------------------------------------------------------
# Registry (head node): name -> endpoint, liveness via heartbeats

class Register(Message):
    name: str
    endpoint: str
    pid: int = 0
    node_rank: int = 0
    incarnation: int = 0


class Unregister(Message):
    name: str
    incarnation: int = 0


class Heartbeat(Message):
    name: str
    incarnation: int = 0
    loop_lag_ms: float = 0.0


class Lookup(Message):
    name: str
    wait_s: float = 0.0         # > 0: wait up to this long for the name to appear (wait-for)


class ActorInfo(Message):
    name: str
    endpoint: str = ""
    alive: bool = False
    incarnation: int = 0
    pid: int = 0
    node_rank: int = 0
    last_seen_s: float = 0.0    # seconds since the last heartbeat
    loop_lag_ms: float = 0.0    # its event loop's lag, as its last heartbeat reported
    # The connection it registered and heart-beats on is gone (it exited or died): lookups treat
    # it as gone at once, while `alive` (heartbeats) lags by up to the liveness timeout.
    disconnected: bool = False


class ListActors(Message):
    pass


class ActorList(Message):
    actors: list[ActorInfo] = []


# ---------------------------------------------------------------------------------------------
# Streams: bulk data with credit-based backpressure

class StreamOpen(Message):
    topic: str
    credits: int = 0            # filled in by the receiver's first credit grant


class StreamSummary(Message):
    """The receiver's answer when a stream ends: what it got, so the sender can verify."""
    topic: str
    items: int
    nbytes: int = 0
    checksum: str = ""


# ---------------------------------------------------------------------------------------------
# RL data

SampleStatus = Literal["pending", "completed", "truncated", "aborted", "failed"]


class VersionSpan(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Response tokens [start, end) were generated under weight `version`."""
    version: int
    start: int
    end: int


class Provenance(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Where a sample came from (docs/provenance.md). Compact: positional on the wire, defaults
    omitted. New fields go at the end with a default, so older records still decode.

    Times are unix seconds. `versions` lists every policy version whose weights made a token
    (more than one only under the in-place update policy); `trained_step` is set by the driver
    when the sample is trained (-1: not yet, or never)."""
    policy_version: int = -1            # the oldest version that made a token (admission's if none)
    versions: list[int] = []
    engine_id: str = ""                 # host:port of the engine that answered the last request
    engine_incarnation: int = 0         # that engine process's id (changes when it restarts)
    weight_digest: str = ""             # the publisher's digest of policy_version (where known)
    sampling: dict[str, float] = {}     # temperature, top_p, top_k, max_new_tokens, seed
    quant_format: str = ""              # the format the engines hold (quant.rollout)
    routing_digest: str = ""            # R3: sha256 prefix of the routed experts (if any)
    session_id: str = ""
    sandbox_id: str = ""
    image_digest: str = ""
    env_name: str = ""
    env_version: str = ""
    verifier_name: str = ""
    verifier_version: str = ""
    reward_components: dict[str, float] = {}
    queued_at: float = 0.0              # the episode was ready to run (waiting for a slot)
    started_at: float = 0.0             # its first engine request could go
    finished_at: float = 0.0            # scored
    trained_step: int = -1


class Sample(Message):
    tokens: np.ndarray                          # int32, prompt + response
    response_length: int = 0
    loss_mask: np.ndarray | None = None         # uint8 over the response: 1 = trained on
    rollout_logprobs: np.ndarray | None = None  # float32 over the response
    # float32 over the response: a teacher's log-prob of each sampled token (on-policy distillation
    # scored by a teacher engine on the rollout side; miles/backends/teacher.py)
    teacher_logprobs: np.ndarray | None = None
    weight_versions: list[VersionSpan] = []
    reward: float | dict[str, float] | None = None
    status: SampleStatus = "pending"
    routed_experts: np.ndarray | None = None    # R3: uint8/uint16 (len(tokens)-1, layers, top_k), miles.algo.routing
    group_id: str = ""
    rollout_id: str = ""                        # siblings of one trajectory tree share it
    index: int = 0                              # position inside its group
    prompt: str | list[dict[str, Any]] = ""     # text or chat messages, as the data source gave it
    label: str | None = None
    response: str = ""                          # decoded response text (for reward functions)
    metadata: dict[str, Any] = {}
    provenance: Provenance | None = None        # None: rollout.provenance off (or an old record)

    RESPONSE_FIELDS: ClassVar[tuple[str, ...]] = ("loss_mask", "rollout_logprobs", "teacher_logprobs")

    @property
    def prompt_length(self) -> int:
        return int(len(self.tokens)) - self.response_length

    def scalar_reward(self, key: str = "") -> float:
        """The one reward accessor (buffer filter, loop logging, evaluator, trainer): a number
        as it is, None as 0.0, a dict's entry `key` (`train.reward_key`). A dict without a key
        is an error naming its keys: guessing which entry counts is a silent bug."""
        return scalar_reward(self.reward, key)

    @property
    def response_ids(self) -> np.ndarray:
        return self.tokens[self.prompt_length:]

    def validate(self) -> None:
        """Raise ValueError naming the field when the per-token fields disagree in length."""
        n = int(len(self.tokens))
        if not 0 <= self.response_length <= n:
            raise ValueError(f"Sample.response_length: {self.response_length} outside [0, {n}] "
                             f"(len(tokens)={n})")
        for field in self.RESPONSE_FIELDS:
            arr = getattr(self, field)
            if arr is not None and len(arr) != self.response_length:
                raise ValueError(f"Sample.{field}: length {len(arr)} != response_length "
                                 f"{self.response_length}")
        for span in self.weight_versions:
            if not 0 <= span.start <= span.end <= self.response_length:
                raise ValueError(f"Sample.weight_versions: span {span} outside the response "
                                 f"[0, {self.response_length})")


def scalar_reward(reward: float | dict[str, float] | None, key: str = "") -> float:
    """See `Sample.scalar_reward`."""
    if reward is None:
        return 0.0
    if not isinstance(reward, dict):
        return float(reward)
    if not key:
        raise ValueError(f"reward is a dict with keys {sorted(reward)}; set train.reward_key to "
                         f"the entry to train on")
    if key not in reward:
        raise ValueError(f"train.reward_key = {key!r}: the reward dict has no such key "
                         f"(keys {sorted(reward)})")
    return float(reward[key])


class SampleBatch(Message):
    samples: list[Sample]


class Group(Message):
    """The samples generated for one prompt; the unit the buffer and the trainer see."""
    group_id: str
    samples: list[Sample]
    prompt_index: int = 0
    admitted_version: int = 0   # policy version when generation of the group was started


# ---------------------------------------------------------------------------------------------
# The RL loop: buffer, rollout, trainer, engines, evaluator

class Reserve(Message):
    """Rollout -> buffer: may I start a new group? Answered when admission allows it."""
    timeout_s: float = 0.0          # 0: wait as long as it takes
    # The prompt the group is for, read before asking, and the data source's state() after
    # reading it: the buffer journals them, so a restarted rollout worker reads on from there.
    prompt_index: int = -1          # -1: not said (the slot stays "reserved" until its put)
    attempt: int = 0
    data_state: dict[str, Any] | None = None   # None: the prompt was not read from the source
    replay: list[int] = []          # checkpoint-replay prompts still to generate after this one
    request_id: str = ""            # a re-sent Reserve with the same id gets the same slot
    owner: int = -1                 # the rollout worker's incarnation (-1: not said)


class Reservation(Message):
    slot: int                       # admission order; batches are taken in this order
    version: int                    # weights version the engines serve now
    retry_prompt: int = -1          # >= 0: regenerate this prompt (its group was rejected as stale)


class PutGroup(Message):
    group: Group
    slot: int
    owner: int = -1                 # the rollout incarnation that generated it (-1: not said)


class PutReply(Message):
    decision: Literal["keep", "retry", "drop", "stale"]
    reason: str = ""


class ReleaseSlot(Message):
    """Rollout -> buffer: a reserved group will never be put (its prompt failed for good)."""
    slot: int
    reason: str = ""


class GetBatch(Message):
    n_groups: int
    timeout_s: float = 0.0
    # Non-empty: two-phase. The groups stay the buffer's (journalled, "out") until ConfirmBatch;
    # a re-sent GetBatch with the same id (after the buffer restarted) gets the same groups.
    request_id: str = ""


class ConfirmBatch(Message):
    """Driver -> buffer: the batch of `request_id` is trained; its groups may be forgotten."""
    request_id: str
    step: int = 0                   # the training step (the ledger's `trained` entries)


class Drain(Message):
    """Node daemon -> driver: a SIGTERM / SIGUSR1 came; finish or abandon the step, checkpoint,
    and exit 0 (cluster.drain_timeout_s)."""
    reason: str = ""


class StartJob(Message):
    """Driver -> buffer, once per job: where it starts (the prompt ledger, miles/actors/ledger.py).
    `fresh`: a new run (no checkpoint, loop.resume = false, or none yet); else it resumed from
    the checkpoint of `resumed_step`."""
    resumed_step: int = 0
    fresh: bool = True
    driver: str = ""


class Batch(Message):
    groups: list[Group]
    version: int                    # the trainer's weights version these groups are trained at
    staleness: list[int] = []       # per group


class SetVersion(Message):
    version: int


class BufferMetricsRequest(Message):
    pass


class GetQueuedPrompts(Message):
    """Driver -> buffer (at a checkpoint): prompts of groups held but not yet trained."""


class QueuedPrompts(Message):
    indices: list[int]              # kept groups waiting for a batch, and stale ones to regenerate


class StartRollout(Message):
    data_state: dict[str, Any] = {}
    replay: list[int] = []          # prompt indices to generate first (untrained at the checkpoint)


class StopRollout(Message):
    pass


class RolloutState(Message):
    data_state: dict[str, Any]
    metrics: dict[str, float] = {}
    in_flight: list[int] = []       # prompt indices of groups started and not yet in the buffer


class GetRolloutState(Message):
    pass


class NoteRolloutStart(Message):
    """Rollout -> buffer, on StartRollout: the state it starts from (journalled for a restart)."""
    data_state: dict[str, Any] = {}
    replay: list[int] = []
    owner: int = 0


class GetRolloutResume(Message):
    """A restarted rollout worker -> buffer: where do I continue? Makes `owner` the slots' owner."""
    owner: int


class OrphanSlot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    slot: int
    prompt_index: int
    attempt: int = 0


class RolloutResume(Message):
    started: bool                   # False: no StartRollout was journalled yet (wait for one)
    data_state: dict[str, Any] = {}
    replay: list[int] = []
    orphans: list[OrphanSlot] = []  # slots of the dead incarnation to generate again, in place


class PauseAdmission(Message):
    paused: bool


class BatchIndex(Message):
    """What a trainer rank must know of the WHOLE step batch when it receives only its data-parallel
    share (`TrainStep.samples`): enough to compute the batch plan, the step denominators and the
    global sample count exactly as from the whole batch. A few bytes per sample, as raw frames."""
    lengths: np.ndarray           # int32 [S]: len(tokens) of every sample of the batch
    group_index: np.ndarray       # int32 [S]: groups numbered in order of first appearance
    rollout_index: np.ndarray     # int32 [S]: rollouts numbered so (no rollout_id: its own)
    trained_tokens: np.ndarray    # int32 [S]: response tokens with loss_mask 1
    positions: np.ndarray         # int32 [L]: the global position of each of TrainStep.samples
    all_rollout_logprobs: bool = False  # every sample of the batch carries rollout log-probs


class TrainStep(Message):
    samples: list[Sample]
    phase: Literal["rl", "sft"] = "rl"
    # None: `samples` is the whole batch (on every rank). Set: `samples` is this rank's DP share,
    # at `index.positions` of a batch the index describes (`miles.loop.shard_batch`).
    index: BatchIndex | None = None
    # The driver's count of train calls in this job (0: not counted). A rank healed from a
    # snapshot taken after this call answers it with the call's metrics instead of training twice.
    train_call: int = 0


class TrainResult(Message):
    metrics: dict[str, float]


class RestoreSnapshot(Message):
    """Driver -> a restarted trainer rank: -1 lists the train calls whose in-memory snapshot this
    rank holds; >= 1 restores that one (miles/backends/snapshot.py)."""
    train_call: int = -1


class SnapshotState(Message):
    train_calls: list[int] = []     # the complete snapshots this rank holds, newest first
    restored: int = -1              # the train call restored (-1: none)
    detail: str = ""                # why there is none (no keeper directory, torn, too big, ...)
    restore_s: float = 0.0


class PublishWeights(Message):
    version: int
    # Non-empty: the engine set to publish to (from the fleet's EngineSet.engine_urls +
    # pending_urls). When it differs from the set the transport is connected to, every trainer
    # rank reconnects its transport first. Empty: the set connected at start.
    engine_urls: list[str] = []


class SaveCheckpoint(Message):
    path: str
    extra_state: dict[str, Any] = {}
    hf: bool = False


class LoadCheckpoint(Message):
    path: str


class CheckpointState(Message):
    extra_state: dict[str, Any] = {}


class GetEngines(Message):
    pass


class EngineSet(Message):
    gateway_url: str
    engine_urls: list[str]          # engines serving traffic (in the gateway)
    model_path: str
    version: int = 0
    generation: int = 0             # bumped by the fleet on every change of the engine set
    pending_urls: list[str] = []    # (re)started engines waiting for the current weights; not
                                    # in the gateway until the driver says EnginesUpdated
    session_url: str = ""           # the TITO session server in front of the gateway ("" if off)
    session_token_file: str = ""    # file holding its per-job token (0600; never on the wire)


class EnginesUpdated(Message):
    """Driver -> fleet: the trainers published `version` to every engine of `generation`
    (serving + pending); the fleet may now put the pending ones into the gateway."""
    generation: int
    version: int


class Evaluate(Message):
    step: int
    version: int
    checkpoint_dir: str = ""


class EvalResult(Message):
    step: int
    version: int                    # the version the engines served (shared mode: the oldest in
                                    # the responses' weight_versions spans), not the one requested
    ok: bool
    metrics: dict[str, float] = {}
    lag_s: float = 0.0              # from the request (the step's end) to the result
    error: str = ""
    version_max: int = -1           # the newest version served; > version when an update crossed
                                    # the evaluation (-1: not known, e.g. external mode)
