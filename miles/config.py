"""The recipe schema: TOML decoded into msgspec Structs, validated once, with clear errors.

Design decisions:
- Defaults live in the Struct definitions below and nowhere else. A recipe only states what it
  changes. Components own their config Structs (`miles.algo.config`, `miles.backends.config`, ...)
  and this file mounts them as sections.
- Unknown keys are errors (a typo must not silently fall back to a default). Every error is one
  line, `key.path = value: what was expected`: ranges are `msgspec.Meta` constraints declared on
  the fields, a section's own `__post_init__` check is reworded into the same form (`_explain`).
- Three layers of checks, all before anything starts: types and ranges (msgspec, at decode), rules
  across fields and sections (`_check`: sync mode vs an explicit `loop.max_staleness`, the two
  temperatures, a buffer smaller than a batch), and rules about the world (paths exist, import
  paths resolve, a loop recipe names a model and data: `miles.recipe_checks`).
- "Explicitly given" is read from the raw TOML tree plus overrides, so a default never contradicts.
- `train.old_logprobs = "auto"` is resolved at load: when the loop trains stale samples
  (`loop.staleness > 0`) and one optimizer step per batch, it becomes "rollout" (PPO's ratio
  against the policy that sampled); left as "auto" it would train them with a ratio of exactly 1.
- Overrides (`--set train.lr=1e-5`) are applied to the raw TOML tree before validation, so they
  get exactly the same checks; the value is parsed as a TOML value (`1e-5`, `true`, `"x"`,
  `[1, 2]`), and anything that does not parse as TOML is taken as a string.
"""

from __future__ import annotations

import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from miles.algo.config import LossConfig
from miles.backends.config import TrainConfig
from miles.weights.config import WeightsConfig
from miles.quant.config import QuantConfig
from miles.engines.config import EngineConfig
from miles.envs.config import AgentConfig
from miles.rl.config import (BufferConfig, DataConfig, EvalConfig, LoggingConfig, LoopConfig,
                             ModelConfig, RolloutConfig, SFTConfig, TeacherConfig)
from miles.sandboxes.config import SandboxConfig
from miles.sections import Count, NonNegative, Positive, RecipeError, Seconds, bad_value, show
from miles.tito.config import SessionConfig

Port = Annotated[int, Meta(ge=1, le=65535)]


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(Base):
    # the run's name: its output directory and its sessions' and sandboxes' labels
    name: str = "miles"
    output_dir: str = "runs/{name}"   # {name} is replaced by run.name
    # seeds the data order and every sample's sampling seed (per prompt, sample and attempt)
    seed: Count = 0
    # the actors' log level (their own logs; the console shows warnings and up)
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class RestartPolicy(Base):
    # restarts of a crashed actor within `window_s` before the job fails naming it
    max_restarts: Count = 3
    backoff_s: NonNegative = 0.5      # first restart delay; doubles per restart in the window
    # the restart delay's ceiling
    backoff_max_s: NonNegative = 10.0
    # restarts longer ago than this no longer count against max_restarts (0: the whole run's do)
    window_s: NonNegative = 600.0
    # keep one warm spare process of the actor (its modules imported) for the next restart, which
    # then skips Python's start and the imports; it costs that process's memory. The trainer's
    # default is on (a healed rank, docs/recovery.md)
    spare: bool = False


