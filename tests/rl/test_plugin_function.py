"""The `rollout.function` plug-in contract, inside real `miles run`s (issue 16, item 1): a user's
function loaded from an import path makes every trained group itself, each prompt is trained
exactly once, and a function that raises, or returns a group for a prompt it was not given, costs
its call's slots but not the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.envs.function import load_rollout_function
from miles.wire.messages import Batch, TrainStep
from miles.wire.recorder import read_records
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))

STEPS, GROUPS, SAMPLES = 4, 4, 4
COMMON = [f"loop.num_steps={STEPS}", f"loop.groups_per_step={GROUPS}", "loop.eval_every=0",
          "loop.save_every=0", "loop.timeout_s=120", 'eval.mode="off"', "sft.steps=5",
          f"rollout.n_samples_per_prompt={SAMPLES}", 'buffer.filter="none"',
          "logging.record_wire=true"]


def run_recipe(tmp_path, name, overrides, timeout_s=400):
    port = cluster_port()
    out = tmp_path / name
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", "logging.progress=false",
            "--set", f"cluster.head_port={port}"]
    for o in [*COMMON, *overrides]:
        args += ["--set", o]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"miles run {name} did not finish within {timeout_s}s:\n"
                             f"{(e.output or b'').decode(errors='replace')[-3000:]}") from None
    return proc.returncode, proc.stdout.decode(errors="replace"), out


def records(out, kind):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def trained(out):
    """(groups of every batch the driver took, samples of every RL step the trainers got)."""
    groups, samples = [], []
    for rec in read_records(out / "wire" / "driver.mlw"):
        if isinstance(rec.msg, Batch) and rec.meta.direction == "reply":
            groups += rec.msg.groups
        if isinstance(rec.msg, TrainStep) and rec.msg.phase == "rl" and rec.meta.peer.endswith("/0"):
            samples += rec.msg.samples
    return groups, samples


def check_trained(out, code, log):
    assert code == 0, log[-4000:]
    train = records(out, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    indices = [i for r in train for i in r["batch/prompt_indices"]]
    assert len(indices) == STEPS * GROUPS and len(set(indices)) == len(indices), indices
    groups, samples = trained(out)
    assert sorted(g.prompt_index for g in groups) == sorted(indices)
    assert all(g.group_id == f"fn-p{g.prompt_index}" for g in groups), [g.group_id for g in groups]
    assert len(samples) == STEPS * GROUPS * SAMPLES
    assert {s.metadata["made_by"] for s in samples} == {"function_plugin"}
    # the bookkeeping the function left out was filled in, its seeds are the context's
    assert all(s.metadata["prompt_index"] == int(s.group_id[4:]) and s.metadata["retries"] == 0
               for s in samples)
    assert all(s.rollout_id == f"{s.group_id}-{s.index}" for s in samples)
    actors = records(out, "actors")
    return max(r.get("rollout/function_calls", 0) for r in actors), \
        max(r.get("rollout/function_errors", 0) for r in actors)


def test_the_contract_is_checked_at_load():
    assert load_rollout_function("function_plugin:rollout").__name__ == "rollout"
    with pytest.raises(ValueError, match="rollout.function = 'function_plugin:nope': module 'function_plugin' has no attribute 'nope'"):
        load_rollout_function("function_plugin:nope")
    with pytest.raises(ValueError, match=r"rollout.function = 'function_plugin:not_async'.*async def"):
        load_rollout_function("function_plugin:not_async")
    with pytest.raises(ValueError, match="expected 'module:name'"):
        load_rollout_function("function_plugin")


@pytest.mark.slow
def test_a_user_rollout_function_makes_every_trained_group(tmp_path):
    code, log, out = run_recipe(tmp_path, "fn", ['rollout.function="function_plugin:rollout"'])
    calls, errors = check_trained(out, code, log)
    assert calls >= STEPS and errors == 0


@pytest.mark.slow
def test_a_function_that_fails_costs_its_slots_not_the_run(tmp_path):
    """Call 1 raises, call 2 returns a group for a prompt it was not given: both calls' slots are
    released, the traceback is logged once, and the run trains all its steps from later calls."""
    code, log, out = run_recipe(tmp_path, "fn_faulty",
                                ['rollout.function="function_plugin:fails_twice"'])
    calls, errors = check_trained(out, code, log)
    assert errors == 2 and calls >= STEPS + 2
    rollout_log = (out / "logs" / "rollout.log").read_text()
    assert rollout_log.count("fails on its first call") >= 1
    assert rollout_log.count("Traceback") == 2, rollout_log[-4000:]   # once per kind of error
    assert "which was not reserved for this call" in rollout_log
    buffer_dropped = max(r.get("buffer/dropped", 0) for r in records(out, "actors"))
    assert buffer_dropped >= 2 * GROUPS       # the failed calls' slots, released


class SocketLikeRef:
    """The buffer in-process, its handler errors coming back as `RemoteError` the way the socket
    brings them."""

    def __init__(self, actor):
        self.actor = actor

    async def call(self, msg, timeout_s=60.0, retries=0):
        import inspect
        from miles.wire.messages import ErrorReply
        from miles.wire.transport import RemoteError
        try:
            out = self.actor._handlers[type(msg)](self.actor, msg)
            return await out if inspect.iscoroutine(out) else out
        except Exception as e:
            raise RemoteError(ErrorReply(error_type=type(e).__name__, message=str(e))) from None


sizes = []


async def recording_rollout(ctx, n_groups):
    import function_plugin
    sizes.append(n_groups)
    return await function_plugin.rollout(ctx, n_groups)


async def test_sync_mode_refills_handed_back_slots_with_a_smaller_call():
    """Sync mode, a policy that drops odd prompts: each step's call hands half its slots back, and
    the refill can get only those; waiting for a full step's slots would wait for the very step
    it must fill (no slot opens before the version advances)."""
    import asyncio
    from test_rollout_reliability import FakeEngine, worker
    from user_plugins import DropOdd
    from miles.wire.messages import GetBatch, SetVersion
    from miles.engines.client import WeightVersionSpan

    class VersionedEngine(FakeEngine):  # says which weights served, as a real engine does
        async def generate(self, ids, params, **kw):
            res = await super().generate(ids, params, **kw)
            res.weight_versions = [WeightVersionSpan(str(b.version), 0, len(res.output_ids))]
            return res

    sizes.clear()
    w, b = worker(VersionedEngine(), sets=["loop.groups_per_step=4", 'loop.mode="sync"',
                                      'rollout.function="test_plugin_function:recording_rollout"'])
    b.configure(groups_per_step=4, max_staleness=0, policy=DropOdd())
    w.buffer = SocketLikeRef(b)
    w._begin([], [], "the test")
    try:
        for version in range(3):
            batch = await asyncio.wait_for(b.on_get_batch(GetBatch(n_groups=4)), 20)
            assert all(g.prompt_index % 2 == 0 for g in batch.groups)
            assert {g.group_id[:4] for g in batch.groups} == {"fn-p"}
            await b.on_set_version(SetVersion(version=version + 1))
    finally:
        await w._stop()
    assert sizes[0] == 4 and min(sizes) < 4, sizes
    assert w.counts["function_errors"] == 0 and b.counts["stale"] == 0 and b.counts["dropped"] >= 6


def test_miles_run_refuses_a_bad_rollout_function_before_starting():
    from miles.config import RecipeError, load_recipe
    from miles.recipe_checks import check_recipe
    for path, why in (("function_plugin:not_async", "is not an async function"),
                      ("function_plugin:nope", "has no attribute 'nope'"),
                      ("function_plugin:_sample", "wrong signature")):
        recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", [f'rollout.function="{path}"'])
        with pytest.raises(RecipeError, match=f"rollout.function.*{why}"):
            check_recipe(recipe)
    check_recipe(load_recipe(ROOT / "recipes" / "quickstart.toml",
                             ['rollout.function="function_plugin:rollout"']))


async def failed_first_sample(ctx, n_groups):
    """Every group's first sample failed: the buffer's policy asks for a retry."""
    import function_plugin
    groups = await function_plugin.rollout(ctx, n_groups)
    for g in groups:
        g.samples[0].status = "failed"
    return groups


async def test_a_retried_group_is_regenerated_by_the_default_path_in_its_slot():
    import asyncio
    from test_rollout_reliability import FakeEngine, worker
    w, b = worker(FakeEngine(), sets=["loop.groups_per_step=2",
                                      'rollout.function="test_plugin_function:failed_first_sample"'])
    w.buffer = SocketLikeRef(b)
    w._begin([], [], "the test")
    try:
        for _ in range(100):
            if len(b.queue) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await w._stop()
    kept = [b.table[s].group for s in sorted(b.queue)[:2]]
    assert b.counts["retried"] >= 2 and w.counts["retries"] >= 2, (b.counts, w.counts)
    for g in kept:   # the default path's group, in the slot the function's group had
        assert not g.group_id.startswith("fn-") and g.samples[0].metadata["retries"] == 1
        assert all(s.status == "completed" and "made_by" not in s.metadata for s in g.samples)
    assert sorted(b.queue)[:2] == [0, 1]
