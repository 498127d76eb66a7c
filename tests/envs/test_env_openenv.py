"""OpenEnv through `rollout.agent`: a real OpenEnv environment server (the digits environment of
tests/envs/openenv_envs, written with OpenEnv's `Environment`/`create_app`) and our episode driver
run in the OpenEnv venv as supervised processes; the driver's OpenEnv client (`GenericEnvClient`
over the server's `/ws`) resets and steps it, the policy speaks through the session server.

The fast tests use the scripted engine (exact replies, so exact rewards) behind the real session
server; the slow one is a real `miles run` of recipes/envs/openenv.toml with the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
import pytest_asyncio

from miles.envs import openenv_env
from miles.envs.agent import run_agent
from miles.tito.client import SessionServerClient
from tests.envs.leftovers import left_behind
from tests.envs.token_checks import model_turns
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "envs" / "openenv_envs"))
from miles_digits_env.scoring import score, target_for  # noqa: E402  (plain Python, no OpenEnv)

aio = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def openenv_venv() -> str:
    """The OpenEnv venv, made by its set-up script on first use: a failure fails the tests."""
    return openenv_env.openenv_python()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(openenv_venv, tmp_path_factory):
    """This module's OpenEnv children; at the end they are stopped, the env server says it had no
    environment left open, and none of their processes is alive."""
    import os
    os.environ["MILES_OPENENV_LOG_DIR"] = str(tmp_path_factory.mktemp("openenv-logs"))
    try:
        yield openenv_env._SERVERS
    finally:
        procs = list(openenv_env._SERVERS.procs.values())
        logs = openenv_env.log_paths()
        await openenv_env.close()
        os.environ.pop("MILES_OPENENV_LOG_DIR", None)
        assert procs, "no OpenEnv server was started"
        for p in procs:
            assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE
        env_logs = [p for p in logs if p.name.startswith("openenv-env-")]
        assert env_logs and all("live environments at shutdown: 0" in p.read_text() for p in env_logs), \
            [p.read_text()[-500:] for p in env_logs]


async def live_envs(servers, settle_s: float = 10.0) -> int:
    """Environment instances the server still holds, once the last episode's close has landed:
    the client closes its WebSocket as the episode ends and the server closes the instance when
    it reads the close frame, which on a loaded machine comes a moment later. Polls until 0 or
    `settle_s`, then returns what is left (a leak stays a failure)."""
    url = next(u for k, u in servers.urls.items() if k.startswith("env:"))
    deadline = time.monotonic() + settle_s
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{url}/miles/live") as r:
                live = (await r.json())["live"]
            if live == 0 or time.monotonic() > deadline:
                return live
            await asyncio.sleep(0.05)


def task_of(row: dict, **limits) -> dict:
    return {**row["metadata"], "prompt": row["prompt"], "label": row["label"],
            "limits": {"max_turns": 4, **limits}, "sampling": {"temperature": 0.0, "max_tokens": 16}}


async def episode(url: str, row: dict, rollout_id: str, **limits):
    async with SessionServerClient(url) as client:
        return await run_agent(openenv_env.agent, task_of(row, **limits), client, group_id="g",
                               rollout_id=rollout_id)


@aio
async def test_check_spec_names_the_bad_key():
    with pytest.raises(openenv_env.OpenEnvError, match="exactly one of app"):
        openenv_env.check_spec({"client": "x:Y"})
    with pytest.raises(openenv_env.OpenEnvError, match=r"unknown keys \['apps'\]"):
        openenv_env.check_spec({"apps": "m:a"})
    with pytest.raises(openenv_env.OpenEnvError, match="openenv.app: expected 'module:attribute'"):
        openenv_env.check_spec({"app": "server"})
    with pytest.raises(openenv_env.OpenEnvError, match="openenv.reset"):
        openenv_env.check_spec({"url": "http://h:1", "reset": [1]})
    with pytest.raises(openenv_env.OpenEnvError, match="metadata.openenv: expected a table"):
        openenv_env.check_spec(None)


@aio
async def test_episodes_get_the_environments_reward_and_close_their_sessions(servers, scripted):
    """8 episodes: right at once (1.0 after one step), right at the second attempt, partly right
    twice (the env's score of the last reply), every one scored by the env and its session closed."""
    engine, url = scripted
    rows = openenv_env.example_rows(8, seed=7)
    plans = []
    for i, row in enumerate(rows):
        target = row["label"]
        wrong = "".join(str((int(d) + 1) % 10) for d in target.split())
        plans.append([[target], ["no", target], [f"{target.split()[0]} x", wrong]][i % 3])
    for i, (row, replies) in enumerate(zip(rows, plans)):
        engine.replies[:] = list(replies)
        run = await episode(url, row, f"oe-{i}")
        assert not run.error, run.error
        agent_out = run.samples[0].metadata["agent"]
        want = score(replies[-1], target_for(row["metadata"]["openenv"]["reset"]["seed"]))
        assert run.reward == pytest.approx(want), (replies, run.reward)
        assert agent_out["steps"] == len(replies) and agent_out["done"] is True
        assert agent_out["step_rewards"][-1] == pytest.approx(want)
        assert all(r == 0.0 for r in agent_out["step_rewards"][:-1])
        # the conversation: the env's prompt, the model's replies, the env's retry prompts
        msgs = agent_out["messages"]
        assert msgs[0] == {"role": "user", "content": row["prompt"]}
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == replies
        assert len(run.samples) == 1 and run.samples[0].status == "completed"
        assert run.samples[0].response_length > 0
    assert await live_envs(servers) == 0


@aio
async def test_a_typed_client_and_glue_code(servers, scripted):
    """The env's own `EnvClient` subclass (typed observations) and a glue module (its Action
    class, its own message text), as an OpenEnv env package would bring them."""
    engine, url = scripted
    row = openenv_env.example_rows(1, seed=11, client="miles_digits_env.client:DigitsEnv",
                                   glue="miles_digits_env.miles_glue")[0]
    engine.replies[:] = ["  wrong  ", row["label"]]
    run = await episode(url, row, "oe-typed")
    assert not run.error, run.error
    msgs = run.samples[0].metadata["agent"]["messages"]
    assert msgs[0]["content"] == row["prompt"]
    assert msgs[2]["content"].startswith("[attempt 2] You said 'wrong'.")   # the glue stripped it
    assert run.reward == 1.0 and run.samples[0].metadata["agent"]["steps"] == 2


@aio
async def test_max_turns_without_done_is_truncated(servers, scripted):
    engine, url = scripted
    row = openenv_env.example_rows(1, seed=3)[0]
    engine.replies[:] = ["nothing"]
    run = await episode(url, row, "oe-trunc", max_turns=1)
    assert run.status == "truncated" and run.samples[0].status == "truncated"
    assert run.reward == 0.0
    assert await live_envs(servers) == 0


@pytest.mark.parametrize("case", ["env_raises", "server_down", "bad_observation_field", "reset_raises"])
@aio
async def test_a_failing_environment_call_fails_the_sample_not_the_run(servers, scripted, case):
    engine, url = scripted
    spec = {"env_raises": {"reset": {"seed": 1, "fail": "step"}},
            "reset_raises": {"reset": {"seed": 1, "fail": "reset"}},
            "server_down": {"app": None, "url": "http://127.0.0.1:9"},
            "bad_observation_field": {"observation_field": "nope"}}[case]
    row = openenv_env.example_rows(1, seed=1)[0]
    row["metadata"]["openenv"] = {k: v for k, v in {**row["metadata"]["openenv"], **spec}.items() if v is not None}
    engine.replies[:] = ["1 2 3"]
    run = await episode(url, row, f"oe-{case}")
    want = {"env_raises": "step: RuntimeError: Server error: digits env: step failed on purpose",
            "reset_raises": "reset: RuntimeError: Server error: digits env: reset failed on purpose",
            "server_down": "connect: ConnectionError: Failed to connect",
            "bad_observation_field": "openenv.observation_field = 'nope'"}[case]
    assert want in run.error, run.error
    for s in run.samples:
        assert s.status == "failed" and want in s.metadata["agent_error"]
    assert run.reward is None
    # the next episode on the same servers is fine
    engine.replies[:] = [row["label"]]
    ok = await episode(url, openenv_env.example_rows(1, seed=1)[0], f"oe-after-{case}")
    assert not ok.error and ok.reward == 1.0
    assert await live_envs(servers) == 0


@aio
async def test_a_killed_environment_server_is_started_again_for_the_next_episode(servers, scripted):
    engine, url = scripted
    row = openenv_env.example_rows(1, seed=4)[0]
    engine.replies[:] = [row["label"]]
    assert (await episode(url, row, "oe-before-kill")).reward == 1.0
    key = next(k for k in servers.procs if k.startswith("env:"))
    old = servers.procs[key]
    old.kill()
    engine.replies[:] = [row["label"]]
    run = await episode(url, row, "oe-after-kill")
    assert not run.error and run.reward == 1.0
    assert servers.procs[key] is not old and servers.procs[key].alive
    assert await live_envs(servers) == 0


def test_the_recipe_checks():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "miles.cli", "check", str(ROOT / "recipes" / "envs" / "openenv.toml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "recipe OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_miles_run_of_the_openenv_recipe(tmp_path, openenv_venv):
    """A real `miles run`: 2 steps x 2 groups x 4 samples = 16 OpenEnv episodes (and the held-out
    evaluation's) with the tiny model; every trained sample's reward is the env's score of its
    last reply, its tokens are what the conversation renders to, and nothing is left."""
    out = tmp_path / "openenv-run"
    needles = ("openenv_server.py", "miles_digits_env.server")
    before = {pid for pid, _ in leftover_processes(*needles)}   # this module's `servers`, if started
    code, log, samples = run_recipe(ROOT / "recipes" / "envs" / "openenv.toml", out,
                                    {"MILES_OPENENV_LOG_DIR": str(tmp_path / "logs")}, timeout_s=800)
    assert code == 0, log[-3000:]
    assert len(samples) >= 16, len(samples)
    rewards = []
    for s in samples:
        agent_out = s.metadata["agent"]
        seed = s.metadata["openenv"]["reset"]["seed"]
        last = [m["content"] for m in agent_out["messages"] if m["role"] == "assistant"][-1]
        if s.status == "completed":
            assert s.reward == pytest.approx(score(last, target_for(seed))), (last, s.reward)
        rewards.append(s.reward)
    assert all(r is not None for r in rewards)
    assert any(r > 0 for r in rewards), rewards   # after the warm-start some digits are right
    check_trained_samples(samples, out)
    env_logs = list((tmp_path / "logs").glob("openenv-env-*.log"))
    assert env_logs and all("live environments at shutdown: 0" in p.read_text() for p in env_logs)
    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if "episodes settled" in line or "episodes closed" in line]
    listed = [line for line in closing if "sessions of this run open" in line]
    assert listed and all("sessions of this run open: 0" in line for line in listed), closing
    assert not [cmd for pid, cmd in leftover_processes(*needles) if pid not in before]
    assert left_behind(out) == []   # no session, sandbox or process of the run


def leftover_processes(*needles: str) -> list[tuple[int, list[str]]]:
    """(pid, command line) of the live processes whose command line names one of `needles`."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(n in c for c in cmd for n in needles):
            out.append((p.pid, cmd))
    return out


def run_recipe(recipe: Path, out: Path, env: dict[str, str], timeout_s: float,
               overrides: tuple[str, ...] = ()) -> tuple[int, str, list]:
    """`miles run recipe` with every step recorded; (exit code, log, the trained samples)."""
    import os
    import subprocess

    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records
    port = cluster_port()
    args = [sys.executable, "-m", "miles.cli", "run", str(recipe),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={port}",
            "--set", "logging.record_wire=true"]
    for o in overrides:
        args += ["--set", o]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    samples = []
    wire = out / "wire" / "driver.mlw"
    if wire.exists():
        samples = [s for r in read_records(wire) if isinstance(r.msg, Batch)
                   for g in r.msg.groups for s in g.samples]
    return proc.returncode, log.decode(errors="replace"), samples


def check_trained_samples(samples: list, out: Path) -> None:
    """TITO: each sample's non-model tokens are the chat template's rendering of the episode's
    conversation (`metadata["agent"]["messages"]`), its model tokens are the assistant turns
    exactly, under the loss mask, with the engine's log-probs."""
    from miles.tito.families import get_family
    from miles.tito.messages import parse_openai_messages
    from miles.tito.tokenizer import load_tokenizer
    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    qwen3 = get_family("qwen3")
    for sample in samples:
        msgs = parse_openai_messages(sample.metadata["agent"]["messages"])
        turns = [qwen3.parse_reply(tokenizer.decode(ids)).content for ids in model_turns(sample, tokenizer, msgs)]
        assert turns == [m.content for m in msgs if m.role == "assistant"], turns   # every turn, none cut
