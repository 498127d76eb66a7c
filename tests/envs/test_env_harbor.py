"""Harbor through its own trial machinery (its Python 3.12 venv, a supervised trial server), in our
sandboxes, with the model behind a TITO session.

- Our Harbor-layout loader (`miles.sandboxes.harbor`) reads what `harbor tasks init` makes, and
  agrees with Harbor's own `Task` parsing on every field we use.
- Failures are data: a task whose verifier writes no reward, and a trial server that is down,
  give `failed` samples naming the error; the episode runner goes on.
- The recipe in a real `miles run`: 16 Harbor trials, Harbor's rewards in the samples, every
  sample's tokens the chat template's rendering of the trial's conversation, nothing left.

The venv is made by `scripts/envs/setup_harbor.sh` (idempotent); a failing set-up fails these tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio

from miles.sandboxes.harbor import load_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def harbor_python() -> str:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "envs" / "setup_harbor.sh")], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"setup_harbor.sh failed:\n{r.stderr[-3000:]}"
    python = r.stdout.strip().splitlines()[-1]
    return python if os.path.isabs(python) else str(ROOT / python)


HARBOR_FIELDS = """
import json, sys
from harbor.models.task.task import Task
t = Task(sys.argv[1]); c = t.config; e = c.environment
mode = getattr(e, "network_mode", None)
print(json.dumps({"name": t.name, "instruction": t.instruction, "agent_timeout_s": c.agent.timeout_sec,
    "verifier_timeout_s": c.verifier.timeout_sec, "build_timeout_s": e.build_timeout_sec,
    "docker_image": e.docker_image, "workdir": e.workdir, "cpus": e.cpus, "memory_mb": e.memory_mb,
    "storage_mb": e.storage_mb, "env": dict(e.env), "verifier_env": dict(c.verifier.env),
    "network": (getattr(mode, "value", mode) == "public") if mode is not None else bool(e.allow_internet)}))
"""


def test_loader_agrees_with_harbor_on_a_task_harbor_made(harbor_python, tmp_path):
    harbor = str(Path(harbor_python).parent / "harbor")
    r = subprocess.run([harbor, "tasks", "init", "miles/agree", "--no-pytest", "-p", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    task = tmp_path / "agree"
    toml = (task / "task.toml").read_text()
    # fill in every field our loader reads, as a task author would
    toml = toml.replace('[agent]\ntimeout_sec = 600.0', '[agent]\ntimeout_sec = 123.0')
    toml = toml.replace('[verifier]\ntimeout_sec = 600.0', '[verifier]\ntimeout_sec = 45.0')
    toml = re.sub(r'network_mode = "public"\nbuild_timeout_sec = 600.0',
                  'network_mode = "no-network"\nbuild_timeout_sec = 300.0\ncpus = 2\nmemory_mb = 1024\n'
                  'storage_mb = 2048\nworkdir = "/app"', toml)
    toml = toml.replace('[environment.env]\n', '[environment.env]\nFOO = "bar"\n')
    toml = toml.replace('[verifier.env]\n', '[verifier.env]\nMODE = "strict"\n')
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Print hello.\n")
    r = subprocess.run([harbor_python, "-c", HARBOR_FIELDS, str(task)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = load_task(str(task))
    assert ours.dockerfile == str(task / "environment" / "Dockerfile")
    mine = {k: getattr(ours, k) for k in theirs}
    assert mine == theirs
    assert theirs["network"] is False and theirs["cpus"] == 2 and theirs["env"] == {"FOO": "bar"}


@pytest_asyncio.fixture(loop_scope="module")
async def harbor_env_module(harbor_python):
    from miles.envs import harbor_env
    os.environ["MILES_HARBOR_PYTHON"] = harbor_python
    try:
        yield harbor_env
    finally:
        await harbor_env.close()
        os.environ.pop("MILES_HARBOR_PYTHON", None)


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


@pytest.mark.asyncio(loop_scope="module")
async def test_trials_score_fail_and_never_stop_the_runner(harbor_env_module, guarded, sandboxes, tmp_path):
    """Real Harbor trials against a scripted policy: a right answer scores 1 (Harbor's verifier),
    a task without a reward file and a dead server give failed samples with the error."""
    from miles.envs.agent import run_agent
    from miles.tito.client import SessionServerClient
    engine, session_url, token = guarded
    tasks = harbor_env_module.write_example_tasks(tmp_path / "tasks", n=2)
    word = re.search(r"word (\w+)", (tasks / "echo-000" / "instruction.md").read_text()).group(1)
    broken = tasks / "echo-001"
    (broken / "tests" / "test.sh").write_text("#!/bin/bash\necho no reward written\n")
    async with SessionServerClient(session_url, token=token) as client:
        engine.replies = [f"```bash\necho {word} > answer.txt\n```", word]
        ok = await run_agent(harbor_env_module.agent, {"harbor_task": str(tasks / "echo-000"),
                             "sandbox": await sandboxes(), "limits": {"max_turns": 2}},
                             client, group_id="g", rollout_id="g/0")
        assert ok.error == "" and ok.reward == {"reward": 1.0, "answered": 1.0}, ok.error
        assert [s.status for s in ok.samples] == ["completed"]
        bad = await run_agent(harbor_env_module.agent, {"harbor_task": str(broken), "sandbox": await sandboxes(),
                              "limits": {"max_turns": 1}}, client, group_id="g", rollout_id="g/1")
        assert "RewardFileNotFoundError" in bad.error and bad.samples[0].status == "failed"
        assert "RewardFileNotFoundError" in bad.samples[0].metadata["agent_error"]
        await harbor_env_module.close()
        os.environ["MILES_HARBOR_URL"] = "http://127.0.0.1:9"   # nothing listens there
        try:
            down = await run_agent(harbor_env_module.agent, {"harbor_task": str(tasks / "echo-000"),
                                   "sandbox": await sandboxes(), "limits": {}}, client, group_id="g", rollout_id="g/2")
        finally:
            os.environ.pop("MILES_HARBOR_URL")
            await harbor_env_module.close()
        assert down.samples[0].status in ("failed", "aborted") and "ClientConnectorError" in down.error
        assert await client.list_sessions() == []


def harbor_servers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any("harbor_server.py" in a for a in (p.info["cmdline"] or [])):
            out.append(p)
    return out


async def check_tokens(sample, tokenizer) -> None:
    """The sample's non-model tokens are the qwen3 template's rendering of the trial's messages, the
    model's turns are exactly its loss-masked tokens."""
    from miles.tito.families import get_family
    from miles.tito.template import render_template
    qwen3 = get_family("qwen3")
    messages = sample.metadata["agent"]["messages"]
    prompt_len = len(sample.tokens) - sample.response_length
    mask = np.concatenate([np.zeros(prompt_len, bool), sample.loss_mask.astype(bool)])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    turns = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    msgs, marks = [], []
    for m in messages:
        if m["role"] == "assistant":
            marks.append(f"\x00turn{len(marks)}\x00")
            msgs.append({"role": "assistant", "content": marks[-1]})
        else:
            msgs.append(m)
    # a sample ends at its last model turn: what the trial sent after it is another sample's
    last = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][len(turns) - 1]
    marks, msgs = marks[:len(turns)], msgs[:last + 1]
    text = render_template(qwen3.chat_template, msgs, None, False)
    tokens, pos = sample.tokens.tolist(), 0
    for k, (mark, (a, b)) in enumerate(zip(marks, turns)):
        piece, text = text.split(mark)
        if k and tokenizer.id_to_token(tokens[pos - 1]) == qwen3.end_of_turn:
            piece = piece[len(qwen3.end_of_turn):]
        assert tokens[pos:a] == tokenizer.encode(piece), (k, tokenizer.decode(tokens[pos:a]), piece)
        ids = tokens[a:b]
        if tokenizer.id_to_token(ids[-1]) in qwen3.stop_tokens:
            ids = ids[:-1]
        assert qwen3.parse_reply(tokenizer.decode(ids)).content.strip() == \
            [m for m in messages if m["role"] == "assistant"][k]["content"].strip()
        pos = b
    assert pos == len(tokens)


