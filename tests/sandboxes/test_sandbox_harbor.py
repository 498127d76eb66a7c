"""Harbor-layout tasks end to end on the host backends (the docker run is in test_sandbox_docker):
the Dockerfile is replayed into a template, the agent writes its answer through exec, the verifier
gives 1 for the right answer, 0 for a wrong one, and a hanging verifier is a timeout (no reward).
tests/test.sh runs as `[verifier] user` (a backend that cannot be that user says so), and a
separate verifier runs in a fresh sandbox with the agent's artifacts only, closed afterwards."""

from __future__ import annotations

import os

import msgspec
import pytest

from miles.sandboxes import dockerfile as df
from miles.sandboxes.base import SandboxError, SandboxSpec, SandboxSpecError
from miles.sandboxes.harbor import (Artifact, load_task, parse_rewards, run_verifier, task_spec,
                                    verifier_spec)
from miles.sandboxes.local import current_user
from miles.sandboxes.pool import SandboxPool
from sandbox_helpers import leftover_entries, needs_jail, sandbox_processes, wait_until

pytestmark = pytest.mark.timeout(90)
TASKS = os.path.join(os.path.dirname(__file__), "tasks")
AGENT_RIGHT = "read -r a b < input.txt && echo $((a + b)) > answer.txt"
AGENT_WRONG = "echo 41 > /app/answer.txt"


def test_load_task_reads_harbor_fields():
    task = load_task(os.path.join(TASKS, "hello-sum"))
    assert task.name == "hello-sum" and "sum" in task.instruction
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.network) == (60.0, 20.0, False)
    assert task.verifier_env == {"ANSWER_FILE": "/app/answer.txt"}
    spec = task_spec(task, labels={"miles.run": "r1"})
    assert spec.dockerfile == os.path.join(task.path, "environment", "Dockerfile")
    assert (spec.memory_mb, spec.disk_mb, spec.cpu, spec.network) == (512, 1024, 1.0, False)
    assert spec.labels == {"miles.task": "hello-sum", "miles.run": "r1"}
    assert spec.ttl_s == 60 + 20 + 300


