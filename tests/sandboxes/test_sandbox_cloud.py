"""Cloud backends (e2b/agentenv, daytona, modal) with the SDKs' network-facing objects patched.

The providers cannot be reached from here. Each test hands the backend the real SDK module with
only the client entry points replaced by recorders that (a) check every call binds to the real
SDK method's signature and that parameter objects are the SDK's own (pydantic) models, and
(b) carry the commands out in a local subprocess sandbox with the SDK's semantics (E2B raises
CommandExitException on non-zero exit, Daytona merges stdout and stderr, ...). So the mapping
from our contract to SDK calls is checked, and a Harbor task runs through each backend end to end.
"""

from __future__ import annotations

import inspect
import os
import shlex
import types

import pytest

from miles.sandboxes.base import BackendUnavailableError, SandboxSpec, SandboxSpecError
from miles.sandboxes.harbor import load_task, run_verifier, task_spec
from miles.sandboxes.registry import get_backend
from sandbox_helpers import make_host_backend

pytestmark = pytest.mark.timeout(60)
TASKS = os.path.join(os.path.dirname(__file__), "tasks")


def bound(real, *args, **kwargs) -> None:
    """Fail unless the call would bind to the real SDK function's signature."""
    inspect.signature(real).bind(*args, **kwargs)


@pytest.fixture
def engine(base_dir):
    """The local sandbox that carries out the cloud calls: subprocess (a chroot) as root, bwrap
    otherwise; both show the absolute paths a cloud sandbox would."""
    backend = make_host_backend("subprocess" if os.geteuid() == 0 else "bwrap", base_dir)
    yield backend
    backend.spawner.close()


async def run_task_through(backend) -> list:
    task = load_task(os.path.join(TASKS, "hello-sum"))
    spec = task_spec(task).replace(dockerfile=None, image="task-image", workdir="/app")
    out = []
    for answer in ("read -r a b < input.txt && echo $((a + b)) > answer.txt", "echo 1 > answer.txt"):
        async with await backend.create(spec) as sb:
            await sb.upload("/app/input.txt", b"17 25\n")
            await sb.exec("mkdir -p data && echo seed > data/seed.txt")
            await sb.exec(answer, env={"TASK_NAME": "hello-sum"})
            out.append(await run_verifier(sb, task.__class__(
                **{**{f: getattr(task, f) for f in task.__struct_fields__},
                   "verifier_env": {**task.verifier_env, "TASK_NAME": "hello-sum"}})))
    return out


# E2B / AgentENV ----------------------------------------------------------------------------------

