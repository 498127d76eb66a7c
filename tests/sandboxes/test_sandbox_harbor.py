"""Harbor-layout tasks end to end on the host backends (the docker run is in test_sandbox_docker):
the Dockerfile is replayed into a template, the agent writes its answer through exec, the verifier
gives 1 for the right answer, 0 for a wrong one, and a hanging verifier is a timeout (no reward)."""

from __future__ import annotations

import os

import pytest

from miles.sandboxes import dockerfile as df
from miles.sandboxes.base import SandboxSpec, SandboxSpecError
from miles.sandboxes.harbor import load_task, parse_rewards, run_verifier, task_spec
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
