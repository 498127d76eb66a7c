"""`miles check` refuses every broken recipe before anything starts, naming the key path and value.

Each case is one class of broken recipe that `miles check` once called "recipe OK" (issue 15, 11):
the quickstart recipe with one thing wrong.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import RecipeError, load_recipe
from miles.recipe_checks import check_placement, check_recipe

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = (ROOT / "recipes" / "quickstart.toml").read_text()
NO_MODEL = re.sub(r"\[model\]\n[^\[]*", "", QUICKSTART)
MILES = [str(ROOT / ".venv" / "bin" / "miles")] if (ROOT / ".venv" / "bin" / "miles").exists() \
    else [sys.executable, "-m", "miles.cli"]


def refusal(text: str, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        check_recipe(load_recipe(text=text, overrides=list(overrides)))
    return str(info.value)


@pytest.mark.parametrize("text, overrides, expected", [
    # ranges
    (QUICKSTART, ["loop.num_steps=-1"], "loop.num_steps = -1: expected >= 0"),
    (QUICKSTART, ["rollout.temperature=-0.5", "train.temperature=-0.5"],
     "rollout.temperature = -0.5: expected >= 0.0"),
    (QUICKSTART, ["rollout.n_samples_per_prompt=0"], "rollout.n_samples_per_prompt = 0: expected >= 1"),
    (QUICKSTART, ["buffer.capacity_groups=0"], "buffer.capacity_groups = 0: expected >= 1"),
    (QUICKSTART, ["engine.num_engines=0"], "engine.num_engines = 0: expected >= 1"),
    (QUICKSTART, ["rollout.top_p=1.5"], "rollout.top_p = 1.5: expected <= 1.0"),
    (QUICKSTART, ["loop.timeout_s=inf"], "loop.timeout_s = inf: expected a finite number"),
    (QUICKSTART, ["engine.dtype='float8'"], "engine.dtype = 'float8': expected one of float32, bfloat16"),
    # the model
    (NO_MODEL, [], "model: set model.path (an HF directory) or model.tiny (one of qwen2, qwen3"),
    (QUICKSTART, ["model.path='/no/such/model'"], "model.path = '/no/such/model': expected an HF model "
                                                  "directory; it does not exist"),
    (QUICKSTART, ["model.tiny='gpt5'"], "model.tiny = 'gpt5': expected one of qwen2, qwen3, qwen3_moe"),
    # import paths and plug-in contracts
    (QUICKSTART, ["rollout.reward='no_such_module:score'"],
     "rollout.reward = 'no_such_module:score': cannot import module 'no_such_module'"),
    (QUICKSTART, ["rollout.reward='miles.rl.rewards:check_reward'"],
     "rollout.reward = 'miles.rl.rewards:check_reward': wrong signature"),
    (QUICKSTART, ["rollout.worker='miles.actors.rollout:NoSuchWorker'"],
     "rollout.worker = 'miles.actors.rollout:NoSuchWorker': module 'miles.actors.rollout' has no "
     "attribute 'NoSuchWorker'"),
    (QUICKSTART, ["rollout.worker='miles.actors.buffer:Buffer'"],
     "rollout.worker = 'miles.actors.buffer:Buffer': not a subclass of miles.actors.rollout.RolloutWorker"),
    (QUICKSTART, ["actors.extra.class='no_such_module:Helper'"],
     "actors.extra.class = 'no_such_module:Helper': cannot import module 'no_such_module'"),
    (QUICKSTART, ["actors.extra.class='miles.actors.buffer:BufferPolicy'"],
     "actors.extra.class = 'miles.actors.buffer:BufferPolicy': not a subclass of miles.runtime.actor.Actor"),
    (QUICKSTART, ["buffer.filter='miles.actors.buffer:no_filter'"],
     "buffer.filter = 'miles.actors.buffer:no_filter': module 'miles.actors.buffer' has no attribute"),
    (QUICKSTART, ["buffer.filter='nonzero'"], "buffer.filter = 'nonzero': expected one of none, nonzero_std"),
    (QUICKSTART, ["buffer.policy='miles.actors.buffer:Buffer'"],
     "buffer.policy = 'miles.actors.buffer:Buffer': not a subclass of miles.actors.buffer.BufferPolicy"),
    (QUICKSTART, ["data.source='os:getcwd'"], "data.source = 'os:getcwd': wrong signature ()"),
    # contradictions
    (QUICKSTART, ["loop.mode='sync'", "loop.max_staleness=5"],
     "loop.max_staleness = 5: expected 0 with loop.mode = 'sync'"),
    (QUICKSTART, ["loop.mode='one_step_off'", "loop.max_staleness=2"], "loop.max_staleness = 2: expected 1 with loop.mode = "
                                               "'one_step_off'"),
    (QUICKSTART, ["rollout.temperature=0.7"], "train.temperature = 1.0: expected rollout.temperature (0.7)"),
    (QUICKSTART, ["rollout.temperature=0"], "rollout.temperature = 0.0: expected > 0"),
    (QUICKSTART, ["buffer.capacity_groups=4"], "buffer.capacity_groups = 4: expected >= loop.groups_per_step (8)"),
    (QUICKSTART, ["eval.mode='external'"], "eval.command = '': expected a command"),
    (QUICKSTART, ["data.task=''"], "data: set data.path"),
    (QUICKSTART, ["data.task=''", "data.path='/no/such.jsonl'"],
     "data.path = '/no/such.jsonl': expected a .jsonl or .parquet file; it does not exist"),
    (QUICKSTART, ["data.task=''", f"data.path='{ROOT / 'README.md'}'", "eval.mode='fleet'"],
     "data.eval_path = '': expected a file for eval.mode = 'fleet'"),
    (QUICKSTART, ["data.task='sorting'"], "data.task = 'sorting': expected one of addition, find_file, find_file_declared, find_file_graded, sort_digits"),
    (QUICKSTART, ["engine.gateway_policy='fastest'"], "engine.gateway_policy = 'fastest': expected one of manual"),
    # a section's own check reads like the rest
    (QUICKSTART, ["train.lr=-1.0"], "train.lr = -1.0: expected >= 0.0"),
    (QUICKSTART, ["weights.bucket_bytes=0"], "weights.bucket_bytes = 0: expected an integer >= 1"),
    (QUICKSTART, ["train.steps_per_train=2"], "train.old_logprobs = 'rollout': needs steps_per_train=1"),
])
def test_broken_recipe_is_refused_naming_key_and_value(text, overrides, expected):
    message = refusal(text, overrides)
    assert expected in message, message
    assert message.startswith("<recipe>: ") and "\n" not in message


def cluster_overrides(tmp_path) -> list[str]:
    """A cluster recipe names a checkpoint and data on the cluster's filesystem: here, tiny stand-ins."""
    from miles.tiny import build_tiny_model
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [f"model.path={str(build_tiny_model(arch='qwen2'))!r}", f"data.path={str(data)!r}",
            f"data.eval_path={str(data)!r}"]