class ClusterConfig(Base):
    host: str = "127.0.0.1"           # address this node binds and advertises (launcher sets it)
    head_port: Port = 29650           # the registry on the head node
    # how often every actor tells the registry it is alive
    heartbeat_interval_s: Seconds = 1.0
    liveness_timeout_s: Seconds = 30.0  # no heartbeat for this long: the actor is killed and restarted
    shutdown_grace_s: NonNegative = 10.0  # SIGTERM -> SIGKILL for children at shutdown
    # SIGTERM or SIGUSR1 to an RL job (launch/miles.sh, the node daemon) drains it: the step in
    # progress finishes (or its wait for a batch is abandoned), a checkpoint is written and the
    # job exits 0, resumable by the same command; past this deadline it stops as for SIGINT.
    # Below Slurm's KillWait (30 s by default). SIGINT (Ctrl-C) never drains.
    drain_timeout_s: Seconds = 25.0
    start_timeout_s: Seconds = 120.0  # an actor must register within this
    auth: Literal["none", "curve"] = "none"  # curve: CurveZMQ keys made per job, passed by env
    # Same-node bulk data (a TrainStep's arrays) goes through shared memory when a message's array
    # bytes reach this; 0 sends every array as ZeroMQ frames (miles/wire/shm.py).
    shm_min_bytes: Count = 8 << 20
    # A node daemon that stops answering the head for this long is lost: the job stops with a
    # named error (docs/recovery.md); the same command resumes from the newest checkpoint.
    node_timeout_s: Seconds = 30.0


class ActorSpec(Base):
    """Where and how one actor role runs. `cls` is `module:Class` (a user subclass works)."""
    # the actor class, `module:Class` (a user subclass works)
    cls: str = msgspec.field(name="class")
    # the node rank the actor runs on
    node: Count = 0
    nodes: list[Count] | None = None  # several nodes: one process group spread over them
    procs_per_node: Positive = 1      # > 1 or several nodes: ranks launched like torchrun
    # With `nodes`: one independent actor per listed node instead of one process group (named
    # `<role>` on the first node, `<role>@<k>` on node k); the engine fleet is placed this way.
    per_node: bool = False
    distributed: bool = False         # set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    main: bool = False                # the job ends when this actor finishes
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    # extra environment variables for the actor's processes
    env: dict[str, str] = {}
    options: dict[str, Any] = {}      # free-form, read by the actor class


def _section(cls):
    return msgspec.field(default_factory=cls)


class Recipe(Base):
    run: RunConfig = _section(RunConfig)
    cluster: ClusterConfig = _section(ClusterConfig)
    actors: dict[str, ActorSpec] = {}
    # the RL loop (miles.loop); unused by recipes that only place their own actors
    loop: LoopConfig = _section(LoopConfig)
    model: ModelConfig = _section(ModelConfig)
    data: DataConfig = _section(DataConfig)
    rollout: RolloutConfig = _section(RolloutConfig)
    agent: AgentConfig = _section(AgentConfig)
    sandbox: SandboxConfig = _section(SandboxConfig)
    session: SessionConfig = _section(SessionConfig)
    buffer: BufferConfig = _section(BufferConfig)
    engine: EngineConfig = _section(EngineConfig)
    teacher: TeacherConfig = _section(TeacherConfig)   # on-policy distillation's teacher engines
    train: TrainConfig = _section(TrainConfig)
    algo: LossConfig = _section(LossConfig)
    eval: EvalConfig = _section(EvalConfig)
    sft: SFTConfig = _section(SFTConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    weights: WeightsConfig = _section(WeightsConfig)
    quant: QuantConfig = _section(QuantConfig)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir.replace("{name}", self.run.name))


# ---------------------------------------------------------------------------------------------

def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `section.key=value` override to a raw TOML tree."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected section.key=value")
    path, text = assignment.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise RecipeError(f"--set {assignment!r}: empty key in path {path!r}")
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {assignment!r}: {k!r} is a value, not a section")
        node = nxt
    node[keys[-1]] = _parse_value(text.strip())


def _lookup(tree: Any, path: list[str]) -> Any:
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        else:
            return None
    return tree