def fake_e2b(engine):
    e2b = pytest.importorskip("e2b")
    from e2b.sandbox_async.commands.command import Commands
    from e2b.sandbox_async.filesystem.filesystem import Filesystem
    from e2b.sandbox_async.sandbox_api import SandboxApi
    calls: list[tuple[str, dict]] = []
    live: dict[str, object] = {}

    class Handle:
        def __init__(self, inner, metadata):
            self.sandbox_id, self.inner, self.metadata = inner.id, inner, metadata
            self.commands = types.SimpleNamespace(run=self.run)
            self.files = types.SimpleNamespace(write=self.write, read=self.read)

        async def run(self, cmd, **kw):
            bound(Commands.run, None, cmd, **kw)
            calls.append(("run", {"cmd": cmd, **kw}))
            r = await self.inner.exec(["/bin/bash", "-c", cmd], cwd=kw.get("cwd"),
                                      env=kw.get("envs") or {}, timeout_s=kw["timeout"])
            if r.exit_code != 0:
                raise e2b.CommandExitException(stderr=r.stderr, stdout=r.stdout,
                                               exit_code=r.exit_code, error=None)
            return types.SimpleNamespace(exit_code=0, stdout=r.stdout, stderr=r.stderr)

        async def write(self, path, data, **kw):
            bound(Filesystem.write, None, path, data, **kw)
            await self.inner.upload(path, data)

        async def read(self, path, **kw):
            bound(Filesystem.read, None, path, **kw)
            assert kw["format"] == "bytes"
            try:
                return bytearray(await self.inner.download(path))
            except FileNotFoundError:
                raise e2b.FileNotFoundException(f"{path} not found") from None

        async def kill(self, **kw):
            calls.append(("kill", {"id": self.sandbox_id}))
            live.pop(self.sandbox_id, None)
            await self.inner.destroy()
            return True

    class AsyncSandbox:
        @staticmethod
        async def create(**kw):
            bound(e2b.AsyncSandbox.create, **kw)
            calls.append(("create", kw))
            inner = await engine.create(SandboxSpec(ttl_s=kw["timeout"], env=kw["envs"]))
            live[inner.id] = handle = Handle(inner, kw["metadata"])
            return handle

        @staticmethod
        def list(query=None, **kw):
            bound(e2b.AsyncSandbox.list, query=query, **kw)
            hits = [h for h in live.values()
                    if all(h.metadata.get(k) == v for k, v in query.metadata.items())]
            pages = [[types.SimpleNamespace(sandbox_id=h.sandbox_id) for h in hits]]

            class Pages:
                has_next = True

                async def next_items(self):
                    Pages.has_next = False
                    return pages[0]
            return Pages()

        @staticmethod
        async def kill(sandbox_id, **kw):
            bound(SandboxApi._cls_kill, sandbox_id, **kw)
            return await live[sandbox_id].kill()

    class AsyncTemplate:
        @staticmethod
        async def exists(name, **kw):
            bound(e2b.AsyncTemplate.exists, name, **kw)
            return False

        @staticmethod
        async def build(template, **kw):
            bound(e2b.AsyncTemplate.build, template, **kw)
            calls.append(("build", {"template": template, **kw}))

    sdk = types.SimpleNamespace(**{n: getattr(e2b, n) for n in dir(e2b) if n[0].isupper()})
    sdk.AsyncSandbox, sdk.AsyncTemplate = AsyncSandbox, AsyncTemplate
    return sdk, calls


async def test_e2b_mapping_and_harbor_task(engine):
    sdk, calls = fake_e2b(engine)
    backend = get_backend("e2b", sdk=sdk, api_key="k", request_timeout_s=30)
    spec = SandboxSpec(image="my-template", ttl_s=300, env={"A": "1"}, workdir="/app",
                       labels={"miles.run": "r1"}, network=False)
    async with await backend.create(spec) as sb:
        assert sb.workdir == "/app"
        r = await sb.exec("echo $A $B; echo err >&2; exit 3", env={"B": "2"}, timeout_s=20)
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "1 2\n", "err\n", False)
        slow = await sb.exec("sleep 5", timeout_s=0.5)
        assert slow.timed_out and slow.exit_code == 124
        await sb.upload("notes/x.txt", b"hi")
        assert await sb.download("/app/notes/x.txt") == b"hi"
        with pytest.raises(FileNotFoundError):
            await sb.download("/missing")
    create = next(kw for name, kw in calls if name == "create")
    assert create["template"] == "my-template" and create["timeout"] == 300
    assert create["metadata"] == {"miles.sandbox": "1", "miles.run": "r1"}
    assert create["allow_internet_access"] is False and create["envs"] == {"A": "1"}
    assert create["api_key"] == "k" and create["request_timeout"] == 30
    run = [kw for name, kw in calls if name == "run"][1]
    assert run["cmd"].startswith("timeout -k 2 20.000 /bin/sh -c") and run["user"] == "root"
    assert run["timeout"] > 20 and run["cwd"] == "/app" and run["envs"] == {"B": "2"}
    assert ("kill", {"id": sb.id}) in calls

    leftover = await backend.create(spec)
    assert await backend.sweep({"miles.run": "r1"}) == 1 and leftover.handle.sandbox_id
    results = await run_task_through(backend)
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 0.0)]


