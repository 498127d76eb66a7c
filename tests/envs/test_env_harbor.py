"""Harbor through its own trial machinery (its Python 3.12 venv, a supervised trial server), in our
sandboxes, with the model behind a TITO session.

- Our Harbor-layout loader (`miles.sandboxes.harbor`) reads what `harbor tasks init` makes, and
  agrees with Harbor's own `Task` parsing on every field we use, users and the separate verifier's
  environment (Harbor's own resolution of it) included.
- A separate verifier gets a fresh sandbox from the episode's pool through the bridge, closed when
  Harbor stops it or the episode ends; every bridged exec runs as the user Harbor resolved.
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
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from miles.sandboxes.harbor import load_task, task_spec
from tests.envs.leftovers import left_behind
from tests.envs.token_checks import model_turns
from tests.ports import cluster_port

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


HARBOR_VERIFIER = """
import json, sys
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import resolve_task_verifier_mode, resolve_verifier_environment_definition
t = Task(sys.argv[1]); c = t.config
d = resolve_verifier_environment_definition(c, t.paths)
own = d is not None and d.config.docker_image is None and (d.directory / "Dockerfile").is_file()
print(json.dumps({"agent_user": c.agent.user, "verifier_user": c.verifier.user,
    "mode": resolve_task_verifier_mode(c).value, "image": d and d.config.docker_image,
    "dockerfile": str(d.directory / "Dockerfile") if own else None, "bundled": d and d.bundled_tests,
    "memory_mb": d and d.config.memory_mb, "network": d and d.config.network_mode.value == "public",
    "artifacts": [[a, []] if isinstance(a, str) else [a.source, a.exclude] for a in c.artifacts]}))
