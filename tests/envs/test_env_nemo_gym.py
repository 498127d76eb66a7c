"""NeMo Gym over its own HTTP protocol (its Python 3.12 venv, a supervised server process): the
package's `example_tool_call_multireward` resources server and its SimpleAgent, the policy being the
episode's TITO session (`/v1/responses`).

- Scripted policy: a right tool call scores correctness and schema, a wrong city no correctness; the
  tool call went through the session (its tokens are the session's); a dead server and a row the
  server refuses give failed samples naming the error.
- The recipe in a real `miles run`: 16 episodes, the verify response's reward components in the
  samples, the tokens exact, nothing left.

The venv is made by `scripts/envs/setup_nemo_gym.sh` (idempotent); a failing set-up fails these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from tests.envs.leftovers import left_behind
from tests.envs.token_checks import model_turns
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = {"correctness", "schema_valid", "format", "reward"}


@pytest.fixture(scope="module")
def gym_python() -> str:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "envs" / "setup_nemo_gym.sh")], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"setup_nemo_gym.sh failed:\n{r.stderr[-3000:]}"
    python = r.stdout.strip().splitlines()[-1]
    return python if os.path.isabs(python) else str(ROOT / python)


@pytest_asyncio.fixture(loop_scope="module")
async def gym(gym_python):
    from miles.envs import nemo_gym_env
    os.environ["MILES_NEMO_GYM_PYTHON"] = gym_python
    try:
        yield nemo_gym_env
    finally:
        await nemo_gym_env.close()
        os.environ.pop("MILES_NEMO_GYM_PYTHON", None)


@pytest_asyncio.fixture(loop_scope="module")
async def guarded(scripted):
    """(scripted engine, session server url, token): a session server that wants its token, as the
    fleet's does, in front of the scripted engine."""
    from aiohttp import web

    from miles.engines.procs import free_port
    from miles.tiny import build_tokenizer
    from miles.tito.server import ServerConfig, SessionServer
    engine, _ = scripted
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(build_tokenizer()),
                                                      family="qwen3", token="s3cret")).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield engine, f"http://127.0.0.1:{port}", "s3cret"
    finally:
        await runner.cleanup()


def test_rows_and_rewards_from_the_package_data(gym_python):
    from miles.envs import nemo_gym_env
    os.environ["MILES_NEMO_GYM_PYTHON"] = gym_python
    try:
        splits = nemo_gym_env.example_tasks(seed=0)
    finally:
        os.environ.pop("MILES_NEMO_GYM_PYTHON")
    rows = splits["train"] + splits["test"]
    assert len(rows) == 5 and all(r["metadata"]["nemo_gym"]["expected_call"]["name"] == "get_weather" for r in rows)
    assert nemo_gym_env.reward_of({"reward": 2.0, "reward_components": {"format": 1, "correctness": 1}}) == \
        {"format": 1.0, "correctness": 1.0, "reward": 2.0}
    assert nemo_gym_env.reward_of({"reward": 0.5}) == 0.5
    with pytest.raises(nemo_gym_env.NemoGymError, match="reward = None"):
        nemo_gym_env.reward_of({"response": {}})


@pytest.mark.asyncio(loop_scope="module")
async def test_episodes_score_fail_and_never_stop_the_runner(gym, guarded):
    from miles.envs.agent import run_agent
    from miles.tito.client import SessionServerClient
    engine, session_url, token = guarded
    row = gym.example_tasks(seed=0)["train"][0]["metadata"]["nemo_gym"]
    city = row["expected_call"]["arguments"]["city"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    async with SessionServerClient(session_url, token=token) as client:
        engine.replies = [call % city, "done"]
        good = await run_agent(gym.agent, {"nemo_gym": row}, client, group_id="g", rollout_id="g/0")
        assert good.error == "", good.error
        # SimpleAgent asks again after the tool's answer; the closing "done" is assistant text,
        # which the server's `format` component counts against
        assert good.reward == {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0, "reward": 2.0}, good.reward
        output = good.samples[-1].metadata["agent"]["output"]
        assert output[0]["type"] == "function_call" and json.loads(output[0]["arguments"]) == {"city": city}
        engine.replies = [call % "Atlantis", "done"]
        wrong = await run_agent(gym.agent, {"nemo_gym": row}, client, group_id="g", rollout_id="g/1")
        assert wrong.reward["correctness"] == 0.0 and wrong.reward["schema_valid"] == 1.0, wrong.reward
        refused = await run_agent(gym.agent, {"nemo_gym": {**row, "responses_create_params": {"input": 7}}},
                                  client, group_id="g", rollout_id="g/2")
        assert "NemoGymError" in refused.error and "HTTP 500" in refused.error, refused.error
        assert refused.samples and all(s.status == "failed" and s.metadata["agent_error"] == refused.error
                                       for s in refused.samples), [(s.status, s.metadata) for s in refused.samples]
        await gym.close()
        os.environ["MILES_NEMO_GYM_URL"] = "http://127.0.0.1:9"   # nothing listens there
        try:
            down = await run_agent(gym.agent, {"nemo_gym": row}, client, group_id="g", rollout_id="g/3")
        finally:
            os.environ.pop("MILES_NEMO_GYM_URL")
            await gym.close()
        assert "ClientConnectorError" in down.error, down.error
        assert down.samples and all(s.status == "failed" and s.metadata["agent_error"] == down.error
                                    for s in down.samples), [(s.status, s.metadata) for s in down.samples]
        assert await client.list_sessions() == []


def gym_servers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if any("nemo_gym_server.py" in a for a in (p.info["cmdline"] or []))]


