"""The recipe schema: TOML decoded into msgspec Structs, validated once, with clear errors.

Design decisions:
- Defaults live in the Struct definitions below and nowhere else. A recipe only states what it
  changes. Components own their config Structs (`miles.algo.config`, `miles.backends.config`, ...)
  and this file mounts them as sections.
- Unknown keys are errors (a typo must not silently fall back to a default). Every error is one
  line naming the key path, the bad value and what was expected.
- Overrides (`--set train.lr=1e-5`) are applied to the raw TOML tree before validation, so they
  get exactly the same checks; the value is parsed as a TOML value (`1e-5`, `true`, `"x"`,
  `[1, 2]`), and anything that does not parse as TOML is taken as a string.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from miles.algo.config import LossConfig
from miles.backends.config import TrainConfig
from miles.weights.config import WeightsConfig
from miles.rl.config import (BufferConfig, DataConfig, EngineConfig, EvalConfig, LoggingConfig,
                             LoopConfig, ModelConfig, RolloutConfig, SFTConfig)


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key path, value and expectation."""


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(Base):
    name: str = "miles"
    output_dir: str = "runs/{name}"   # {name} is replaced by run.name
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class RestartPolicy(Base):
    max_restarts: int = 3
    backoff_s: float = 0.5            # first restart delay; doubles per restart
    backoff_max_s: float = 10.0


class ClusterConfig(Base):
    host: str = "127.0.0.1"           # address this node binds and advertises (launcher sets it)
    head_port: int = 29650            # the registry on the head node
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 30.0  # no heartbeat for this long: the actor is killed and restarted
    shutdown_grace_s: float = 10.0    # SIGTERM -> SIGKILL for children at shutdown
    start_timeout_s: float = 120.0    # an actor must register within this


class ActorSpec(Base):
    """Where and how one actor role runs. `cls` is `module:Class` (a user subclass works)."""
    cls: str = msgspec.field(name="class")
    node: int = 0
    nodes: list[int] | None = None    # several nodes: one process group spread over them
    procs_per_node: int = 1           # > 1 or several nodes: ranks launched like torchrun
    distributed: bool = False         # set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    main: bool = False                # the job ends when this actor finishes
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
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
    buffer: BufferConfig = _section(BufferConfig)
    engine: EngineConfig = _section(EngineConfig)
    train: TrainConfig = _section(TrainConfig)
    algo: LossConfig = _section(LossConfig)
    eval: EvalConfig = _section(EvalConfig)
    sft: SFTConfig = _section(SFTConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    weights: WeightsConfig = _section(WeightsConfig)

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


def _struct_at(cls: type, path: list[str]) -> type | None:
    """The Struct type found at a key path, for listing the keys it accepts."""
    import typing
    for key in path:
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            args = [a for a in typing.get_args(cls) if a is not type(None)]
            cls = args[-1] if args else None
            if cls is None:
                return None
            if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
                continue  # dict[str, Spec]: the key is a name, move into the value type
        info = {f.encode_name: f.type for f in msgspec.structs.fields(cls)}
        if key not in info:
            return None
        cls = info[key]
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return cls
    args = [a for a in __import__("typing").get_args(cls) if isinstance(a, type)
            and issubclass(a, msgspec.Struct)]
    return args[0] if args else None


def _explain(err: msgspec.ValidationError, tree: dict, source: str, prefix: list[str] = (),
             root: type = None) -> RecipeError:
    text = str(err)
    message, _, where = text.partition(" - at `")
    path = [*prefix, *[p for p in where.rstrip("`").removeprefix("$").replace("[", ".")
                       .replace("]", "").strip(".").split(".") if p]] if where else [*prefix]
    key = ".".join(path) or "<top level>"
    if message.startswith("Object contains unknown field"):
        bad = message.split("`")[1]
        full = ".".join([*path, bad])
        owner = _struct_at(Recipe, [p for p in path if not _is_name(path, p)])
        known = ", ".join(f.encode_name for f in msgspec.structs.fields(owner)) if owner else "?"
        return RecipeError(f"{source}: {full}: unknown key; expected one of: {known}")
    value = _lookup(tree, path)
    if isinstance(value, dict) and "=" in message:  # a section's own check (__post_init__)
        return RecipeError(f"{source}: {key}: {message.removeprefix(key + '.')}")
    if message.startswith("Object missing required field"):
        bad = message.split("`")[1]
        return RecipeError(f"{source}: {'.'.join([*path, bad])}: required key is missing")
    return RecipeError(f"{source}: {key} = {value!r}: {message[0].lower() + message[1:]}")


def _is_name(path: list[str], part: str) -> bool:
    """True for the parts of a key path that are names in a table of specs (actors.<name>)."""
    i = path.index(part)
    return i > 0 and path[i - 1] in _NAMED_TABLES


_NAMED_TABLES = {"actors"}


def _convert_named_tables(tree: dict, source: str) -> None:
    """Validate each entry of a `[table.<name>]` map on its own, so errors name the entry
    (msgspec reports map values without their key)."""
    for table in _NAMED_TABLES:
        entries = tree.get(table)
        if not isinstance(entries, dict):
            continue
        value_type = next(f.type for f in msgspec.structs.fields(Recipe) if f.name == table)
        spec_type = __import__("typing").get_args(value_type)[1]
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, spec_type, strict=True)
            except msgspec.ValidationError as e:
                raise _explain(e, tree, source, [table, name]) from None


def load_recipe(path: str | Path | None = None, overrides: list[str] = (),
                text: str | None = None) -> Recipe:
    """Read a recipe file (or `text`), apply overrides, validate; raise RecipeError on any problem."""
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
    _check(recipe, source)
    return recipe


def _check(recipe: Recipe, source: str) -> None:
    """Cross-field rules that types alone cannot express."""
    mains = [name for name, spec in recipe.actors.items() if spec.main]
    if len(mains) > 1:
        raise RecipeError(f"{source}: actors.*.main: only one actor may be main, got {mains}")
    for name, spec in recipe.actors.items():
        if ":" not in spec.cls:
            raise RecipeError(f"{source}: actors.{name}.class = {spec.cls!r}: expected "
                              f"'module:Class'")
        if spec.procs_per_node < 1:
            raise RecipeError(f"{source}: actors.{name}.procs_per_node = {spec.procs_per_node}: "
                              f"expected >= 1")
        if spec.node < 0:
            raise RecipeError(f"{source}: actors.{name}.node = {spec.node}: expected >= 0")
    if not 0 < recipe.cluster.head_port < 65536:
        raise RecipeError(f"{source}: cluster.head_port = {recipe.cluster.head_port}: expected a "
                          f"TCP port in 1..65535")


def recipe_to_json(recipe: Recipe) -> bytes:
    return msgspec.json.encode(recipe)


def recipe_from_json(data: bytes) -> Recipe:
    return msgspec.json.decode(data, type=Recipe)