"""


def write_task(d: Path, toml: str, test_sh: str = "true\n", tests_dockerfile: str | None = None) -> Path:
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text(test_sh)
    if tests_dockerfile:
        (d / "tests" / "Dockerfile").write_text(tests_dockerfile)
    (d / "instruction.md").write_text("Say the word apple.\n")
    (d / "task.toml").write_text(toml)
    return d


def test_loader_agrees_with_harbor_on_users_and_the_verifier_environment(harbor_python, tmp_path):
    cases = {"image": ('artifacts = ["/data", {source = "out.txt", exclude = ["*.tmp"]}]\n'
                       '[agent]\nuser = "agent"\n[verifier]\nuser = 1000\n'
                       '[verifier.environment]\ndocker_image = "judge:1"\nmemory_mb = 2048\n', None),
             "tests-image": ('[verifier]\nenvironment_mode = "separate"\n[environment]\n'
                             'network_mode = "no-network"\n', "FROM ubuntu:24.04\n"),
             "copy": ('[verifier]\nenvironment_mode = "separate"\nuser = "root"\n', None),
             "shared": ('[agent]\nuser = 0\n', None)}
    for name, (toml, tests_dockerfile) in cases.items():
        task = write_task(tmp_path / name, toml, tests_dockerfile=tests_dockerfile)
        r = subprocess.run([harbor_python, "-c", HARBOR_VERIFIER, str(task)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        theirs = json.loads(r.stdout.strip().splitlines()[-1])
        for key in ("agent_user", "verifier_user"):   # Harbor's str | int is our exec(user=) string
            theirs[key] = None if theirs[key] is None else str(theirs[key])
        ours = load_task(str(task))
        v = ours.verifier_environment
        mine = {"agent_user": ours.agent_user, "verifier_user": ours.verifier_user,
                "mode": "separate" if v else "shared", "image": v and v.docker_image,
                "dockerfile": v and v.dockerfile, "bundled": v and v.bundled_tests,
                "memory_mb": v and v.memory_mb, "network": v and v.network,
                "artifacts": [[a.source, a.exclude] for a in ours.artifacts]}
        assert mine == theirs, name


async def test_the_bridge_opens_and_closes_a_separate_verifiers_sandbox(tmp_path):
    """Without Harbor: `open_verifier` gives a fresh sandbox of its own token, exec carries `user`,
    `close` or the episode's end destroys it; an episode with nothing to open says so."""
    import aiohttp

    from miles.envs.harbor_env import SandboxBridge
    from miles.sandboxes import SandboxSpec, get_backend
    from miles.sandboxes.hostfs import default_base_dir
    from miles.sandboxes.pool import SandboxPool
    base = tempfile.mkdtemp(prefix="miles-envs-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend("subprocess", base_dir=base)
    pool, bridge = SandboxPool(backend, max_concurrent=1), SandboxBridge()
    await bridge.start()
    try:
        async with pool.sandbox(SandboxSpec(ttl_s=120)) as agent_sb, aiohttp.ClientSession() as http:
            async def call(url, op, **body):
                async with http.post(f"{url}/{op}", json=body) as r:
                    return r.status, await r.json()

            url = bridge.register(agent_sb, lambda: pool.sandbox(SandboxSpec(ttl_s=120), own_slot=False))
            for harbor_closes in (True, False):   # else the episode's end closes it
                status, body = await call(url, "open_verifier")
                assert status == 200 and body["url"] != url, body
                status, out = await call(body["url"], "exec", command="id -u", user="root")
                assert status == 200 and out["exit_code"] == 0, out
                assert pool.stats.live == 2
                if harbor_closes:
                    assert (await call(body["url"], "close"))[0] == 200 and pool.stats.live == 1
            status, out = await call(url, "exec", command="true", user="nobody")
            assert status == 500 and "cannot run commands as user 'nobody'" in out["error"], out
            await bridge.unregister(url)
            assert pool.stats.live == 1 and (await call(body["url"], "exec", command="true"))[0] == 410
            assert (await call(bridge.register(agent_sb), "open_verifier"))[0] == 409
        assert pool.stats.live == 0 and pool.stats.destroyed == 3
    finally:
        await bridge.stop()
        backend.spawner.close()
        shutil.rmtree(base, ignore_errors=True)


SEPARATE_TEST = """#!/bin/bash
# the agent's /logs/artifacts came over, its workdir did not: a fresh sandbox
if grep -qi apple /logs/artifacts/answer.txt && [ ! -e /app/answer.txt ]; then r=1; else r=0; fi
echo "{\\"reward\\": $r}" > /logs/verifier/reward.json
"""


@pytest.mark.asyncio(loop_scope="module")
async def test_a_separate_verifier_runs_in_a_fresh_sandbox(harbor_env_module, guarded, tmp_path):
    """Real Harbor trials of a task whose verifier is separate: Harbor's verifier environment is a
    fresh sandbox of the episode's pool (the agent's workdir is not there, its artifacts are), and
    a user our backend cannot be fails the trial naming it; nothing is left open."""
    from miles.envs.agent import run_agent
    from miles.envs.context import EpisodeStats, LazySandbox
    from miles.sandboxes import get_backend
    from miles.sandboxes.hostfs import default_base_dir
    from miles.sandboxes.pool import SandboxPool
    from miles.tito.client import SessionServerClient
    engine, session_url, token = guarded
    toml = ('[agent]\nuser = "%s"\n[verifier]\nenvironment_mode = "separate"\nuser = 0\n'
            '[environment]\nallow_internet = false\n')
    good = write_task(tmp_path / "good", toml % "root", SEPARATE_TEST)
    bad = write_task(tmp_path / "bad", toml % "nobody", SEPARATE_TEST)
    base = tempfile.mkdtemp(prefix="miles-envs-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend("subprocess", base_dir=base)
    pool = SandboxPool(backend, max_concurrent=1)
    try:
        async with SessionServerClient(session_url, token=token) as client:
            for path, replies in ((good, ["```bash\nmkdir -p /logs/artifacts && echo apple > "
                                          "/logs/artifacts/answer.txt && echo apple > answer.txt\n```", "apple"]),
                                  (bad, ["```bash\necho apple > answer.txt\n```", "apple"])):
                engine.replies = replies
                sandbox = LazySandbox(pool, task_spec(load_task(str(path))), {}, EpisodeStats())
                try:
                    run = await run_agent(harbor_env_module.agent, {"harbor_task": str(path), "sandbox": sandbox,
                                          "limits": {"max_turns": 2}}, client, group_id="g", rollout_id=path.name)
                finally:
                    await sandbox.destroy()
                if path is good:
                    assert run.error == "" and run.reward == 1.0, run.error
                    assert pool.stats.created == 2 and pool.stats.live == 0   # the agent's, the verifier's
                else:
                    assert "cannot run commands as user 'nobody'" in run.error, run.error
            assert await client.list_sessions() == []
        assert pool.stats.live == 0
    finally:
        backend.spawner.close()
        shutil.rmtree(base, ignore_errors=True)


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
        assert "RewardFileNotFoundError" in bad.error, bad.error
        assert bad.samples and all(s.status == "failed" and s.metadata["agent_error"] == bad.error
                                   for s in bad.samples), [(s.status, s.metadata) for s in bad.samples]
        await harbor_env_module.close()
        os.environ["MILES_HARBOR_URL"] = "http://127.0.0.1:9"   # nothing listens there
        try:
            down = await run_agent(harbor_env_module.agent, {"harbor_task": str(tasks / "echo-000"),
                                   "sandbox": await sandboxes(), "limits": {}}, client, group_id="g", rollout_id="g/2")
        finally:
            os.environ.pop("MILES_HARBOR_URL")
            await harbor_env_module.close()
        assert "ClientConnectorError" in down.error, down.error
        assert down.samples and all(s.status == "failed" and s.metadata["agent_error"] == down.error
                                    for s in down.samples), [(s.status, s.metadata) for s in down.samples]
        assert await client.list_sessions() == []


def harbor_servers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any("harbor_server.py" in a for a in (p.info["cmdline"] or [])):
            out.append(p)
    return out


async def check_tokens(sample, tokenizer) -> None:
    """The sample's non-model tokens are the qwen3 template's rendering of the trial's messages, the
    model's turns are exactly its loss-masked tokens (a sample ends at its last model turn: what
    the trial sent after it is another sample's)."""
    from miles.tito.families import get_family
    from miles.tito.messages import parse_openai_messages
    qwen3 = get_family("qwen3")
    messages = sample.metadata["agent"]["messages"]
    turns = model_turns(sample, tokenizer, parse_openai_messages(messages))
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    assert [qwen3.parse_reply(tokenizer.decode(ids)).content.strip() for ids in turns] == replies[:len(turns)]


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
         "--set", "logging.record_wire=true", "--set", f"cluster.head_port={cluster_port()}"],
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
    assert left_behind(out) == []   # no session, sandbox (listed by the backend) or process of the run
    actors = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in actors if r["kind"] == "actors"]
    assert actors[-1]["episode/failed"] >= 4 and actors[-1]["buffer/retried"] >= 1, actors[-1]
    assert all("broken" not in s.metadata["harbor_task"] for s in samples)   # failed groups never train