# recipes whose model is built by a script first (their header says which): a tiny stand-in here
PREBUILT = {"opd_quickstart": ["model.tiny=''", "train.teacher_model_path={tiny!r}", "model.path={tiny!r}"],
            "lora_quickstart": ["model.tiny=''", "model.path={tiny!r}"],
            "opd_engine_quickstart": ["teacher.path={tiny!r}"]}


def test_every_shipped_and_test_recipe_still_passes(tmp_path):
    from miles.tiny import build_tiny_model
    tiny = str(build_tiny_model(arch="qwen3"))
    for path in sorted((ROOT / "recipes").rglob("*.toml")):
        cluster = path.stem.endswith("_cluster")
        overrides = cluster_overrides(tmp_path) if cluster else []
        overrides += [o.format(tiny=tiny) for o in PREBUILT.get(path.stem, [])]
        recipe = load_recipe(path, overrides=overrides)
        assert check_recipe(recipe, str(path)) == [], path
        if cluster:
            check_placement(recipe, nnodes=2, source=str(path))
            with pytest.raises(RecipeError, match="this job has 1 node"):
                check_placement(recipe, nnodes=1, source=str(path))
    # recipes of only their own actors (the demo, the runtime tests) need no model or data
    own = load_recipe(text='[actors.driver]\nclass = "miles.demo:DemoDriver"\nmain = true\n'
                           '[actors.sink]\nclass = "miles.demo:Sink"\n')
    assert check_recipe(own) == []
    out = subprocess.run([*MILES, "check", str(ROOT / "recipes" / "quickstart.toml")], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "miles.loop:LoopDriver" in out.stdout  # the placement run starts
    # a value equal to the mode's own staleness is no contradiction; the default never is
    assert load_recipe(text=QUICKSTART, overrides=["loop.mode='sync'", "loop.max_staleness=0"]).loop.staleness == 0
    assert load_recipe(text='[loop]\nmode = "sync"').loop.staleness == 0


def test_async_modes_resolve_old_logprobs_auto_to_rollout():
    assert load_recipe(ROOT / "recipes" / "quickstart.toml").train.old_logprobs == "rollout"
    # all defaults: fully_async, max_staleness 2, old_logprobs "auto"
    assert load_recipe(text="").train.old_logprobs == "rollout"
    assert load_recipe(text='[loop]\nmode = "one_step_off"').train.old_logprobs == "rollout"
    assert load_recipe(text='[train]\nold_logprobs = "auto"').train.old_logprobs == "rollout"
    # on-policy, one step per batch: a ratio of 1 is right, and "auto" stays
    assert load_recipe(text='[loop]\nmode = "sync"').train.old_logprobs == "auto"
    # several steps per batch need recomputed log-probs ("rollout" is refused there)
    assert load_recipe(text='[train]\nsteps_per_train = 2').train.old_logprobs == "auto"
    assert load_recipe(text='[train]\nold_logprobs = "recompute"').train.old_logprobs == "recompute"


def test_check_warns_on_stale_samples_without_correction(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(QUICKSTART)
    out = subprocess.run([*MILES, "check", str(recipe), "--set", "train.old_logprobs='recompute'"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "recipe OK" in out.stdout, out.stderr
    assert "warning" in out.stderr and "train.old_logprobs = 'recompute'" in out.stderr
    assert "algo.use_tis" in out.stderr
    # with a correction, or on-policy, there is nothing to warn about
    for fix in (["algo.use_tis=true"], ["loop.mode='sync'", "loop.max_staleness=0"]):
        r = load_recipe(text=QUICKSTART, overrides=["train.old_logprobs='recompute'", *fix])
        assert check_recipe(r) == []
    out = subprocess.run([*MILES, "check", str(recipe)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr


def test_run_refuses_a_broken_recipe_before_starting_anything(tmp_path):
    recipe = tmp_path / "broken.toml"
    run_dir = tmp_path / "run"
    recipe.write_text(QUICKSTART.replace('name = "quickstart"', f'name = "broken"\noutput_dir = "{run_dir}"'))
    t0 = time.monotonic()
    out = subprocess.run([*MILES, "run", str(recipe), "--set", "rollout.reward='no_such_module:score'"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (f"miles: {recipe}: rollout.reward = 'no_such_module:score': cannot import "
                                  f"module 'no_such_module': No module named 'no_such_module'")
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert elapsed < 15, elapsed
    assert not run_dir.exists()  # no node daemon, no actor, no log directory


def test_run_refuses_an_actor_placed_on_a_node_the_job_lacks(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_")) and k not in ("NODE_RANK", "NNODES")}
    run_dir = tmp_path / "run"
    args = [*MILES, "run", str(ROOT / "recipes" / "demo.toml"), "--set", f"run.output_dir='{run_dir}'",
            "--set", "actors.sink.node=1"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 2 and "actors.sink.node = 1: expected nodes < 1" in out.stderr, out.stderr
    assert not run_dir.exists()
    # two nodes: node 1 exists, and check_recipe alone (miles check) never knew the node count
    check_placement(load_recipe(ROOT / "recipes" / "demo.toml", ["actors.sink.node=1"]), nnodes=2)


def test_user_plugins_pass_or_fail_by_their_contract(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "rl" / "plugins"))
    good = ["rollout.reward='user_plugins:length_reward'", "data.source='user_plugins:make_source'",
            "buffer.policy='user_plugins:DropOdd'", "buffer.filter='user_plugins:group_reward'"]
    assert check_recipe(load_recipe(text=QUICKSTART, overrides=good)) == []
    (tmp_path / "bad_plugins.py").write_text(
        "def two_args(sample, extra):\n    return 0.0\n"
        "class NotAWorker:\n    pass\n")
    (tmp_path / "broken_plugins.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "rollout.reward = 'bad_plugins:two_args': wrong signature (sample, extra)" in \
        refusal(QUICKSTART, ["rollout.reward='bad_plugins:two_args'"])
    assert "rollout.worker = 'bad_plugins:NotAWorker': not a subclass of" in \
        refusal(QUICKSTART, ["rollout.worker='bad_plugins:NotAWorker'"])
    assert "buffer.filter = 'broken_plugins:keep': importing module 'broken_plugins' raised " \
           "RuntimeError: no GPU here" in refusal(QUICKSTART, ["buffer.filter='broken_plugins:keep'"])