def check_tokens(sample, tokenizer) -> None:
    """Every turn: the non-model tokens are the template's rendering of the episode's Responses items
    (the row's input, then what NeMo Gym got back: tool calls, tool outputs, messages) and the model's
    turns are exactly the loss-masked tokens, each the reply NeMo Gym recorded."""
    from miles.tito.api_responses import parse_input, parse_tools
    from miles.tito.families import get_family
    qwen3 = get_family("qwen3")
    agent = sample.metadata["agent"]
    msgs, _ = parse_input([*agent["input"], *agent["output"]], None)
    tools = parse_tools(sample.metadata["nemo_gym"]["responses_create_params"]["tools"])
    turns = [qwen3.parse_reply(tokenizer.decode(ids)) for ids in model_turns(sample, tokenizer, msgs, tools)]
    recorded = [m for m in msgs if m.role == "assistant"][:len(turns)]
    assert [(r.content, [(c.name, c.arguments) for c in r.tool_calls]) for r in turns] == \
        [(m.content, [(c.name, c.arguments) for c in m.tool_calls]) for m in recorded], (turns, recorded)


BROKEN_ROWS = """
from miles.envs import nemo_gym_env


def tasks(seed=0, test_frac=0.2):
    # NeMo Gym's example rows, the first training row one the agent server refuses (HTTP 500)
    splits = nemo_gym_env.example_tasks(seed=seed, test_frac=test_frac)
    row = splits["train"][0]
    gym = {**row["metadata"]["nemo_gym"], "responses_create_params": {"input": 7}, "broken": True}
    row["metadata"] = {**row["metadata"], "nemo_gym": gym}
    return splits
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nemo_gym_recipe_in_a_real_miles_run(gym_python, tmp_path):
    """The first training row fails at NeMo Gym's agent server: its group is failed (retried, then
    dropped by the buffer), the run trains on the others and ends normally."""
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records
    before = {p.pid for p in gym_servers()}
    out = tmp_path / "gym-run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_"))}
    env["MILES_NEMO_GYM_PYTHON"] = gym_python
    (tmp_path / "broken_gym_rows.py").write_text(BROKEN_ROWS)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "envs" / "nemo_gym.toml"),
         "--set", f"run.output_dir={json.dumps(str(out))}", "--set", "logging.progress=false",
         "--set", 'data.task="broken_gym_rows:tasks"', "--set", "data.shuffle=false",
         "--set", "logging.record_wire=true", "--set", f"cluster.head_port={cluster_port()}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) >= 16, len(samples)
    for s in samples:
        assert set(s.reward) == COMPONENTS, s.reward                      # the verify response's
        assert s.reward["reward"] == sum(v for k, v in s.reward.items() if k != "reward")
        check_tokens(s, tokenizer)
        assert "broken" not in s.metadata["nemo_gym"]                    # failed groups never train
    actors = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in actors if r["kind"] == "actors"]
    assert actors[-1]["episode/failed"] >= 4 and actors[-1]["buffer/retried"] >= 1, actors[-1]
    settled = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if "sessions of this run open" in line]
    assert settled and all("sessions of this run open: 0" in line for line in settled), settled
    assert {p.pid for p in gym_servers()} - before == set()
    assert left_behind(out) == []   # no session, sandbox or process of the run
