"""Verifiers (v1) environments through `miles.envs.verifiers_env`: the real package (its venv, made
by scripts/envs/setup_verifiers.sh), the tests' echo environment (tests/envs/verifiers_envs), a
tiny model behind the real session server.

- unit tests of the adapter's pure parts (the reward dict, the delta assembly, bad configs);
- served mode: episodes through Verifiers' own env server against a real engine + session server,
  with a broken reward, a malformed task and a killed server each failing only their samples;
- in-process mode: the adapter run inside the Verifiers venv's Python (verifiers cannot be
  installed into Miles' .venv: it pins openai<3), against the same stack;
- a real `miles run` of recipes/envs/verifiers.toml (served), every trained sample checked against
  the chat template's rendering of its conversation, nothing left afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio

from miles.envs.verifiers_env import VerifiersEnv, VerifiersError, _apply_delta, env, episode_result
from tests.envs.leftovers import left_behind
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "tests" / "envs" / "verifiers_envs"
SERVE_MARK = "from verifiers.v1.serve import serve_env"


@pytest.fixture(scope="session")
def vf_python() -> str:
    """The Verifiers venv's Python; the set-up script's failure fails the test (no skip)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "envs" / "setup_verifiers.sh")], capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, f"setup_verifiers.sh failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return str(ROOT / out.stdout.strip().splitlines()[-1])


