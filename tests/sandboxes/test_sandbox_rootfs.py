"""Root templates on the host backends: a plain `rootfs=` directory overlays the sandbox root, and
a full root (its own /usr) replaces the host's system directories."""

from __future__ import annotations

import os

import pytest

from miles.sandboxes.base import SandboxSpec
from miles.sandboxes.baseimage import write_rootfs
from sandbox_helpers import needs_jail

pytestmark = pytest.mark.timeout(60)


async def test_rootfs_directory_is_copied_into_each_sandbox(host_backend, tmp_path):
    needs_jail(host_backend)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "data.txt").write_text("from the template")
    spec = SandboxSpec(rootfs=str(tmp_path), workdir="/app")
    async with await host_backend.create(spec) as a, await host_backend.create(spec) as b:
        assert (await a.exec("cat data.txt && echo changed > data.txt")).stdout == \
            "from the template"
        assert (await b.exec("cat data.txt")).stdout == "from the template"  # a copy each
    assert (tmp_path / "app" / "data.txt").read_text() == "from the template"


async def test_full_root_replaces_the_host_system(host_backend, base_dir):
    needs_jail(host_backend)
    root = write_rootfs(os.path.join(base_dir, "fullroot"), include_python=False)
    os.chmod(os.path.dirname(root), 0o711)
    async with await host_backend.create(SandboxSpec(rootfs=root)) as sb:
        r = await sb.exec("echo hi from $(readlink -f /bin/sh); "
                          "test -e /usr/bin/python3 || echo no python here")
    assert r.ok, r
    assert r.stdout.startswith("hi from /usr/bin/") and "no python here" in r.stdout