def _plain(tp: Any) -> Any:
    """`Annotated[X, Meta(...)]` -> X and `X | None` -> X: the type a value must have."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _type_at(path: list[str]) -> Any:
    """The declared type at a key path of the recipe (None once the path leaves the schema);
    the name in `actors.<name>` and a list index step into the value type."""
    tp: Any = Recipe
    for key in path:
        tp = _plain(tp)
        if _is_struct(tp):
            fields = {f.encode_name: f.type for f in msgspec.structs.fields(tp)}
            if key not in fields:
                return None
            tp = fields[key]
        elif typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        else:
            return None
    return _plain(tp)


def _split_path(where: str) -> list[str]:
    return [p for p in where.rstrip("`").removeprefix("$").replace("[", ".").replace("]", "")
            .strip(".").split(".") if p]


def _explain(err: msgspec.ValidationError, tree: dict, source: str,
             prefix: list[str] = ()) -> RecipeError:
    message, _, where = str(err).partition(" - at `")
    path = [*prefix, *_split_path(where)]
    key = ".".join(path) or "<top level>"
    if message.startswith("Object contains unknown field"):
        bad = message.split("`")[1]
        owner = _type_at(path)
        known = ", ".join(f.encode_name for f in msgspec.structs.fields(owner)) if _is_struct(owner) else "?"
        return RecipeError(f"{source}: {'.'.join([*path, bad])}: unknown key; expected one of: {known}")
    if message.startswith("Object missing required field"):
        bad = message.split("`")[1]
        return RecipeError(f"{source}: {'.'.join([*path, bad])}: required key is missing")
    value = _lookup(tree, path)
    if isinstance(value, dict) and not message.startswith(("Expected", "Invalid")):
        return RecipeError(f"{source}: {_reword_section_check(message, path, value)}")
    return RecipeError(f"{source}: {key} = {show(value)}: {_reword(message, path)}")


def _reword(message: str, path: list[str]) -> str:
    """msgspec's own words, as `expected ...` (a bound without the type, an enum with its choices)."""
    bound = re.match(r"Expected `\w+` ([<>]=? .*)$", message)
    if bound:
        return f"expected {bound.group(1)}"
    choices = _type_at(path)
    if message.startswith("Invalid enum value") and typing.get_origin(choices) is Literal:
        return "expected one of " + ", ".join(map(str, typing.get_args(choices)))
    return message[0].lower() + message[1:]


def _reword_section_check(message: str, path: list[str], section: dict) -> str:
    """A section's `__post_init__` message (`train.lr=-1.0 must be >= 0.0`, `eps_clip=-1 must be
    > 0.0`, `algo.eps_clip = -1: must be > 0`) as `train.lr = -1.0: expected >= 0.0`."""
    name = ".".join(path)
    own = rf"^(?:{re.escape(name)}\.)?(\w+)"
    m = re.match(own + r"\s*=\s*(.+?)(?:: | (?=must |is not one of |needs ))(.*)$", message)
    if m:
        field, shown, rest = m.groups()
        rest = re.sub(r"^must be ", "expected ", re.sub(r"^is not one of ", "expected one of ", rest))
        rest = re.sub(r"^must ", "expected to ", rest)
    else:
        m = re.match(own + r" is empty(?:; )?(.*)$", message)
        if not m:
            return f"{name}: {message}"
        field, shown, rest = m.group(1), "''", "expected a non-empty value" + (
            f"; {m.group(2)}" if m.group(2) else "")
    shown = show(section[field]) if field in section else shown
    return f"{name}.{field} = {shown}: {rest}"


_NAMED_TABLES = {"actors"}


def _convert_named_tables(tree: dict, source: str) -> None:
    """Validate each entry of a `[table.<name>]` map on its own, so errors name the entry
    (msgspec reports map values without their key)."""
    for table in _NAMED_TABLES:
        entries = tree.get(table)
        if not isinstance(entries, dict):
            continue
        spec_type = typing.get_args(_type_at([table]))[1]
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, spec_type, strict=True)
            except msgspec.ValidationError as e:
                raise _explain(e, tree, source, [table, name]) from None


def load_recipe(path: str | Path | None = None, overrides: list[str] = (),
                text: str | None = None) -> Recipe:
    """Read a recipe file (or `text`), apply overrides, validate; raise RecipeError on any problem.

    This checks the recipe as data; `miles.recipe_checks.check_recipe` then checks it against the
    world (files, import paths) before `miles check` / `miles run` accept it."""
    source = str(path) if path is not None else "<recipe>"
    if text is None:
        if path is None:
            text = ""
        else:
            try:
                text = Path(path).read_text()
            except OSError as e:
                raise RecipeError(f"{source}: cannot read recipe: {e.strerror}") from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{source}: not valid TOML: {e}") from None
    for assignment in overrides:
        apply_override(tree, assignment)
    _convert_named_tables(tree, source)
    try:
        recipe = msgspec.convert(tree, Recipe, strict=True)
    except msgspec.ValidationError as e:
        raise _explain(e, tree, source) from None
    _check(recipe, tree, source)
    return _resolve(recipe)


