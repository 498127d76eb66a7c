"""One episode's sandbox spec: `[sandbox]` defaults, a task's own image (`metadata["image"]`) over
the recipe's, a rootfs only where no image is asked for, a task's own sandbox fields
(`metadata["sandbox"]`: a Harbor task's Dockerfile, limits, network) over the recipe's, and the run's
labels on every spec."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from miles.envs.context import sandbox_spec
from miles.envs.harbor_env import task_rows
from miles.sandboxes.config import SandboxConfig
from miles.sandboxes.base import SandboxSpecError
from miles.wire.messages import Sample


def test_a_tasks_image_overrides_the_recipes_and_the_limits_come_from_the_recipe():
    cfg = SandboxConfig(backend="docker", image="python:3.12-slim", cpu=2.0, memory_mb=512,
                        network=False, ttl_s=120.0)
    labels = {"miles.run": "r1"}
    own = sandbox_spec(cfg, {"image": "ghcr.io/acme/task-7:latest"}, labels)
    default = sandbox_spec(cfg, {}, labels)
    assert own.image == "ghcr.io/acme/task-7:latest" and default.image == "python:3.12-slim"
    for spec in (own, default):
        assert (spec.cpu, spec.memory_mb, spec.network, spec.ttl_s) == (2.0, 512, False, 120.0)
        assert spec.labels == labels and spec.rootfs is None


def test_a_rootfs_is_used_only_when_no_image_is_asked_for():
    cfg = SandboxConfig(backend="bwrap", rootfs="/srv/rootfs")
    assert sandbox_spec(cfg, {}, {}).rootfs == "/srv/rootfs"
    assert sandbox_spec(cfg, {}, {}).image is None
    with_image = sandbox_spec(cfg, {"image": "alpine:3"}, {})
    assert with_image.image == "alpine:3" and with_image.rootfs is None


def test_a_tasks_own_sandbox_fields_go_over_the_recipes():
    cfg = SandboxConfig(backend="subprocess", image="python:3.12-slim", cpu=2.0, memory_mb=512,
                        network=True, ttl_s=120.0)
    own = {"dockerfile": "/tasks/t1/environment/Dockerfile", "workdir": "/app", "env": {"A": "1"},
           "memory_mb": 2048, "ttl_s": 900.0}
    spec = sandbox_spec(cfg, {"sandbox": own}, {"miles.run": "r1"})
    # the task's Dockerfile replaces the recipe's image (one source at most); its limits win
    assert (spec.image, spec.rootfs, spec.dockerfile) == (None, None, own["dockerfile"])
    assert (spec.workdir, spec.env, spec.memory_mb, spec.ttl_s) == ("/app", {"A": "1"}, 2048, 900.0)
    assert spec.cpu == 2.0 and spec.labels == {"miles.run": "r1"}


def test_network_is_the_recipes_and_the_tasks():
    on, off = SandboxConfig(backend="subprocess", network=True), SandboxConfig(backend="subprocess")
    assert sandbox_spec(on, {"sandbox": {"network": True}}, {}).network is True
    assert sandbox_spec(on, {"sandbox": {"network": False}}, {}).network is False
    assert sandbox_spec(on, {"sandbox": {}}, {}).network is True
    assert sandbox_spec(off, {"sandbox": {"network": True}}, {}).network is False   # recipe keeps it off


def test_a_bad_task_sandbox_names_the_field_and_the_value():
    cfg = SandboxConfig(backend="subprocess")
    with pytest.raises(SandboxSpecError, match=r"metadata\.sandbox\.gpus=2 is invalid"):
        sandbox_spec(cfg, {"sandbox": {"gpus": 2}}, {})
    with pytest.raises(SandboxSpecError, match=r"metadata\.sandbox\.memory_mb"):
        sandbox_spec(cfg, {"sandbox": {"memory_mb": "lots"}}, {})
    with pytest.raises(SandboxSpecError, match=r"SandboxSpec\.workdir='relative'"):
        sandbox_spec(cfg, {"sandbox": {"workdir": "relative"}}, {})
    with pytest.raises(SandboxSpecError, match=r"metadata\.sandbox=\['x'\]"):
        sandbox_spec(cfg, {"sandbox": ["x"]}, {})


def test_harbor_task_rows_carry_the_tasks_sandbox(tmp_path):
    task = tmp_path / "t1"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("make /app/out.txt\n")
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task / "task.toml").write_text('[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 30.0\n'
                                    '[environment]\nmemory_mb = 768\nallow_internet = false\n')
    (row,) = task_rows(tmp_path)
    spec = sandbox_spec(SandboxConfig(backend="subprocess", network=True), row["metadata"], {})
    assert spec.dockerfile == str(task / "environment" / "Dockerfile") and spec.image is None
    assert (spec.memory_mb, spec.network, spec.ttl_s) == (768, False, 60.0 + 30.0 + 300.0)


def test_an_episode_whose_task_sandbox_is_bad_fails_alone():
    """run_episode gives the sample back `failed`, with the error naming the field, and opens no sandbox."""
    from miles.envs import episode as ep

    class Metrics:
        added = []

        def add(self, stats, samples, extra):
            self.added.extend(samples)

    class Pool:
        def __getattr__(self, name):
            raise AssertionError(f"the pool was used ({name}) for a task whose sandbox is bad")

    recipe = SimpleNamespace(sandbox=SandboxConfig(backend="subprocess"))
    env = SimpleNamespace(pool=Pool(), recipe=recipe, metrics=Metrics())
    sample = Sample(tokens=np.arange(3, dtype=np.int32), rollout_id="r0", prompt="p", label="",
                    metadata={"sandbox": {"cpu": -1.0}})
    (out,) = asyncio.run(ep.run_episode(env, sample, None, generate=None))
    assert out.status == "failed" and "SandboxSpec.cpu=-1.0" in out.metadata["error"]
    assert env.metrics.added == [out]
