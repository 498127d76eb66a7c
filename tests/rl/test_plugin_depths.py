"""The plug-in depths `rollout.generate` and `rollout.agent`: user-style plug-ins (plugins/depths.py)
loaded by import path, inside a real `miles run` and through the episode runner against a real
embedded engine, session server and subprocess sandboxes."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from miles.config import RecipeError, load_recipe
from miles.engines.client import EngineClient, SamplingParams
from miles.envs.episode import EpisodeEnv, run_episode
from miles.recipe_checks import check_recipe
from miles.sandboxes import get_backend
from miles.wire.messages import Batch, EngineSet, Sample

sys.path.insert(0, str(Path(__file__).parent / "plugins"))
from test_loop import records, run_recipe  # noqa: E402  (the real `miles run` helper)

module_loop = pytest.mark.asyncio(loop_scope="module")   # the engine fixture is shared


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        digits = f"{(i * 37 + 101) % 900 + 100}"
        out.append({"prompt": f"sort {digits} =", "label": "".join(sorted(digits)),
                    "metadata": {"files": {"secret.txt": f"hint {i}\n"}}})
    return out


def data_files(tmp_path: Path) -> tuple[Path, Path]:
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows(24)))
    held_out.write_text("\n".join(json.dumps(r) for r in rows(4)))
    return train, held_out


async def swept(run_name: str) -> int:
    """How many sandboxes labelled with the run were still there (and are removed now)."""
    backend = get_backend("subprocess")
    try:
        return await backend.sweep({"miles.run": run_name})
    finally:
        await backend.close()


def run_depth(tmp_path, name: str, depth: list[str]):
    train, held_out = data_files(tmp_path)
    return run_recipe(tmp_path, name, [
        "loop.num_steps=2", "loop.groups_per_step=2", "loop.eval_every=0", "loop.save_every=0",
        "sft.steps=0", 'data.task=""', f"data.path={json.dumps(str(train))}",
        f"data.eval_path={json.dumps(str(held_out))}", "eval.n_prompts=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", 'buffer.filter="none"',
        'rollout.reward="depths:sandbox_reward"', 'train.reward_key="correct"',
        'sandbox.backend="subprocess"', "logging.record_wire=true", "logging.record_steps=[1, 2]",
        *depth], timeout_s=900)


def trained_samples(out: Path) -> list[Sample]:
    from miles.wire.recorder import read_records
    batches = [r.msg for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)]
    samples = [s for b in batches for g in b.groups for s in g.samples]
    assert samples, "no Batch was recorded in wire/driver.mlw"
    return samples


def closing_line(out: Path, what: str = "closed") -> str:
    """The worker's report at StopRollout ("settled": sessions and sandboxes still open) or at
    its stop ("closed": what the pool and the sweep found)."""
    lines = [l for l in (out / "logs" / "rollout.log").read_text().splitlines()
             if l.startswith(f"[rollout] episodes {what}:")]
    assert lines, f"the rollout worker did not report its episodes ({what})"
    return lines[0]


@pytest.mark.slow
def test_generate_plugin_trains_its_multi_turn_samples_in_a_real_run(tmp_path):
    name = f"depths-gen-{uuid.uuid4().hex[:6]}"
    code, log, out = run_depth(tmp_path, name, ['rollout.generate="depths:generate"'])
    assert code == 0, log[-3000:]
    samples = trained_samples(out)
    for s in samples:
        assert s.metadata["plugin"] == "depths.generate"
        n1, tool, n2 = s.metadata["turn_lengths"]
        assert tool > 0 and n1 > 0 and s.response_length == n1 + tool + n2
        # the tool segment (the sandbox's file, read by the plug-in) is not trained on
        assert s.loss_mask.tolist() == [1] * n1 + [0] * tool + [1] * n2
        assert s.metadata["tool_stdout"] == f"hint {_row_index(s)}\n"
        assert np.all(s.rollout_logprobs[s.loss_mask == 1] < 0)
        # the verifier read the answer file the plug-in wrote into the sandbox
        assert s.reward["sandbox_bytes"] == len(s.metadata["answer_written"].encode())
        assert s.reward["correct"] in (0.0, 1.0)
    assert [r["step"] for r in records(out, "train")] == [1, 2]
    evals = records(out, "eval")
    assert evals and all(e["eval/n"] == 2.0 for e in evals), evals
    actors = records(out, "actors")
    assert actors and actors[-1]["episode/turns"] == 2.0 and actors[-1]["episode/tool_calls"] == 1.0
    assert actors[-1]["sandbox/create_s"] > 0 and actors[-1]["episode/llm_s"] > 0
    # episodes cut off by the end of the run destroyed their sandboxes before they ended
    assert closing_line(out, "settled").endswith("sandboxes live: 0")
    line = closing_line(out)
    assert "live at close 0" in line and "swept 0" in line, line
    assert asyncio.run(swept(name)) == 0


def _row_index(s: Sample) -> int:
    for i, r in enumerate(rows(24)):
        if r["prompt"] == s.prompt:
            return i
    raise AssertionError(f"prompt {s.prompt!r} is not in the data set")


@pytest.mark.slow
def test_agent_plugin_trains_its_session_samples_in_a_real_run(tmp_path):
    name = f"depths-agent-{uuid.uuid4().hex[:6]}"
    code, log, out = run_depth(tmp_path, name, ['rollout.agent="depths:agent"'])
    assert code == 0, log[-3000:]
    samples = trained_samples(out)
    for s in samples:
        assert s.metadata["agent"]["marker"] == "depths.agent" and s.metadata["session_id"]
        assert s.metadata["agent"]["tool_stdout"] == f"hint {_row_index(s)}\n"
        # two assistant turns with the template's user turn between them: 1s, 0s, 1s
        mask = s.loss_mask.tolist()
        assert mask[0] == 1 and 0 in mask and mask.count(1) >= 2, mask
        assert s.reward["sandbox_bytes"] == len(s.metadata["agent"]["answer_written"].encode())
    actors = records(out, "actors")
    assert actors and actors[-1]["episode/tool_calls"] == 1.0 and actors[-1]["episode/turns"] == 2.0
    assert actors[-1]["episode/session_s"] > 0 and actors[-1]["episode/llm_s"] > 0   # session_stats
    evals = records(out, "eval")   # the held-out reward is the agent's, through the same runner
    assert evals and all(e["eval/n"] == 2.0 for e in evals), evals
    line = closing_line(out, "settled")
    assert line.endswith("sessions of this run open: 0; sandboxes live: 0"), line
    line = closing_line(out)
    assert "live at close 0" in line and "swept 0" in line, line
    assert asyncio.run(swept(name)) == 0


# ----- the episode runner, halfway failures --------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory):
    from miles.engines.embedded import launch_embedded_engine
    from miles.tiny import build_tiny_model
    model = build_tiny_model(arch="qwen3")
    logs = tmp_path_factory.mktemp("depth-logs")
    eng = await launch_embedded_engine(model, extra_args=["--torch-threads", "1"], log_path=logs / "engine.log")
    try:
        yield eng, str(model), logs
    finally:
        await eng.stop_async(grace_s=5)


async def open_env(engine, depth: str, **sets):
    eng, model, logs = engine
    name = f"depths-unit-{uuid.uuid4().hex[:6]}"
    overrides = [f"run.name={json.dumps(name)}", f"run.output_dir={json.dumps(str(logs / name))}",
                 'sandbox.backend="subprocess"', depth, *(f"{k}={v}" for k, v in sets.items())]
    recipe = load_recipe(text="", overrides=overrides)
    from miles.rl.sources import tokenizer_for
    client = EngineClient(eng.url)
    env = await EpisodeEnv.open(recipe, EngineSet(gateway_url=eng.url, engine_urls=[eng.url], model_path=model),
                                client, tokenizer_for(model), role="rollout")
    return env, client, name


def prompt_sample(env) -> Sample:
    ids = env.tokenizer.encode("sort 382 =", add_special_tokens=False)
    return Sample(tokens=np.asarray(ids, np.int32), group_id="g0", rollout_id="g0-0", prompt="sort 382 =",
                  label="238", metadata={"files": {"secret.txt": "hint\n"}})


PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=3)


async def finish(env, client, name) -> None:
    stats = env.pool.stats
    assert stats.created == stats.destroyed and stats.live == 0, stats   # gone before close
    await env.close()
    await client.close()
    assert await swept(name) == 0


@module_loop
@pytest.mark.parametrize("plugin, status, turns", [
    ("depths:raises_after_one_turn", "failed", 1),
    ("depths:hangs_after_one_turn", "truncated", 2),
    ("depths:too_many_turns", "truncated", 3)])
async def test_generate_episode_that_fails_halfway_keeps_its_tokens_and_frees_its_sandbox(
        engine, plugin, status, turns):
    env, client, name = await open_env(engine, f'rollout.generate="{plugin}"', **{
        "agent.episode_timeout_s": 5.0, "agent.max_turns": 3})
    sample = prompt_sample(env)
    [out] = await run_episode(env, sample, PARAMS)
    assert out.status == status, out.metadata
    assert out.prompt_length == len(sample.tokens) and out.response_length > 0
    assert out.tokens[:len(sample.tokens)].tolist() == sample.tokens.tolist()
    # the model's tokens of the kept trajectory are trained on; the 2 appended ids of the
    # hanging plug-in are not
    trained = int(out.loss_mask.sum())
    assert trained == out.response_length - (2 if plugin.endswith("hangs_after_one_turn") else 0)
    assert np.all(out.rollout_logprobs[out.loss_mask == 1] < 0)
    assert env.metrics.values()["episode/turns"] == turns
    assert {"raises": "RuntimeError", "hangs": "episode_timeout_s", "too": "max_turns"}[
        plugin.split(":")[1].split("_")[0]] in out.metadata["error"]
    await finish(env, client, name)


@module_loop
@pytest.mark.parametrize("plugin, status", [("depths:agent_raises_halfway", "failed"),
                                            ("depths:agent_hangs_halfway", "truncated")])
async def test_agent_episode_that_fails_halfway_keeps_its_tokens_closes_its_session_and_sandbox(
        engine, plugin, status):
    env, client, name = await open_env(engine, f'rollout.agent="{plugin}"', **{"agent.episode_timeout_s": 5.0})
    [out] = await run_episode(env, prompt_sample(env), PARAMS)
    assert out.status == status, (out.metadata.get("agent_error"), out.metadata.get("error"))
    assert out.response_length > 0 and out.loss_mask.sum() > 0 and out.rollout_id == "g0-0"
    assert out.metadata["agent_error"]
    assert await env.our_sessions() == []
    await finish(env, client, name)


@module_loop
async def test_a_trajectory_tree_shares_the_rollout_id_and_one_verifier_reward(engine):
    env, client, name = await open_env(engine, 'rollout.generate="depths:forks"',
                                       **{"rollout.reward": '"depths:files_reward"'})
    samples = await run_episode(env, prompt_sample(env), PARAMS)
    assert len(samples) == 2
    assert {(s.group_id, s.rollout_id) for s in samples} == {("g0", "g0-0")}   # set by the framework
    assert [s.reward for s in samples] == [1.0, 1.0]        # the verifier read the task's file
    assert env.metrics.values()["episode/samples_per_rollout"] == 2.0
    assert env.metrics.values()["episode/turns"] == 3.0
    assert env.pool.stats.created == 1                     # made for the verifier alone
    await finish(env, client, name)


@module_loop
async def test_the_built_in_path_gets_a_sandbox_verifier_too(engine):
    env, client, name = await open_env(engine, 'rollout.generate=""', **{"rollout.reward": '"depths:files_reward"'})

    async def one_call(ctx, sample):
        result = await ctx.generate(sample.tokens.tolist())
        out = np.asarray(result.output_ids, np.int32)
        return msgspec.structs.replace(sample, tokens=np.concatenate([sample.tokens, out]),
                                       response_length=len(out), status="completed")
    [out] = await run_episode(env, prompt_sample(env), PARAMS, generate=one_call)
    assert out.reward == 1.0 and out.status == "completed"
    await finish(env, client, name)


@module_loop
async def test_an_agent_session_lost_by_the_server_gives_one_failed_empty_sample(engine):
    env, client, name = await open_env(engine, 'rollout.agent="depths:agent_loses_its_session"')
    [out] = await run_episode(env, prompt_sample(env), PARAMS)
    assert out.status == "failed" and out.response_length == 0 and out.rollout_id == "g0-0"
    assert "is gone from the session server" in out.metadata["reason"], out.metadata
    assert env.metrics.values()["episode/failed"] == 1.0
    await finish(env, client, name)


@module_loop
async def test_a_cancelled_agent_episode_still_closes_its_session_and_sandbox(engine):
    env, client, name = await open_env(engine, 'rollout.agent="depths:agent_hangs_halfway"')
    task = asyncio.get_running_loop().create_task(run_episode(env, prompt_sample(env), PARAMS))
    for _ in range(300):
        if env.pool.stats.created and await env.our_sessions():
            break
        await asyncio.sleep(0.1)
    assert env.pool.stats.live == 1 and len(await env.our_sessions()) == 1, "the episode never got going"
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    from miles.envs.agent import _COLLECTS
    if _COLLECTS:   # the shielded collect outlives the cancellation
        await asyncio.wait(list(_COLLECTS), timeout=30)
    assert await env.our_sessions() == []
    await finish(env, client, name)


@module_loop
async def test_a_restarted_worker_deletes_its_predecessors_sessions(engine):
    env, client, name = await open_env(engine, 'rollout.agent="depths:agent"')
    sessions = env.sessions
    stale = await sessions.create_session(rollout_id="x", metadata={"run": name, "role": "rollout", "incarnation": 0})
    other = await sessions.create_session(rollout_id="y", metadata={"run": "another-run", "role": "rollout",
                                                                      "incarnation": 0})
    env.incarnation = 1
    await env._delete_stale_sessions()
    listed = await sessions.list_sessions()
    assert stale["session_id"] not in listed and other["session_id"] in listed
    await sessions.delete(other["session_id"])
    await finish(env, client, name)


# ----- bad plug-ins are refused at the recipe check -----------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("rollout.generate", "depths:not_async", "is not an async function"),
    ("rollout.generate", "depths:one_parameter", "wrong signature"),
    ("rollout.generate", "no_such_module_xyz:generate", "cannot import module 'no_such_module_xyz'"),
    ("rollout.generate", "depths:nothing_here", "has no attribute 'nothing_here'"),
    ("rollout.agent", "depths:agent_three_parameters", "wrong signature"),
    ("rollout.agent", "depths:not_async", "is not an async function"),
    ("rollout.reward", "depths:sync_sandbox_reward", "must be `async def`"),
    ("rollout.reward_batched", "true", "a batched reward sees a group")])
def test_bad_plugins_are_refused_naming_the_key_and_value(key, value, message):
    text = f'[sandbox]\nbackend = "subprocess"\n[model]\ntiny = "qwen3"\n[data]\ntask = "sort_digits"\n'
    shown = value if key == "rollout.reward_batched" else json.dumps(value)
    recipe = load_recipe(text=text, overrides=[f"{key}={shown}"])
    with pytest.raises(RecipeError) as err:
        check_recipe(recipe, "r.toml")
    assert key in str(err.value) and message in str(err.value), str(err.value)
    if key != "rollout.reward_batched":
        assert value in str(err.value)