async def test_e2b_dockerfile_becomes_a_template(engine):
    sdk, calls = fake_e2b(engine)
    backend = get_backend("e2b", sdk=sdk)
    task = load_task(os.path.join(TASKS, "hello-sum"))
    async with await backend.create(task_spec(task)):
        pass
    build = next(kw for name, kw in calls if name == "build")
    assert build["name"].startswith("miles-") and build["memory_mb"] == 512
    assert next(kw for name, kw in calls if name == "create")["template"] == build["name"]


async def test_agentenv_is_e2b_with_its_own_url(engine):
    sdk, calls = fake_e2b(engine)
    with pytest.raises(SandboxSpecError, match="agentenv.api_url"):
        get_backend("agentenv", sdk=sdk)
    backend = get_backend("agentenv", sdk=sdk, api_url="http://127.0.0.1:3000",
                          sandbox_url="http://127.0.0.1:49983")
    async with await backend.create(SandboxSpec(image="tb2-task", ttl_s=60)) as sb:
        assert (await sb.exec("echo ok")).stdout == "ok\n"
    create = next(kw for name, kw in calls if name == "create")
    assert create["api_url"] == "http://127.0.0.1:3000"
    assert create["sandbox_url"] == "http://127.0.0.1:49983" and create["http_version"] == "1.1"


async def test_agentenv_real_sdk_against_a_local_standin(engine):
    """The real e2b SDK, unpatched, over HTTP to a stand-in of the E2B API and envd on 127.0.0.1
    (api_url/sandbox_url overrides, HTTP/1.1): the AgentENV deployment shape."""
    pytest.importorskip("e2b")
    from e2b_standin import E2BStandIn
    standin = E2BStandIn(engine)
    url = await standin.start()
    try:
        backend = get_backend("agentenv", api_url=url, sandbox_url=url, request_timeout_s=20)
        spec = SandboxSpec(image="tb2-task", workdir="/app", env={"A": "1"},
                           labels={"miles.run": "r4"})
        async with await backend.create(spec) as sb:
            r = await sb.exec("echo $A $B; echo err >&2; exit 3", env={"B": "2"})
            assert (r.exit_code, r.stdout, r.stderr) == (3, "1 2\n", "err\n")
            assert (await sb.exec("sleep 5", timeout_s=0.5)).timed_out
            await sb.upload("/app/f.txt", b"data")
            assert await sb.download("f.txt") == b"data"
            with pytest.raises(FileNotFoundError):
                await sb.download("/nope")
        assert sb.id not in standin.sandboxes  # destroyed through DELETE /sandboxes/{id}
        await backend.create(spec)
        assert await backend.sweep({"miles.run": "r4"}) == 1
        results = await run_task_through(backend)
        assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 0.0)]
        assert {("POST", "/v2/sandboxes"), ("DELETE", "/sandboxes/" + sb.id),
                ("POST", "/process.Process/Start"), ("POST", "/files"), ("GET", "/files"),
                ("GET", "/v2/sandboxes")} <= set(standin.requests)
        assert standin.unhandled == []
    finally:
        await standin.stop()


# Daytona -----------------------------------------------------------------------------------------

