"""A recipe against the world: what `miles check` and `miles run` verify before anything starts.

`miles.config.load_recipe` checks a recipe as data (types, ranges, rules across sections). This
module checks what data alone cannot: that every import path resolves to something that honours
its plug-in contract, that the paths it names exist, and that a recipe which runs the RL loop has
what the loop needs (a model, a data set, eval and warm-start data). It also returns warnings for
combinations that run but train silently wrong.

Design decisions:
- Every plug-in key is checked by its contract in `miles.plugins`, the same one the actor that
  loads it applies, so "resolves here" means "loads there"; this module checks only what is not
  a plug-in (paths, models, the teacher, combinations of sections). A batched reward cannot run
  with a sandbox (it sees a group, not an episode).
- A recipe runs the loop when what it will place (`with_default_actors`) is empty or has a
  `LoopDriver`. A recipe of only its own actors (the demo, the runtime tests) needs no model.
- Errors are `RecipeError`s of the one recipe shape (`<source>: key.path = value: expected ...`);
  warnings are plain lines: the recipe runs, but the user should know.
"""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path

from miles import plugins
from miles.config import Recipe, RecipeError, bad_value
from miles.loop import LoopDriver
from miles.rl.sources import with_default_actors
from miles.tiny import ARCH_CONFIGS
from miles.wire.auth import keys_from_env


def check_recipe(recipe: Recipe, source: str = "<recipe>") -> list[str]:
    """Raise RecipeError for the first problem found; return the warnings of a usable recipe."""
    for key, value, context in plugins.recipe_plugins(recipe):
        plugins.check(key, value, source, **context)
    if recipe.sandbox.backend and recipe.rollout.reward_batched:
        raise bad_value(source, "rollout.reward_batched", True,
                        f"expected false with sandbox.backend = {recipe.sandbox.backend!r}: a batched "
                        f"reward sees a group, and each episode's sandbox is gone by then")
    _check_model(recipe, source)
    _check_teacher(recipe, source)
    _check_choices_and_paths(recipe, source)

    placed = with_default_actors(recipe).actors
    if placed and not any(issubclass(pkgutil.resolve_name(spec.cls), LoopDriver)
                          for spec in placed.values()):
        return []  # only the recipe's own actors: no loop, no model needed
    _check_loop_inputs(recipe, source)
    return loop_warnings(recipe)


def check_placement(recipe: Recipe, nnodes: int, source: str = "<recipe>") -> None:
    """Every actor is placed on a node this job has (`miles run` knows the job's node count)."""
    for role, spec in sorted(recipe.actors.items()):
        for node in spec.nodes if spec.nodes is not None else [spec.node]:
            if node >= nnodes:
                key = f"actors.{role}.{'nodes' if spec.nodes is not None else 'node'}"
                raise bad_value(source, key, spec.nodes if spec.nodes is not None else spec.node,
                                f"expected nodes < {nnodes}: this job has {nnodes} node(s) "
                                f"(NNODES / SLURM_NNODES)")
    if recipe.cluster.auth == "curve" and nnodes > 1 and keys_from_env() is None:
        # each node would make a key of its own, and no node could talk to another
        raise bad_value(source, "cluster.auth", "curve",
                        f"a job on {nnodes} nodes needs one key for all of them: export it to "
                        f"every node first (eval $(python -m miles.wire.auth))")


def loop_warnings(recipe: Recipe) -> list[str]:
    """Combinations that run, but train stale samples uncorrected or record nothing."""
    out = []
    staleness, train, algo = recipe.loop.staleness, recipe.train, recipe.algo
    if staleness > 0 and train.old_logprobs != "rollout" and not (algo.use_tis or algo.use_mis):
        out.append(f"train.old_logprobs = {train.old_logprobs!r} with loop.mode = "
                   f"{recipe.loop.mode!r} (staleness {staleness}) and neither algo.use_tis nor "
                   f"algo.use_mis: samples up to {staleness} versions old train with no correction "
                   f"for the policy that sampled them; use old_logprobs = 'rollout' (needs "
                   f"train.steps_per_train = 1) or algo.use_tis = true")
    if recipe.logging.record_steps and not recipe.logging.record_wire:
        out.append(f"logging.record_steps = {recipe.logging.record_steps}: nothing is recorded "
                   f"unless logging.record_wire = true")
    return out


def _check_model(recipe: Recipe, source: str) -> None:
    model = recipe.model
    if model.tiny and not model.path:
        if model.tiny not in ARCH_CONFIGS:
            raise bad_value(source, "model.tiny", model.tiny,
                            f"expected one of {', '.join(sorted(ARCH_CONFIGS))}")
    for key, path in (("model.path", model.path), ("train.model_path", recipe.train.model_path),
                      ("train.ref_model_path", recipe.train.ref_model_path)):
        if path and not (Path(path) / "config.json").is_file():
            what = "does not exist" if not Path(path).exists() else "has no config.json"
            raise bad_value(source, key, path, f"expected an HF model directory; it {what}")
    if recipe.rollout.r3:
        _check_moe(recipe, source)