BROKEN_TASKS = """
import shutil
from pathlib import Path

from miles.envs import harbor_env


def tasks(seed=0, test_frac=0.25):
    # the example tasks, the 1st and 3rd training task's verifier writing no reward
    splits = harbor_env.example_tasks(seed=seed, test_frac=test_frac)
    for row in (splits["train"][0], splits["train"][2]):
        src = Path(row["metadata"]["harbor_task"])
        dst = Path(__file__).parent / "broken" / src.name
        shutil.copytree(src, dst, dirs_exist_ok=True)
        (dst / "tests" / "test.sh").write_text("#!/bin/bash\\necho no reward written\\n")
        row["metadata"] = {**row["metadata"], "harbor_task": str(dst)}
    return splits
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_harbor_recipe_in_a_real_miles_run(harbor_python, tmp_path):
    """Two of the first four training tasks fail in Harbor's verifier: their groups are failed
    (retried, then dropped by the buffer), the run trains on the others and ends normally."""
    from miles.engines.procs import free_port
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records
    before = {p.pid for p in harbor_servers()}
    out = tmp_path / "harbor-run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_"))}
    env["MILES_HARBOR_PYTHON"] = harbor_python
    (tmp_path / "broken_harbor_tasks.py").write_text(BROKEN_TASKS)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "envs" / "harbor.toml"),
         "--set", f"run.output_dir={json.dumps(str(out))}", "--set", "logging.progress=false",
         "--set", 'data.task="broken_harbor_tasks:tasks"', "--set", "data.shuffle=false",
         "--set", "logging.record_wire=true", "--set", f"cluster.head_port={free_port()}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) >= 16, len(samples)   # 2 steps x 2 groups x 4 trials
    for s in samples:
        assert set(s.reward) == {"reward", "answered"}, s.reward        # Harbor's reward.json
        assert s.metadata["agent"]["harbor_rewards"] == s.reward
        assert s.metadata["harbor_task"].endswith(s.metadata["harbor_name"].split("/")[-1])
        asyncio.run(check_tokens(s, tokenizer))
    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if "episodes closed:" in line]
    assert closing and "live at close 0" in closing[0] and "swept 0" in closing[0], closing
    settled = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if "sessions of this run open" in line]
    assert settled and all("sessions of this run open: 0" in line for line in settled), settled
    assert {p.pid for p in harbor_servers()} - before == set()
    actors = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in actors if r["kind"] == "actors"]
    assert actors[-1]["episode/failed"] >= 4 and actors[-1]["buffer/retried"] >= 1, actors[-1]
    assert all("broken" not in s.metadata["harbor_task"] for s in samples)   # failed groups never train
