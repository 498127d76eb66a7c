"""One episode's sandbox spec: `[sandbox]` defaults, a task's own image (`metadata["image"]`) over
the recipe's, a rootfs only where no image is asked for, and the run's labels on every spec."""

from __future__ import annotations

from miles.envs.context import sandbox_spec
from miles.rl.config import SandboxConfig


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
