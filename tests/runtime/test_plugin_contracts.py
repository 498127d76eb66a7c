"""`miles/plugins.py`: one contract per plug-in key, read by `miles check`, the loaders and the docs.

Every built-in of every contract loads and honours its contract (so `miles check` may take a
built-in name on trust); a user-style plug-in of each kind loads by import path; a bad path is
one error naming the key and the value, the same from `miles check` and from the loader the
actor runs; and docs/extending.md's table is the contracts rendered.
"""

from pathlib import Path

import pytest

from miles import plugins
from miles.config import RecipeError
from miles.config_doc import render_extending

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", sorted(plugins.CONTRACTS))
def test_every_builtin_honours_its_contract(key):
    names = plugins.builtins(key)
    for name in names:
        obj = plugins.load(key, name)
        assert obj is not None, (key, name)
        if key != "data.task":   # a built-in task is its generator's spec
            assert plugins.contract(key).check(obj) is None, (key, name)
        plugins.check(key, name)   # membership: nothing imported


USER_PLUGINS = [   # (key, an import path of a user-style plug-in under tests/ or examples/, context)
    ("rollout.reward", "user_plugins:length_reward", {}),
    ("rollout.reward", "user_plugins:group_reward", {"batched": True}),
    ("rollout.reward", "depths:sandbox_reward", {"sandbox": True}),
    ("rollout.generate", "depths:generate", {}),
    ("rollout.agent", "depths:agent", {}),
    ("rollout.agent", "examples.envs.my_env:agent", {}),
    ("rollout.function", "function_plugin:rollout", {}),
    ("data.source", "user_plugins:make_source", {}),
    ("data.task", "task_set:tasks", {}),
    ("data.task", "examples.envs.my_env:tasks", {}),
    ("buffer.policy", "user_plugins:DropOdd", {}),
    ("actors.helper.class", "miles.demo:Sink", {}),
    ("rollout.worker", "miles.actors.rollout:RolloutWorker", {}),
]


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "rl" / "plugins"))
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.mark.usefixtures("plugin_path")
@pytest.mark.parametrize("key, path, context", USER_PLUGINS, ids=[f"{k}={p}" for k, p, _ in USER_PLUGINS])
def test_user_plugins_load_by_import_path(key, path, context):
    obj = plugins.load(key, path, **context)
    assert callable(obj)
    plugins.check(key, path, "recipe.toml", **context)


BAD = [   # (key, value, context, the one error: `key = value: ...`)
    ("rollout.reward", "exact", {}, "expected one of exact_match, first_answer, math or 'module:name'"),
    ("rollout.reward", "no_such_module_q:score", {}, "cannot import module 'no_such_module_q'"),
    ("rollout.reward", "user_plugins:nothing", {}, "module 'user_plugins' has no attribute 'nothing'"),
    ("rollout.reward", "depths:sync_sandbox_reward", {"sandbox": True}, "must be `async def`"),
    ("rollout.generate", "depths:not_async", {}, "is not an async function: expected `async def "
                                                  "(ctx, sample)"),
    ("rollout.generate", "depths:one_parameter", {}, "wrong signature (sample)"),
    ("rollout.agent", "depths:agent_three_parameters", {}, "wrong signature (base_url, task, extra)"),
    ("rollout.function", "function_plugin", {}, "expected 'module:name'"),
    ("rollout.function", "function_plugin:_sample", {}, "wrong signature"),
    ("buffer.policy", "miles.actors.buffer:Buffer", {}, "not a subclass of miles.actors.buffer.BufferPolicy"),
    ("buffer.filter", "nonzero", {}, "expected one of none, nonzero_std or 'module:name'"),
    ("actors.x.class", "miles.actors.buffer:BufferPolicy", {}, "not a subclass of miles.runtime.actor.Actor"),
    ("train.backend", "tensorflow", {}, "expected one of fsdp, megatron"),
    ("train.backend", "my_pkg:Backend", {}, "expected one of fsdp, megatron"),
    ("weights.transport", "pigeon", {}, "expected one of colocated, disk, disk_delta, nccl, p2p"),
    ("sandbox.backend", "vm", {}, "expected one of agentenv, bwrap, daytona, docker"),
]


@pytest.mark.usefixtures("plugin_path")
@pytest.mark.parametrize("key, value, context, expected", BAD, ids=[f"{k}={v}" for k, v, _, _ in BAD])
def test_a_bad_value_is_one_error_naming_key_and_value(key, value, context, expected):
    for run in (lambda: plugins.load(key, value, **context),
                lambda: plugins.check(key, value, "r.toml", **context)):
        with pytest.raises(RecipeError) as info:
            run()
        assert f"{key} = {value!r}: " in str(info.value) and expected in str(info.value), str(info.value)
    with pytest.raises(RecipeError, match=r"^r\.toml: "):   # miles check names the recipe first
        plugins.check(key, value, "r.toml", **context)


def test_the_loaders_apply_the_contract():
    """The actors' loaders go through the same contract as `miles check`."""
    from miles.backends.base import make_backend
    from miles.envs.agent import load_agent
    from miles.envs.function import load_rollout_function
    from miles.runtime.host import load_class
    from miles.sandboxes.registry import backend_class
    with pytest.raises(RecipeError, match="rollout.agent = 'miles.rl.rewards:exact_match': "
                                          "function 'exact_match' is not an async function"):
        load_agent("miles.rl.rewards:exact_match")
    with pytest.raises(RecipeError, match="rollout.function = 'miles.envs.tool_agent:react': "
                                          "wrong signature"):
        load_rollout_function("miles.envs.tool_agent:react")
    with pytest.raises(RecipeError, match="actors.trainer.class = 'miles.actors.buffer:BufferPolicy'"):
        load_class("miles.actors.buffer:BufferPolicy", "trainer")
    with pytest.raises(RecipeError, match="train.backend = 'jax': expected one of fsdp, megatron"):
        make_backend("jax")
    assert backend_class("local") is backend_class("subprocess")


def test_every_recipe_names_only_plugins_of_its_contracts():
    from miles.config import load_recipe
    seen = set()
    for path in sorted((ROOT / "recipes").rglob("*.toml")):
        recipe = load_recipe(path, overrides=["model.tiny='qwen3'"] if path.stem.endswith("_cluster") else [])
        for key, value, context in plugins.recipe_plugins(recipe):
            plugins.contract(key)
            seen.add(plugins.contract(key).key)
    assert {"rollout.reward", "rollout.agent", "buffer.filter", "actors.<role>.class", "data.task",
            "train.backend", "weights.transport", "sandbox.backend"} <= seen, seen


def test_docs_table_is_the_contracts():
    page = (ROOT / "docs" / "extending.md").read_text()
    assert page == render_extending(page), \
        "docs/extending.md's plug-in table is out of date: run `python -m miles.config_doc --extending`"
    for key in plugins.CONTRACTS:
        assert f"| `{key}` |" in page