def _given(tree: dict, section: str, key: str) -> bool:
    """Whether the recipe (or an override) states this key, as opposed to taking its default."""
    table = tree.get(section)
    return isinstance(table, dict) and key in table


def _check(recipe: Recipe, tree: dict, source: str) -> None:
    """Rules across fields and sections, which the per-field types and bounds cannot express."""
    for key, value in _infinite(recipe, []):
        raise bad_value(source, ".".join(key), value, "expected a finite number")
    mains = [name for name, spec in recipe.actors.items() if spec.main]
    if len(mains) > 1:
        raise RecipeError(f"{source}: actors.*.main: only one actor may be main, got {mains}")
    for name, spec in recipe.actors.items():
        module, _, attr = spec.cls.partition(":")
        if not module or not attr:
            raise bad_value(source, f"actors.{name}.class", spec.cls, "expected 'module:Class'")
        if spec.per_node and spec.procs_per_node != 1:
            raise bad_value(source, f"actors.{name}.procs_per_node", spec.procs_per_node,
                            "expected 1 with per_node = true (one actor per node)")
    c = recipe.cluster
    if c.liveness_timeout_s <= c.heartbeat_interval_s:
        raise bad_value(source, "cluster.liveness_timeout_s", c.liveness_timeout_s,
                        f"expected > cluster.heartbeat_interval_s ({c.heartbeat_interval_s}), or every "
                        f"actor is killed for a missed heartbeat")
    loop = recipe.loop
    if loop.mode != "fully_async" and _given(tree, "loop", "max_staleness") \
            and loop.max_staleness != loop.staleness:
        raise bad_value(source, "loop.max_staleness", loop.max_staleness,
                        f"expected {loop.staleness} with loop.mode = {loop.mode!r} (the mode fixes the "
                        f"staleness): remove the key, --set loop.max_staleness={loop.staleness}, or "
                        f"use loop.mode = 'fully_async'")
    if recipe.quant.format and recipe.engine.kind != "embedded":
        raise bad_value(source, "quant.rollout", recipe.quant.rollout,
                        "expected 'bf16' with engine.kind = 'sglang': quantized weight updates are "
                        "wired for the embedded engine only (miles/quant)")
    if recipe.quant.format and recipe.weights.transport == "disk_delta":
        raise bad_value(source, "weights.transport", "disk_delta",
                        f"expected nccl, colocated or disk with quant.rollout = "
                        f"{recipe.quant.rollout!r}: a delta XORs against the engine's tensors, "
                        "which hold dequantized weights, not the quantized parts")
    sft = recipe.sft
    if sft.until_heldout and sft.steps and not 1 <= sft.check_every <= sft.steps:
        raise bad_value(source, "sft.check_every", sft.check_every,
                        f"expected 1 to sft.steps ({sft.steps}) with sft.until_heldout = "
                        f"{sft.until_heldout}: how many warm-start steps between two checks")
    if sft.until_heldout and sft.steps and sft.check_from > sft.steps:
        raise bad_value(source, "sft.check_from", sft.check_from,
                        f"expected at most sft.steps ({sft.steps}): the step of the first held-out check")
    if sft.until_heldout and sft.steps and recipe.eval.mode != "shared":
        raise bad_value(source, "eval.mode", recipe.eval.mode,
                        "expected 'shared' with sft.until_heldout: the check evaluates the "
                        "warm start's weights on the rollout engines")
    ro, train = recipe.rollout, recipe.train
    if ro.temperature == 0 and _given(tree, "rollout", "temperature"):
        raise bad_value(source, "rollout.temperature", 0.0,
                        "expected > 0: the trainer needs the log-probs of a sampling policy "
                        "(greedy evaluation is eval.temperature = 0)")
    if ro.temperature != train.temperature:
        raise bad_value(source, "train.temperature", train.temperature,
                        f"expected rollout.temperature ({ro.temperature}): the trainer divides its "
                        f"logits by the temperature the engines sampled with, or every importance "
                        f"ratio is wrong")
    if train.backend == "megatron" and train.lora is not None:
        raise bad_value(source, "train.lora", "{...}", "LoRA is built for train.backend = 'fsdp' only; "
                        "the Megatron backend would train the full model")
    if train.backend == "megatron":
        spec = recipe.actors.get("trainer")
        world = len(spec.nodes or [spec.node]) * spec.procs_per_node if spec else 1
        try:
            train.megatron.data_parallel(world)
        except ValueError as exc:
            raise RecipeError(f"{source}: {exc} (the trainer has {world} rank(s): actors.trainer "
                              "nodes x procs_per_node)") from None
    if ro.top_k == 0:
        raise bad_value(source, "rollout.top_k", 0, "expected -1 (off) or >= 1")
    if recipe.engine.kind == "embedded" and ro.max_new_tokens >= recipe.engine.context_length:
        raise bad_value(source, "rollout.max_new_tokens", ro.max_new_tokens,
                        f"expected < engine.context_length ({recipe.engine.context_length}), which "
                        f"must also hold the prompt")
    if recipe.buffer.capacity_groups < loop.groups_per_step:
        raise bad_value(source, "buffer.capacity_groups", recipe.buffer.capacity_groups,
                        f"expected >= loop.groups_per_step ({loop.groups_per_step}), or no batch "
                        f"ever fills")
    depths = [k for k in ("generate", "agent", "function") if getattr(ro, k)]
    if len(depths) > 1:
        raise bad_value(source, f"rollout.{depths[1]}", getattr(ro, depths[1]),
                        f"expected at most one of rollout.generate / rollout.agent / rollout.function "
                        f"(rollout.{depths[0]} is set too)")
    if recipe.session.enabled == "off" and ro.agent:
        raise bad_value(source, "session.enabled", "off",
                        "expected 'auto' or 'on': rollout.agent talks to the session server")
    if recipe.eval.mode == "external" and not recipe.eval.command.strip():
        raise bad_value(source, "eval.command", recipe.eval.command,
                        "expected a command (with {checkpoint} and {step}) for eval.mode = 'external'")