def test_bad_task_files_name_the_key(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("true")
    (tmp_path / "instruction.md").write_text("x")
    (tmp_path / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n'
                                        '[environment]\ndocker_image = "img"\n')
    with pytest.raises(SandboxSpecError, match=r"\[verifier\]\.timeout_sec='soon'"):
        load_task(str(tmp_path))
    (tmp_path / "task.toml").write_text('[environment]\ndocker_image = "img"\n'
                                        'network_mode = "sometimes"\n')
    with pytest.raises(SandboxSpecError, match="network_mode='sometimes'"):
        load_task(str(tmp_path))


def test_reward_parsing_follows_harbor():
    assert parse_rewards("1\n", "reward.txt") == {"reward": 1.0}
    assert parse_rewards('{"reward": 0.5, "style": 1}', "reward.json") == \
        {"reward": 0.5, "style": 1.0}
    for bad, src in (("nan", "reward.txt"), ("", "reward.txt"), ('{"reward": "yes"}',
                                                                  "reward.json")):
        with pytest.raises(ValueError):
            parse_rewards(bad, src)


def test_dockerfile_errors_point_at_the_line(tmp_path):
    text = "FROM a\nRUN echo hi\nFROM b AS second\n"
    assert [i.cmd for i in df.parse(text)] == ["FROM", "RUN", "FROM"]
    with pytest.raises(df.DockerfileError, match=r"D:2: bad flag"):
        df.parse("FROM a\nCOPY --=x a b\n", "D")


async def test_harbor_task_end_to_end(host_backend, base_dir):
    needs_jail(host_backend)
    task = load_task(os.path.join(TASKS, "hello-sum"))
    spec = task_spec(task)
    async with await host_backend.create(spec) as sb:
        assert sb.workdir == "/app"  # from the Dockerfile's WORKDIR
        r = await sb.exec("cat input.txt data/seed.txt; echo $TASK_NAME")
        assert r.stdout == "17 25\nseed\nhello-sum\n", r
        assert (await sb.exec(AGENT_RIGHT)).ok
        result = await run_verifier(sb, task)
    assert (result.status, result.reward) == ("ok", 1.0), result
    assert "PASS: 42" in result.output

    async with await host_backend.create(spec) as sb:  # template cached: no rebuild
        await sb.exec(AGENT_WRONG)
        # The agent also tries to forge the verdict; the verifier wipes both first.
        await sb.exec("mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
                      "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh")
        result = await run_verifier(sb, task)
    assert (result.status, result.reward) == ("ok", 0.0), result
    assert leftover_entries(base_dir) == []


async def test_verifier_timeout_is_a_failure_not_reward_zero(host_backend, base_dir):
    needs_jail(host_backend)
    task = load_task(os.path.join(TASKS, "slow-verifier"))
    async with await host_backend.create(task_spec(task)) as sb:
        result = await run_verifier(sb, task)
        assert (result.status, result.reward) == ("timeout", None), result
        assert result.duration_s < task.verifier_timeout_s + host_backend.kill_after_s + 3
        if host_backend.privileged:
            assert await wait_until(lambda: [p for p in sandbox_processes()
                                             if p.uids().real == sb.uid] == [], timeout_s=3)


async def test_unsupported_dockerfile_steps_fail_clearly(host_backend, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM x\nRUN apt-get install -y foo\n")
    spec = SandboxSpec(dockerfile=str(tmp_path / "Dockerfile"))
    with pytest.raises(df.DockerfileError, match=r"Dockerfile:2: RUN 'apt-get install -y foo'"):
        await host_backend.create(spec)
    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY missing.txt /app/\n")
    with pytest.raises(df.DockerfileError, match=r"Dockerfile:2: source 'missing.txt' not found"):
        await host_backend.create(spec)


async def test_verifier_refuses_a_sandbox_without_absolute_paths():
    from miles.sandboxes.base import Sandbox, SandboxError

    class Mapped(Sandbox):
        backend_name = "subprocess"
        absolute_paths = False

        async def _exec(self, argv, cwd, env, timeout_s): ...
        async def _upload(self, path, data, mode): ...
        async def _download(self, path): ...
        async def _destroy(self): ...

    task = load_task(os.path.join(TASKS, "hello-sum"))
    with pytest.raises(SandboxError, match="bwrap"):
        await run_verifier(Mapped("m1", SandboxSpec(), workdir="/w"), task)


def write_task(root, toml: str, test_sh: str | None = "true\n",
               tests_dockerfile: str | None = None) -> str:
    (root / "environment").mkdir(parents=True)
    (root / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (root / "tests").mkdir()
    if test_sh is not None:
        (root / "tests" / "test.sh").write_text(test_sh)
    if tests_dockerfile is not None:
        (root / "tests" / "Dockerfile").write_text(tests_dockerfile)
    (root / "instruction.md").write_text("x")
    (root / "task.toml").write_text(toml)
    return str(root)


def test_load_task_reads_users_and_the_verifier_environment(tmp_path):
    plain = load_task(os.path.join(TASKS, "hello-sum"))
    assert (plain.agent_user, plain.verifier_user, plain.verifier_environment) == (None, None, None)
    task = load_task(write_task(tmp_path / "a", 'artifacts = ["/data", {source = "out.txt", '
                                'exclude = ["*.tmp"]}]\n[agent]\nuser = "agent"\n'
                                '[verifier]\nuser = 1000\nenvironment_mode = "separate"\n'
                                '[environment]\ncpus = 2\nnetwork_mode = "public"\n'))
    assert (task.agent_user, task.verifier_user) == ("agent", "1000")   # Harbor's str | int
    assert task.artifacts == [Artifact("/data"), Artifact("out.txt", ["*.tmp"])]
    v = task.verifier_environment   # no table: a fresh copy of [environment], the task's own image
    assert (v.dockerfile, v.docker_image, v.bundled_tests) == (task.dockerfile, None, False)
    assert (v.cpus, v.network) == (2, True)
    # a [verifier.environment] table implies "separate"; its docker_image owns /tests
    task = load_task(write_task(tmp_path / "b", '[verifier.environment]\ndocker_image = "judge:1"\n'
                                'memory_mb = 2048\nnetwork_mode = "no-network"\n', test_sh=None))
    v = task.verifier_environment
    assert (v.docker_image, v.dockerfile, v.bundled_tests, v.memory_mb, v.cpus, v.network) == \
        ("judge:1", None, True, 2048, None, False)
    # then tests/Dockerfile (built from tests/, which it copies into its image)
    task = load_task(write_task(tmp_path / "c", '[verifier]\nenvironment_mode = "separate"\n',
                                tests_dockerfile="FROM debian:bookworm-slim\n"))
    assert (task.verifier_environment.dockerfile, task.verifier_environment.bundled_tests) == \
        (str(tmp_path / "c" / "tests" / "Dockerfile"), True)


def test_bad_users_and_verifier_environments_name_the_key_and_value(tmp_path):
    root = tmp_path / "t"
    write_task(root, "")
    for toml, match in (('[agent]\nuser = true\n', r"\[agent\]\.user=True is invalid"),
                        ('[agent]\nuser = "a b"\n', r"\[agent\]\.user='a b' is invalid"),
                        ('[verifier]\nuser = ["root"]\n', r"\[verifier\]\.user=\['root'\] is "),
                        ('[verifier]\nuser = -1\n', r"\[verifier\]\.user=-1 is invalid"),
                        ('[verifier]\nenvironment_mode = "elsewhere"\n',
                         r"\[verifier\]\.environment_mode='elsewhere' is invalid"),
                        ('[verifier]\nenvironment_mode = "shared"\n'
                         '[verifier.environment]\ncpus = 1\n',
                         r"environment_mode='shared' is incompatible with \[verifier.environment"),
                        ('artifacts = [{source = "/x", service = "db"}]\n',
                         r"artifacts\[0\]\.service='db' is invalid")):
        (root / "task.toml").write_text(toml)
        with pytest.raises(SandboxSpecError, match=match):
            load_task(str(root))


async def test_the_verifier_runs_as_its_user(host_backend):
    """tests/test.sh, and only it, runs as `[verifier] user`; a user the backend cannot be is an
    error naming the user and the backend, never a run as someone else."""
    needs_jail(host_backend)
    task = load_task(os.path.join(TASKS, "hello-sum"))
    me = current_user()[0] if host_backend.name == "subprocess" else "root"
    async with await host_backend.create(task_spec(task)) as sb:
        await sb.exec(AGENT_RIGHT)
        seen = []
        real = sb._exec_as

        async def recorded(user, argv, *rest):
            seen.append((user, argv[-1]))
            return await real(user, argv, *rest)

        sb._exec_as = recorded
        result = await run_verifier(sb, msgspec.structs.replace(task, verifier_user=me))
        assert (result.status, result.reward) == ("ok", 1.0), result
        assert [u for u, _ in seen] == [me] and "/tests/test.sh" in seen[0][1]
        with pytest.raises(SandboxError, match=rf"backend {host_backend.name} cannot run commands "
                                               r"as user 'nobody'"):
            await run_verifier(sb, msgspec.structs.replace(task, verifier_user="nobody"))


SEPARATE_TEST = """#!/bin/bash
# the agent's artifacts are here, its workdir and everything else of its sandbox are not
ok=1
[ "$(cat /logs/artifacts/answer.txt)" = 42 ] || ok=0
[ -f /data/keep.txt ] && [ ! -e /data/skip.tmp ] || ok=0
[ ! -e /app/scratch.txt ] && [ ! -e /home/agent-was-here ] || ok=0
[ "$VERIFIER_ENV" = yes ] || ok=0
echo $ok > /logs/verifier/reward.txt
"""


async def test_a_separate_verifier_gets_a_fresh_sandbox_closed_afterwards(host_backend, tmp_path):
    needs_jail(host_backend)
    task = load_task(write_task(tmp_path / "sep", 'artifacts = [{source = "/data", exclude = '
                                '["*.tmp"]}]\n[verifier]\nenvironment_mode = "separate"\n'
                                '[verifier.env]\nVERIFIER_ENV = "yes"\n', SEPARATE_TEST))
    pool = SandboxPool(host_backend, max_concurrent=1)

    def fresh(spec):   # rides on the agent's slot: a second one never comes from a full pool
        return pool.sandbox(spec, own_slot=False)

    async with pool.sandbox(task_spec(task)) as sb:
        await sb.exec("mkdir -p /logs/artifacts /data /home && echo 42 > /logs/artifacts/answer.txt"
                      " && echo k > /data/keep.txt && echo s > /data/skip.tmp"
                      " && echo x > scratch.txt && touch /home/agent-was-here")
        with pytest.raises(SandboxError, match="open_sandbox"):
            await run_verifier(sb, task)
        result = await run_verifier(sb, task, open_sandbox=fresh)
        assert (result.status, result.reward) == ("ok", 1.0), result
        assert (pool.stats.created, pool.stats.destroyed) == (2, 1)
        assert not (await sb.exec("test -e /tests || test -e /logs/verifier/reward.txt")).ok
        # closed on an error too
        with pytest.raises(SandboxError, match="'nobody'"):
            await run_verifier(sb, msgspec.structs.replace(task, verifier_user="nobody"),
                               open_sandbox=fresh)
        assert (pool.stats.created, pool.stats.destroyed) == (3, 2)
    assert pool.stats.live == 0


async def test_a_verifier_image_that_owns_its_tests(host_backend, tmp_path):
    """tests/Dockerfile is the verifier's image; its /tests is used as it is, nothing uploaded."""
    needs_jail(host_backend)
    image = ("FROM debian:bookworm-slim\nRUN mkdir -p /tests && "
             "echo 'echo 0.5 > /logs/verifier/reward.txt' > /tests/test.sh\n")
    task = load_task(write_task(tmp_path / "own", '[verifier]\nenvironment_mode = "separate"\n',
                                test_sh=None, tests_dockerfile=image))
    spec = verifier_spec(task, task_spec(task))
    assert spec.dockerfile == str(tmp_path / "own" / "tests" / "Dockerfile")
    pool = SandboxPool(host_backend)
    async with pool.sandbox(task_spec(task)) as sb:
        result = await run_verifier(sb, task, open_sandbox=pool.sandbox)
    assert (result.status, result.reward) == ("ok", 0.5), result
    assert pool.stats.live == 0