@pytest.fixture()
def on_path(monkeypatch):
    """The echo environment importable by Verifiers (the env server inherits PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ENVS), os.environ.get("PYTHONPATH")) if p))


def serve_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(SERVE_MARK in a for a in p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


# -- the adapter's pure parts ---------------------------------------------------------------------

def trace(rewards, metrics=None, ok=True, errors=()):
    return {"id": "t", "rewards": rewards, "metrics": metrics or {}, "ok": ok, "errors": list(errors)}


def test_the_reward_is_the_weighted_sum_with_each_criterion_beside_it():
    out = episode_result([trace({"says_word": {"score": 1.0, "weight": 1.0}, "brief": {"score": 0.5, "weight": 0.5}},
                                {"model_turns": 2})], True, [])
    assert out["reward"] == {"reward": 1.25, "says_word": 1.0, "brief": 0.5}
    assert out["metrics"] == {"verifiers/model_turns": 2.0}
    two = episode_result([trace({"a": {"score": 1.0, "weight": 2.0}}), trace({"a": {"score": 0.0, "weight": 2.0}})],
                         True, [])
    assert two["reward"] == {"reward": 1.0, "a": 0.5} and two["traces"] == 2


def test_an_episode_without_a_usable_reward_raises_naming_why():
    with pytest.raises(VerifiersError, match="TaskError: broken"):
        episode_result([trace({"a": None}, ok=False, errors=[{"type": "TaskError", "message": "broken"}])], False, [])
    with pytest.raises(VerifiersError, match="no score for a"):
        episode_result([trace({"a": None})], True, [])
    with pytest.raises(VerifiersError, match="no trace"):
        episode_result([], False, [])
    with pytest.raises(VerifiersError, match="EnvError: run"):
        episode_result([trace({"a": {"score": 1.0}})], False, [{"type": "EnvError", "message": "run"}])


def test_deltas_assemble_to_the_rewards_and_counts_a_retry_discards():
    traces: dict = {}
    _apply_delta(traces, {"trace": "a", "open": {"id": "a"}, "nodes": [{}, {}], "calls": [{}]})
    _apply_delta(traces, {"trace": "b", "open": {"id": "b"}, "nodes": [{}]})
    _apply_delta(traces, {"trace": "b", "discard": True})
    _apply_delta(traces, {"trace": "a", "nodes": [{}], "errors": [{"type": "X"}],
                          "set": {"rewards": {"r": {"score": 1.0, "weight": 1.0}}, "ok": True}})
    assert list(traces) == ["a"]
    assert (traces["a"]["_nodes"], traces["a"]["_calls"], traces["a"]["ok"]) == (3, 1, True)
    assert traces["a"]["errors"] == [{"type": "X"}] and traces["a"]["rewards"]["r"]["score"] == 1.0


def test_bad_configs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"env\['taskset'\]\['id'\]"):
        VerifiersEnv({"taskset": {}})
    with pytest.raises(ValueError, match="max_concurrent must be at least 1, got 0"):
        VerifiersEnv({"taskset": {"id": "x"}}, max_concurrent=0)
    assert env.some_taskset is env.some_taskset and env.some_taskset.env["agent"]["runtime"]["type"] == "subprocess"
    with pytest.raises(VerifiersError, match=r"metadata\['verifiers'\]\['task'\]"):
        asyncio.run(env.some_taskset.served("http://127.0.0.1:1", {"id": "row-1"}))


@pytest.mark.slow   # two Python starts importing verifiers: ~20 s each on a busy 2-core machine
def test_the_taskset_loads_in_the_env_python_and_splits_by_seed(vf_python, on_path):
    echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo", "num_tasks": 8}}, python=vf_python)
    splits = echo.tasks(seed=1, test_frac=0.25)
    assert (len(splits["train"]), len(splits["test"])) == (6, 2)
    row = splits["train"][0]
    assert row["prompt"] == f"Say {row['metadata']['verifiers']['task']['word']}."
    assert echo.tasks(seed=1, test_frac=0.25) == splits and echo.tasks(seed=2, test_frac=0.25) != splits
    with pytest.raises(VerifiersError, match="no_such_taskset"):
        VerifiersEnv({"taskset": {"id": "no_such_taskset"}}, python=vf_python).tasks()


# -- episodes against a real engine and session server --------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    """(session server url, model dir): an untrained tiny Qwen3 -> embedded engine -> smg -> TITO."""
    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.gateway import GatewayConfig, launch_gateway
    from miles.engines.procs import ServerProcess, free_port
    from miles.tiny import build_tiny_model

    model = build_tiny_model(arch="qwen3")
    logs = tmp_path_factory.mktemp("verifiers-logs")
    engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=logs / "engine.log")
    gateway = await launch_gateway(GatewayConfig(port=free_port(), prometheus_port=free_port()), [engine.url],
                                   log_path=logs / "smg.log")
    port = free_port()
    server = ServerProcess("tito", [sys.executable, "-m", "miles.tito.server", "--engine-url", gateway.url,
                                    "--model-path", str(model), "--family", "qwen3", "--port", str(port)],
                           log_path=logs / "tito.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        await server.wait_healthy(url, timeout_s=90)
        yield url, model
    finally:
        await asyncio.gather(server.stop_async(grace_s=5), gateway.stop_async(grace_s=5),
                             engine.stop_async(grace_s=5))


def task_of(row: dict, **sampling) -> dict:
    return {**row["metadata"], "prompt": row["prompt"], "id": row["metadata"]["verifiers"]["task"].get("id"),
            "sampling": {"max_tokens": 12, "temperature": 1.0, **sampling}}


async def open_sessions(url: str) -> list[str]:
    from miles.tito.client import SessionServerClient
    async with SessionServerClient(url) as client:
        return await client.list_sessions()


def check_exact(sample, tokenizer, word: str) -> None:
    """The tokens outside the model's turns are the chat template's rendering of the echo
    conversation (user, assistant, user "Again: ...", assistant), tokenized; the loss mask is exactly
    the model's turns, and the rollout log-probs sit on them only."""
    from miles.tito.families import get_family
    from miles.tito.template import render_template
    qwen3 = get_family("qwen3")
    prompt_len = len(sample.tokens) - sample.response_length
    mask = np.concatenate([np.zeros(prompt_len, bool), sample.loss_mask.astype(bool)])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    turns = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    assert turns and turns[0][0] == prompt_len, turns
    messages, marks = [{"role": "user", "content": f"Say {word}."}], []
    for k in range(len(turns)):
        marks.append(f"\x00turn{k}\x00")
        messages.append({"role": "assistant", "content": marks[-1]})
        if k + 1 < len(turns):
            messages.append({"role": "user", "content": f"Again: say {word}."})
    text = render_template(qwen3.chat_template, messages, None, False)
    tokens, pos = sample.tokens.tolist(), 0
    for k, (mark, (a, b)) in enumerate(zip(marks, turns)):
        piece, text = text.split(mark, 1)
        if k and tokenizer.id_to_token(tokens[pos - 1]) == qwen3.end_of_turn:
            piece = piece[len(qwen3.end_of_turn):]   # the model wrote the turn's end itself
        assert tokens[pos:a] == tokenizer.encode(piece), (k, tokenizer.decode(tokens[pos:a]), piece)
        pos = b
    assert pos == len(tokens)
    model = sample.loss_mask.astype(bool)
    assert (sample.rollout_logprobs[~model] == 0).all() and (sample.rollout_logprobs[model] < 0).any()