def _infinite(obj: msgspec.Struct, path: list[str]):
    """Key paths of infinite floats: TOML allows `inf`, but no knob of ours means forever."""
    for f in msgspec.structs.fields(obj):
        value, key = getattr(obj, f.name), [*path, f.encode_name]
        if isinstance(value, float) and not math.isfinite(value):
            yield key, value
        elif isinstance(value, msgspec.Struct):
            yield from _infinite(value, key)
        elif isinstance(value, dict) and value and all(isinstance(v, msgspec.Struct) for v in value.values()):
            for name, v in value.items():
                yield from _infinite(v, [*key, name])


def _resolve(recipe: Recipe) -> Recipe:
    """Defaults that depend on other sections, settled once here (see the module docstring)."""
    train, rollout = recipe.train, recipe.rollout
    if train.old_logprobs == "auto" and recipe.loop.staleness > 0 and train.steps_per_train == 1:
        train = msgspec.structs.replace(train, old_logprobs="rollout")
    if rollout.r3:  # one switch: the engines capture, samples carry, the trainer replays
        rollout = msgspec.structs.replace(rollout, return_routed_experts=True)
        train = msgspec.structs.replace(train, router_replay=True)
    return msgspec.structs.replace(recipe, train=train, rollout=rollout)


def recipe_to_json(recipe: Recipe) -> bytes:
    return msgspec.json.encode(recipe)


def recipe_from_json(data: bytes) -> Recipe:
    return msgspec.json.decode(data, type=Recipe)