def fake_daytona(engine):
    daytona = pytest.importorskip("daytona")
    from daytona._async.filesystem import AsyncFileSystem
    from daytona._async.process import AsyncProcess
    calls: list[tuple[str, object]] = []
    live: dict[str, object] = {}

    class Handle:
        def __init__(self, inner, labels):
            self.id, self.inner, self.labels = inner.id, inner, labels
            self.process = types.SimpleNamespace(exec=self.exec)
            self.fs = types.SimpleNamespace(create_folder=self.create_folder,
                                            upload_file=self.upload_file,
                                            upload_files=self.upload_files,
                                            download_file=self.download_file)

        async def exec(self, command, **kw):
            bound(AsyncProcess.exec, None, command, **kw)
            calls.append(("exec", {"command": command, **kw}))
            r = await self.inner.exec(["/bin/sh", "-c", command], cwd=kw.get("cwd"),
                                      env=kw.get("env") or {}, timeout_s=kw["timeout"])
            return daytona.ExecuteResponse(exit_code=r.exit_code, result=r.stdout + r.stderr)

        async def create_folder(self, path, mode, **kw):
            bound(AsyncFileSystem.create_folder, None, path, mode, **kw)
            await self.inner.exec(["mkdir", "-p", path])

        async def upload_file(self, src, dst, **kw):
            bound(AsyncFileSystem.upload_file, None, src, dst, **kw)
            await self.inner.upload(dst, src)

        async def upload_files(self, files, **kw):
            bound(AsyncFileSystem.upload_files, None, files, **kw)
            for f in files:
                assert isinstance(f, daytona.FileUpload)
                await self.inner.upload(f.destination, f.source)

        async def download_file(self, path):
            try:
                return await self.inner.download(path)
            except FileNotFoundError:
                raise daytona.DaytonaNotFoundError(f"{path} not found") from None

        async def get_work_dir(self):
            return "/home/daytona"

    class AsyncDaytona:
        def __init__(self, config):
            assert isinstance(config, daytona.DaytonaConfig)
            calls.append(("client", config))

        async def create(self, params, **kw):
            bound(daytona.AsyncDaytona.create, None, params, **kw)
            assert isinstance(params, (daytona.CreateSandboxFromImageParams,
                                       daytona.CreateSandboxFromSnapshotParams))
            calls.append(("create", params))
            inner = await engine.create(SandboxSpec(ttl_s=params.ttl_minutes * 60,
                                                    env=params.env_vars))
            live[inner.id] = handle = Handle(inner, params.labels)
            return handle

        async def delete(self, sandbox, **kw):
            bound(daytona.AsyncDaytona.delete, None, sandbox, **kw)
            calls.append(("delete", sandbox.id))
            live.pop(sandbox.id, None)
            await sandbox.inner.destroy()

        async def list(self, query=None, **kw):
            bound(daytona.AsyncDaytona.list, None, query, **kw)
            for h in list(live.values()):
                if all(h.labels.get(k) == v for k, v in query.labels.items()):
                    yield h

    sdk = types.SimpleNamespace(**{n: getattr(daytona, n) for n in dir(daytona)
                                   if n[0].isupper()})
    sdk.AsyncDaytona = AsyncDaytona
    return sdk, calls


async def test_daytona_mapping_and_harbor_task(engine):
    sdk, calls = fake_daytona(engine)
    backend = get_backend("daytona", sdk=sdk, api_key="k", api_url="http://127.0.0.1:1")
    spec = SandboxSpec(image="debian:bookworm-slim", ttl_s=600, cpu=1.5, memory_mb=1536,
                       disk_mb=3000, workdir="/project", labels={"miles.run": "r2"})
    async with await backend.create(spec) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 2")
        assert (r.exit_code, r.stdout, r.stderr) == (2, "out\nerr\n", "")  # merged by Daytona
        await sb.upload_dir("/tests", {"test.sh": b"echo hi", "lib/a.py": b"x = 1"})
        assert await sb.download("/tests/lib/a.py") == b"x = 1"
        with pytest.raises(FileNotFoundError):
            await sb.download("/nope")
    params = next(p for name, p in calls if name == "create")
    assert params.image == "debian:bookworm-slim" and params.ttl_minutes == 10
    assert (params.resources.cpu, params.resources.memory, params.resources.disk) == (2, 2, 3)
    assert params.network_block_all is True and params.ephemeral is True
    assert params.labels == {"miles.sandbox": "1", "miles.run": "r2"}
    assert next(c for name, c in calls if name == "client").api_url == "http://127.0.0.1:1"
    assert [p for name, p in calls if name == "exec"][1]["command"].startswith("timeout -k 2 ")

    async with await backend.create(SandboxSpec(image="img")) as sb:
        assert sb.workdir == "/home/daytona"  # from get_work_dir(), no workdir in the spec
    dockerfile = load_task(os.path.join(TASKS, "hello-sum")).dockerfile
    assert isinstance(backend.params(SandboxSpec(dockerfile=dockerfile)).image, sdk.Image)
    await backend.create(spec)
    assert await backend.sweep({"miles.run": "r2"}) == 1
    results = await run_task_through(backend)
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 0.0)]


