"""Preparing a recipe's inputs: the model directory, the data files, the tokenizer, data sources.

`prepare_recipe` runs once per node before any actor starts: it builds the tiny model (and a tiny
`[teacher]`, which also marks the trainer teacher-less: `train.teacher_from_samples`) and the
synthetic task when the recipe asks for them (offline, cached), and fills in the paths every
actor then reads from the resolved recipe (`model.path`, `train.model_path`, `data.*`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import msgspec

from miles.config import ActorSpec, RestartPolicy
from miles.rl.data import FileSource
from miles import plugins



def prepare_recipe(recipe):
    model, data, train = recipe.model, recipe.data, recipe.train
    if model.tiny and not model.path:
        from miles.tiny import build_tiny_model, build_tokenizer
        tok = build_tokenizer(vocab_size=model.tokenizer_vocab)
        model = msgspec.structs.replace(model, path=str(build_tiny_model(
            arch=model.tiny, seed=recipe.run.seed, tokenizer_dir=tok, **model.tiny_overrides)))
    if model.path and not train.model_path:
        train = msgspec.structs.replace(train, model_path=model.path)
    teacher = recipe.teacher
    if teacher.tiny and not teacher.path:  # the student's tokenizer, so token ids agree
        from miles.tiny import build_tiny_model, build_tokenizer
        tok = build_tokenizer(vocab_size=model.tokenizer_vocab)
        teacher = msgspec.structs.replace(teacher, path=str(build_tiny_model(
            arch=teacher.tiny, seed=recipe.run.seed, tokenizer_dir=tok, **teacher.tiny_overrides)))
    if teacher.path:  # the rollout's teacher engines score every sample: no trainer-side teacher
        train = msgspec.structs.replace(train, teacher_from_samples=True)
    if data.task and not data.path:
        from miles.rl.tasks import make_task
        out = Path(recipe.output_dir) / "data"
        make_task(out, data.task, seed=recipe.run.seed)
        data = msgspec.structs.replace(
            data, path=str(out / "train.jsonl"), eval_path=data.eval_path or str(out / "test.jsonl"),
            sft_path=data.sft_path or (str(out / "sft.jsonl") if (out / "sft.jsonl").exists() else ""))
    return with_default_actors(msgspec.structs.replace(recipe, model=model, data=data, train=train,
                                                       teacher=teacher))


@lru_cache(maxsize=4)
def tokenizer_for(model_path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path)


def make_source(recipe, split: str = "train"):
    data = recipe.data
    if data.source and split == "train":
        return plugins.load("data.source", data.source)(recipe)
    path = {"train": data.path, "eval": data.eval_path, "sft": data.sft_path}[split]
    if not path:
        raise ValueError(f"data.{'path' if split == 'train' else split + '_path'}: not set "
                         f"(and no data.task to make one)")
    return FileSource(path, prompt_key=data.prompt_key, label_key=data.label_key,
                      metadata_key=data.metadata_key, shuffle=data.shuffle and split != "eval",
                      seed=recipe.run.seed)


RL_ROLES = {
    "driver": ("miles.loop:LoopDriver", {"main": True}),
    "buffer": ("miles.actors.buffer:Buffer", {}),
    "rollout": ("miles.actors.rollout:RolloutWorker", {}),
    "engines": ("miles.engines.fleet:EngineFleet", {}),
    "trainer": ("miles.actors.trainer:Trainer", {"distributed": True, "spare": True}),
    "evaluator": ("miles.actors.evaluator:Evaluator", {}),
}
TEACHER_ROLE = ("teacher_engines", "miles.engines.fleet:TeacherFleet")  # with [teacher] only


def with_default_actors(recipe):
    """An RL recipe (it names a model) gets the standard roles for those it does not place itself;
    `rollout.worker` picks the rollout class. A recipe of only its own actors is left alone."""

    if not (recipe.model.path or recipe.model.tiny) or (recipe.actors and "driver" not in recipe.actors
                                                        and not any(k in recipe.actors for k in RL_ROLES)):
        return recipe
    actors = dict(recipe.actors)
    roles = dict(RL_ROLES)
    if recipe.teacher.path or recipe.teacher.tiny:
        roles[TEACHER_ROLE[0]] = (TEACHER_ROLE[1], {})
    for role, (cls, extra) in roles.items():
        if role == "rollout":
            cls = recipe.rollout.worker
        if role not in actors:
            env = {}
            if role == "trainer" and recipe.engine.device == "cpu" and recipe.engine.kind == "embedded":
                # CPU engines and the trainer share the cores: give the trainer what the engines
                # leave, or OpenMP's spinning threads fight the engines (training ran 5x slower).
                engine_threads = recipe.engine.num_engines * recipe.engine.torch_threads
                t = recipe.teacher.engine
                if (recipe.teacher.path or recipe.teacher.tiny) and t.device == "cpu" and t.kind == "embedded":
                    engine_threads += t.num_engines * t.torch_threads
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) - engine_threads))
            extra = dict(extra)
            if extra.pop("spare", False):  # a warm spare for the next restart (RestartPolicy.spare)
                extra["restart"] = RestartPolicy(spare=True)
            actors[role] = ActorSpec(cls=cls, env=env, **extra)
    return msgspec.structs.replace(recipe, actors=actors)