def _check_teacher(recipe: Recipe, source: str) -> None:
    """On-policy distillation's teacher: on the trainer (`train.teacher_model_path`) or on the
    rollout side (`[teacher]`), exactly one of them when `algo.opd_kl_coef > 0`, none otherwise."""
    teacher, train, algo = recipe.teacher, recipe.train, recipe.algo
    on_rollout = bool(teacher.path or teacher.tiny)
    key = "teacher.path" if teacher.path or not teacher.tiny else "teacher.tiny"
    value = teacher.path or teacher.tiny
    if not on_rollout:
        if algo.opd_kl_coef > 0 and algo.loss_type == "policy" and not train.teacher_model_path \
                and not train.teacher_from_samples:
            raise bad_value(source, "algo.opd_kl_coef", algo.opd_kl_coef,
                            "distils from a teacher: set train.teacher_model_path (a trainer-side "
                            "teacher) or teacher.path / teacher.tiny (teacher engines on the rollout side)")
        return
    if train.teacher_model_path:
        raise bad_value(source, "train.teacher_model_path", train.teacher_model_path,
                        "expected '' with [teacher] set (teacher.path / teacher.tiny): the teacher "
                        "is on the rollout side (one teacher, one place)")
    if not (algo.opd_kl_coef > 0 and algo.loss_type == "policy"):
        raise bad_value(source, key, value, f"expected algo.opd_kl_coef > 0 (it is {algo.opd_kl_coef}): "
                        "the teacher engines' log-probs would train nothing")
    if recipe.rollout.temperature != 1.0:
        raise bad_value(source, "rollout.temperature", recipe.rollout.temperature,
                        "expected 1.0 with [teacher] set: the teacher engines' prompt log-probs "
                        "are of the raw logits, the student's of logits / temperature")
    if teacher.engine.kind == "embedded" and recipe.rollout.max_new_tokens >= teacher.engine.context_length:
        raise bad_value(source, "teacher.engine.context_length", teacher.engine.context_length,
                        f"expected > rollout.max_new_tokens ({recipe.rollout.max_new_tokens}): the "
                        "teacher scores prompt + response")
    if teacher.path:
        if not (Path(teacher.path) / "config.json").is_file():
            what = "does not exist" if not Path(teacher.path).exists() else "has no config.json"
            raise bad_value(source, "teacher.path", teacher.path, f"expected an HF model directory; it {what}")
        teacher_vocab = json.loads((Path(teacher.path) / "config.json").read_text()).get("vocab_size")
    else:
        if teacher.tiny not in ARCH_CONFIGS:
            raise bad_value(source, "teacher.tiny", teacher.tiny,
                            f"expected one of {', '.join(sorted(ARCH_CONFIGS))}")
        teacher_vocab = teacher.tiny_overrides.get("vocab_size")
    model = recipe.model
    student_vocab = (json.loads((Path(model.path) / "config.json").read_text()).get("vocab_size")
                     if model.path and (Path(model.path) / "config.json").is_file()
                     else model.tiny_overrides.get("vocab_size"))
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise bad_value(source, key, value, f"vocab_size {teacher_vocab} differs from the student's "
                        f"{student_vocab}: distillation needs the same tokenizer")


def _check_moe(recipe: Recipe, source: str) -> None:
    """rollout.r3 replays MoE routing: a dense model has none to replay."""
    model = recipe.model
    if model.path:
        config = json.loads((Path(model.path) / "config.json").read_text())
        which = f"model.path = {model.path!r}"
    elif model.tiny:
        config = {**ARCH_CONFIGS[model.tiny], **model.tiny_overrides}
        which = f"model.tiny = {model.tiny!r}"
    else:
        return  # no model at all: _check_loop_inputs says so
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
    if int(experts) < 1:
        raise bad_value(source, "rollout.r3", True,
                        f"expected a mixture-of-experts model, but {which} is dense (no num_experts "
                        f"in its config): there is no routing to replay")


def _check_choices_and_paths(recipe: Recipe, source: str) -> None:
    if recipe.engine.gateway_policy != "manual":  # the default; importing the gateway costs aiohttp
        from miles.engines.gateway import POLICIES
        if recipe.engine.gateway_policy not in POLICIES:
            raise bad_value(source, "engine.gateway_policy", recipe.engine.gateway_policy,
                            f"expected one of {', '.join(POLICIES)}")
    data = recipe.data
    for key in ("path", "eval_path", "sft_path"):
        path = getattr(data, key)
        if path and not Path(path).is_file():
            what = "it is not a file" if Path(path).exists() else "it does not exist"
            raise bad_value(source, f"data.{key}", path, f"expected a .jsonl or .parquet file; {what}")


def _check_loop_inputs(recipe: Recipe, source: str) -> None:
    """What the loop reads: a model, prompts to train on, and the eval and warm-start sets."""

    model, data = recipe.model, recipe.data
    if not (model.path or model.tiny):
        raise RecipeError(f"{source}: model: set model.path (an HF directory) or model.tiny (one of "
                          f"{', '.join(sorted(ARCH_CONFIGS))}); the RL loop needs a model")
    if not (data.path or data.task or data.source):
        raise RecipeError(f"{source}: data: set data.path (a .jsonl/.parquet file), data.task or "
                          f"data.source; the RL loop needs prompts to train on")
    if recipe.eval.mode in ("shared", "fleet") and not (data.eval_path or data.task):
        raise bad_value(source, "data.eval_path", data.eval_path,
                        f"expected a file for eval.mode = {recipe.eval.mode!r} (or data.task, or "
                        f"eval.mode = 'off')")
    if recipe.sft.steps and not (data.sft_path or data.task):
        raise bad_value(source, "data.sft_path", data.sft_path,
                        f"expected a file for sft.steps = {recipe.sft.steps} (or data.task, or "
                        f"sft.steps = 0)")