async def test_daytona_real_sdk_against_a_local_standin(engine):
    """The real daytona SDK, unpatched, over HTTP to a stand-in of the Daytona API and toolbox."""
    pytest.importorskip("daytona")
    from daytona_standin import DaytonaStandIn
    standin = DaytonaStandIn(engine)
    url = await standin.start()
    backend = get_backend("daytona", api_key="k", api_url=url, create_timeout_s=20)
    try:
        spec = SandboxSpec(image="debian:bookworm-slim", workdir="/app", env={"A": "1"},
                           labels={"miles.run": "r5"})
        async with await backend.create(spec) as sb:
            r = await sb.exec("echo $A $B; echo err >&2; exit 3", env={"B": "2"})
            assert (r.exit_code, r.stdout, r.stderr) == (3, "1 2\nerr\n", "")
            assert (await sb.exec("sleep 5", timeout_s=0.5)).timed_out
            await sb.upload_dir("/tests", {"test.sh": b"echo hi", "d/x.txt": b"x"})
            assert await sb.download("/tests/d/x.txt") == b"x"
            with pytest.raises(FileNotFoundError):
                await sb.download("/nope")
        assert sb.id not in standin.sandboxes
        body = json_of_create(standin)
        assert {"miles.sandbox": "1", "miles.run": "r5"}.items() <= body["labels"].items()
        assert body["networkBlockAll"] is True and body["env"] == {"A": "1"}
        await backend.create(spec)
        assert await backend.sweep({"miles.run": "r5"}) == 1
        results = await run_task_through(backend)
        assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 0.0)]
        # Only the SDK's socket.io event stream is refused (it falls back to polling).
        assert {path for _, path in standin.unhandled} <= {"/socket.io/"}
    finally:
        await backend.close()
        await standin.stop()


def json_of_create(standin) -> dict:
    return standin.created[0]


# Modal -------------------------------------------------------------------------------------------

def aio(fn):
    return types.SimpleNamespace(aio=fn)


def fake_modal(engine):
    modal = pytest.importorskip("modal")
    from modal.sandbox._filesystem import _SandboxFilesystem
    calls: list[tuple[str, object]] = []
    live: dict[str, object] = {}

    class Handle:
        def __init__(self, inner, tags):
            self.object_id, self.inner, self.tags = inner.id, inner, tags
            self.exec = aio(self._exec)
            self.terminate = aio(self._terminate)
            self.filesystem = types.SimpleNamespace(
                make_directory=aio(self._mkdir), write_bytes=aio(self._write),
                read_bytes=aio(self._read))

        async def _exec(self, *args, **kw):
            bound(modal.Sandbox.exec, None, *args, **kw)
            calls.append(("exec", (args, kw)))
            r = await self.inner.exec(list(args), cwd=kw.get("workdir"),
                                      env=kw.get("env") or {}, timeout_s=kw["timeout"])
            return types.SimpleNamespace(
                stdout=types.SimpleNamespace(read=aio(_const(r.stdout))),
                stderr=types.SimpleNamespace(read=aio(_const(r.stderr))),
                wait=aio(_const(r.exit_code)))

        async def _mkdir(self, path, **kw):
            bound(_SandboxFilesystem.make_directory, None, path, **kw)
            await self.inner.exec(["mkdir", "-p", path])

        async def _write(self, data, path):
            bound(_SandboxFilesystem.write_bytes, None, data, path)
            await self.inner.upload(path, data)

        async def _read(self, path):
            try:
                return await self.inner.download(path)
            except FileNotFoundError:
                raise modal.exception.SandboxFilesystemNotFoundError(path) from None

        async def _terminate(self, **kw):
            calls.append(("terminate", self.object_id))
            live.pop(self.object_id, None)
            await self.inner.destroy()

    async def create(*args, **kw):
        bound(modal.Sandbox.create, *args, **kw)
        calls.append(("create", (args, kw)))
        inner = await engine.create(SandboxSpec(ttl_s=kw["timeout"], env=kw["env"] or {}))
        live[inner.id] = handle = Handle(inner, kw["tags"])
        return handle

    async def list_(**kw):
        bound(modal.Sandbox.list, **kw)
        for h in list(live.values()):
            if all(h.tags.get(k) == v for k, v in kw["tags"].items()):
                yield h

    async def lookup(name, **kw):
        bound(modal.App.lookup, name, **kw)
        calls.append(("lookup", (name, kw)))
        return types.SimpleNamespace(app_id="ap-123")

    sdk = types.SimpleNamespace(
        App=types.SimpleNamespace(lookup=aio(lookup)), Image=modal.Image,
        Sandbox=types.SimpleNamespace(create=aio(create), list=aio(list_)),
        exception=modal.exception)
    return sdk, calls


