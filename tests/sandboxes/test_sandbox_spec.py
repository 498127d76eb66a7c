"""The contract's boundary: SandboxSpec validation names the field and the value, the registry
names the accepted backends and options, and a user backend plugs in by import path."""

from __future__ import annotations

import pytest

from miles.sandboxes import (SandboxSpec, SandboxSpecError, backend_names, get_backend,
                             register_backend)
from miles.sandboxes.base import sandbox_path


@pytest.mark.parametrize("fields, match", [
    (dict(cpu=0), r"SandboxSpec.cpu=0 is invalid"),
    (dict(memory_mb=8), r"SandboxSpec.memory_mb=8 is invalid.*MiB"),
    (dict(disk_mb=0), r"SandboxSpec.disk_mb=0"),
    (dict(max_processes=2), r"SandboxSpec.max_processes=2"),
    (dict(ttl_s=float("inf")), r"SandboxSpec.ttl_s=inf"),
    (dict(workdir="relative/dir"), r"SandboxSpec.workdir='relative/dir'"),
    (dict(workdir="/a/../b"), r"SandboxSpec.workdir='/a/../b'"),
    (dict(labels={"Bad Key": "v"}), r"SandboxSpec.labels\['Bad Key'\]"),
    (dict(labels={"ok": "a=b"}), r"SandboxSpec.labels\['ok'\]='a=b'"),
    (dict(env={"1X": "v"}), r"SandboxSpec.env\['1X'\]"),
    (dict(image="img", rootfs="/r"), r"SandboxSpec.image/rootfs"),
    (dict(image="  "), r"SandboxSpec.image='  '"),
])
def test_bad_specs_name_field_and_value(fields, match):
    with pytest.raises(SandboxSpecError, match=match):
        SandboxSpec(**fields)


def test_spec_from_plain_data():
    spec = SandboxSpec.from_dict({"image": "python:3.11", "memory_mb": 2048,
                                  "labels": {"miles.run": "r"}})
    assert (spec.image, spec.memory_mb, spec.network, spec.workdir) == ("python:3.11", 2048,
                                                                        False, None)
    with pytest.raises(SandboxSpecError, match=r"memory_mb"):
        SandboxSpec.from_dict({"memory_mb": "lots"})
    with pytest.raises(SandboxSpecError, match=r"gpus"):
        SandboxSpec.from_dict({"gpus": 1})
    assert spec.with_labels({"x": "1"}).labels == {"miles.run": "r", "x": "1"}


def test_sandbox_paths():
    assert sandbox_path("a/b", "/app") == "/app/a/b"
    assert sandbox_path("/x/./y/../z", "/app") == "/x/z"
    with pytest.raises(SandboxSpecError, match=r"path='/\.\./etc'"):
        sandbox_path("/../etc", "/app")


def test_registry_errors_list_the_choices():
    assert {"subprocess", "bwrap", "docker", "daytona", "e2b", "agentenv",
            "modal"} <= set(backend_names())
    with pytest.raises(SandboxSpecError, match=r"'firecracker' is unknown: expected one of"):
        get_backend("firecracker")
    with pytest.raises(SandboxSpecError, match=r"unknown option\(s\) \['colour'\].*base_dir"):
        get_backend("subprocess", colour="red")
    with pytest.raises(SandboxSpecError, match=r"unknown option\(s\) \['templat'\].*template"):
        get_backend("agentenv", api_url="http://127.0.0.1:1", templat="x")


def test_user_backend_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_sandbox.py").write_text(
        "from miles.sandboxes.local import SubprocessBackend\n"
        "class Mine(SubprocessBackend):\n"
        "    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("mine", "my_sandbox:Mine")
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="miles-sbx-test-mine-", dir=tempfile.gettempdir())
    try:
        backend = get_backend("mine", base_dir=base)
        assert type(backend).__name__ == "Mine"
    finally:
        from miles.sandboxes import registry
        registry._BACKENDS.pop("mine", None)
        shutil.rmtree(base, ignore_errors=True)
    with pytest.raises(SandboxSpecError, match="package.module:ClassName"):
        register_backend("bad", "no_colon_here")