def check_reward(reward) -> None:
    assert set(reward) == {"reward", "says_word", "brief"}, reward
    assert reward["reward"] == pytest.approx(reward["says_word"] + 0.5 * reward["brief"])


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_served_episodes_score_with_the_rubric_and_are_token_exact(stack, vf_python, on_path):
    from miles.envs.agent import run_agent_group
    from miles.tito.tokenizer import load_tokenizer
    url, model = stack
    echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo"}, "agent": {"runtime": {"type": "subprocess"}}},
                        python=vf_python)
    rows = echo.tasks(seed=0)["train"][:2]
    tokenizer = load_tokenizer(str(model))
    try:
        groups = await asyncio.gather(*(run_agent_group(echo.served, task_of(r), 4, url, group_id=f"g{i}")
                                        for i, r in enumerate(rows)))
        pid = echo._server.process.pid
    finally:
        await echo.close()
    samples = [s for g in groups for s in g]
    assert len(samples) == 8   # 8 episodes, one sample each (no retries in a two-turn chat)
    for row, group in zip(rows, groups):
        for s in group:
            assert s.status in ("completed", "truncated"), s.metadata
            check_reward(s.reward)
            check_exact(s, tokenizer, row["metadata"]["verifiers"]["task"]["word"])
            assert s.metadata["agent"]["traces"] == 1
    assert await open_sessions(url) == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_failing_environment_fails_only_its_samples(stack, vf_python, on_path):
    from miles.envs.agent import run_agent_group
    url, _ = stack
    echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo", "fail_every": 2},
                         "agent": {"runtime": {"type": "subprocess"}}}, python=vf_python)
    rows = sorted(echo.tasks(seed=0, test_frac=0.1)["train"],
                  key=lambda r: r["metadata"]["verifiers"]["task"]["idx"])
    good, broken = rows[0], next(r for r in rows if r["metadata"]["verifiers"]["task"]["fail"])
    malformed = {**good, "metadata": {"verifiers": {"task": {"prompt": "Say cat."}}}}   # no `word`
    try:
        out = await run_agent_group(echo.served, task_of(broken), 2, url)
        assert all(s.status == "failed" and "broken on purpose" in s.metadata["agent_error"] for s in out), \
            [s.metadata.get("agent_error") for s in out]
        out = await run_agent_group(echo.served, task_of(malformed), 1, url)
        assert out[0].status == "failed" and "word" in out[0].metadata["agent_error"], out[0].metadata
        # the server dies in the middle of an episode: that episode fails at once, the next one
        # gets a new server
        first = echo._server.process
        task = good["metadata"]["verifiers"]["task"]
        hanging = {**good, "metadata": {"verifiers": {**good["metadata"]["verifiers"],
                                                      "task": {**task, "fail": "hang"}}}}
        killing = asyncio.ensure_future(run_agent_group(echo.served, task_of(hanging), 1, url))
        await asyncio.sleep(2.0)     # the episode is in the server: its reward takes a minute
        first.kill()
        out = await asyncio.wait_for(killing, 60)
        assert out[0].status == "failed" and "exited with code" in out[0].metadata["agent_error"], out[0].metadata
        first.log_path.unlink(missing_ok=True)   # a crashed server's log is kept for its reader: here, us
        out = await run_agent_group(echo.served, task_of(good), 2, url)
        assert [s.status for s in out] != ["failed", "failed"] and echo._server.process is not first
        for s in out:
            check_reward(s.reward)
    finally:
        await echo.close()
    assert await open_sessions(url) == []
    assert serve_processes() == []