def _const(value):
    async def get(*_a, **_k):
        return value
    return get


async def test_modal_mapping_and_harbor_task(engine):
    sdk, calls = fake_modal(engine)
    backend = get_backend("modal", sdk=sdk, app_name="miles-test", runtime="gvisor")
    spec = SandboxSpec(image="python:3.11-slim", ttl_s=900, cpu=2, memory_mb=2048,
                       workdir="/repo", labels={"miles.run": "r3"})
    async with await backend.create(spec) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 5")
        assert (r.exit_code, r.stdout, r.stderr) == (5, "out\n", "err\n")
        await sb.upload("/repo/a/b.txt", b"data")
        assert await sb.download("a/b.txt") == b"data"
        with pytest.raises(FileNotFoundError):
            await sb.download("/nope")
    args, kw = next(v for name, v in calls if name == "create")
    assert args == ("sleep", "infinity") and kw["timeout"] == 900 and kw["block_network"]
    assert (kw["cpu"], kw["memory"], kw["workdir"], kw["runtime"]) == (2.0, 2048, "/repo",
                                                                       "gvisor")
    assert kw["tags"] == {"miles.sandbox": "1", "miles.run": "r3"}
    assert isinstance(kw["image"], sdk.Image)
    exec_args, exec_kw = [v for name, v in calls if name == "exec"][1]
    assert exec_args[:3] == ("timeout", "-k", "2") and exec_kw["workdir"] == "/repo"
    await backend.create(spec)
    assert await backend.sweep({"miles.run": "r3"}) == 1
    results = await run_task_through(backend)
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 0.0)]


# Without the SDKs ----------------------------------------------------------------------------------

def test_missing_sdk_is_a_clear_error(monkeypatch):
    import sys
    for name in ("e2b", "daytona", "modal"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
        with pytest.raises(BackendUnavailableError, match=r"pip install 'miles\[cloud\]'"):
            get_backend(name)


async def test_exec_as_a_user(engine):
    """`exec(user=)`: E2B's own per-command user; Daytona (and Modal) through su, as Harbor's
    environments for them do (a uid is resolved to its name inside: su takes names only)."""
    sdk, calls = fake_e2b(engine)
    async with await get_backend("e2b", sdk=sdk).create(SandboxSpec(image="t", ttl_s=60)) as sb:
        await sb.exec("true", user="agent")
    assert [kw["user"] for name, kw in calls if name == "run"][-1] == "agent"
    sdk, calls = fake_daytona(engine)
    backend = get_backend("daytona", sdk=sdk, api_key="k", api_url="http://127.0.0.1:1")
    async with await backend.create(SandboxSpec(image="img", ttl_s=60)) as sb:
        await sb.exec("echo hi", user="agent")
        await sb.exec("echo hi", user="1000")
    by_name, by_uid = [shlex.split(kw["command"])[4:] for name, kw in calls if name == "exec"][-2:]
    assert by_name == ["su", "agent", "-s", "/bin/sh", "-c", "/bin/sh -c 'echo hi'"]
    assert 'getent passwd "$1"' in by_uid[2]
    assert by_uid[3:] == ["sh", "1000", "/bin/sh -c 'echo hi'"]