IN_PROCESS = """
import asyncio, json, sys
from miles.envs.agent import run_agent_group
from miles.envs.verifiers_env import VerifiersEnv

async def main(url, rows):
    echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo"}, "agent": {"runtime": {"type": "subprocess"}}})
    try:
        groups = await asyncio.gather(*(run_agent_group(echo.agent, task, 4, url) for task in rows))
    finally:
        await echo.close()
    for task, group in zip(rows, groups):
        for s in group:
            print(json.dumps({"tokens": s.tokens.tolist(), "loss_mask": s.loss_mask.tolist(),
                              "logprobs": s.rollout_logprobs.tolist(), "response_length": s.response_length,
                              "status": s.status, "reward": s.reward, "word": task["verifiers"]["task"]["word"],
                              "error": s.metadata.get("agent_error")}))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_in_process_episodes_in_the_verifiers_python(stack, vf_python, on_path):
    """`.agent` loads the env into the calling Python: here the Verifiers venv's, running the adapter
    and Miles' agent runner (msgspec, aiohttp, numpy; no torch) against the real stack."""
    from types import SimpleNamespace

    from miles.tito.tokenizer import load_tokenizer
    url, model = stack
    rows = VerifiersEnv({"taskset": {"id": "miles_vf_echo"}}, python=vf_python).tasks(seed=0)["train"][:2]
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]])}
    tasks = json.dumps([task_of(r) for r in rows])
    proc = await asyncio.create_subprocess_exec(vf_python, "-c", IN_PROCESS, url, tasks,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env_vars, cwd=ROOT)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    samples = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert len(samples) == 8
    tokenizer = load_tokenizer(str(model))
    for s in samples:
        assert s["status"] in ("completed", "truncated") and s["error"] is None, s
        check_reward(s["reward"])
        check_exact(SimpleNamespace(tokens=np.array(s["tokens"]), loss_mask=np.array(s["loss_mask"], np.uint8),
                                    rollout_logprobs=np.array(s["logprobs"], np.float32),
                                    response_length=s["response_length"]), tokenizer, s["word"])
    assert await open_sessions(url) == []


# -- a real miles run ------------------------------------------------------------------------------

def run_recipe(out: Path, overrides: list[str], timeout_s: float, extra_path: str = "") -> tuple[int, str]:
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "envs" / "verifiers.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={cluster_port()}"]
    for o in overrides:
        args += ["--set", o]
    env_vars = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ENVS), env_vars.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(args, cwd=ROOT, env=env_vars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, log.decode(errors="replace")


USER_MODULE = """
from miles.envs.verifiers_env import VerifiersEnv

echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo", "fail_every": 3}, "agent": {"runtime": {"type": "subprocess"}}},
                    python=PYTHON)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_miles_run_trains_on_served_verifiers_episodes(tmp_path, vf_python):
    """The recipe with a user module naming the env's config (a third of its tasks' rewards raise):
    the run finishes, the good episodes' samples carry the rubric's dict reward and are exact, the
    broken ones are failed with Verifiers' error, and no env server or session is left."""
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    (tmp_path / "my_vf_env.py").write_text(USER_MODULE.replace("PYTHON", repr(vf_python)))
    out = tmp_path / f"vf-{int(time.time())}"
    code, log = run_recipe(out, ["data.task='my_vf_env:echo.tasks'", "rollout.agent='my_vf_env:echo.served'",
                                 "loop.num_steps=3", "logging.record_wire=true", "buffer.filter='none'"],
                           timeout_s=850, extra_path=str(tmp_path))
    assert code == 0, log[-4000:]
    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) >= 3 * 2 * 4, len(samples)
    trained = [s for s in samples if s.status != "failed"]
    assert len(trained) >= 8
    for s in trained:
        check_reward(s.reward)
        check_exact(s, tokenizer, s.metadata["verifiers"]["task"]["word"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in rows if r["kind"] == "actors"]
    assert actors[-1]["episode/count"] >= 24 and "episode/verifiers/model_turns" in actors[-1]
    # the broken tasks' episodes failed (their error text is checked in the served test above), their
    # groups were retried and dropped by the buffer, and the run went on
    assert actors[-1]["episode/failed"] > 0 and actors[-1]["buffer/dropped"] + actors[-1]["buffer/retried"] > 0
    assert "sessions of this run open: 0" in (out / "logs" / "rollout.log").read_text()
    server_logs = sorted((out / "logs").glob("verifiers-env-*.log"))
    assert {p.name for p in server_logs} >= {"verifiers-env-miles_vf_echo-rollout.log"}
    for p in server_logs:
        assert "EnvServer down" in p.read_text(), p   # stopped, not killed
    assert serve_processes() == [], "an env server outlived its run"
    assert left_behind(out) == []   # no session, sandbox or process of the run
