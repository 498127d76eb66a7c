"""The `daytona` backend, through the `daytona` SDK's AsyncDaytona (written against daytona 0.226).

Mapping:
    create   AsyncDaytona(DaytonaConfig(api_key, api_url, target)).create(
                 CreateSandboxFromImageParams(image=spec.image | Image.from_dockerfile(path),
                     resources=Resources(cpu, memory GiB, disk GiB), env_vars, labels,
                     network_block_all=not network, ttl_minutes=ceil(ttl_s/60),
                     auto_stop_interval, ephemeral=True), timeout=create_timeout_s)
             or CreateSandboxFromSnapshotParams(snapshot=...) when the backend has `snapshot` and
             the spec names no image; then `mkdir -p workdir` or `get_work_dir()`
    exec     sandbox.process.exec("timeout -k 2 T /bin/sh -c CMD", cwd, env, timeout)
             -> ExecuteResponse(exit_code, result): Daytona returns stdout and stderr merged in
             `result`, so ExecResult.stderr is always empty on this backend
    upload   fs.create_folder(parent) then fs.upload_file(data, path); upload_dir batches with
             fs.upload_files([FileUpload(...)])
    download fs.download_file(path) -> bytes
    destroy  daytona.delete(sandbox)
    sweep    async for sandbox in daytona.list(ListSandboxesQuery(labels=...)): delete

Gotchas honoured (from Miles' Daytona examples): one client per backend, because the SDK owns a
connection pool (closed by Backend.close(), which recent SDKs offer); `ttl_minutes` (wall clock) rather than auto-stop alone, because
auto-stop only counts SDK activity; ephemeral sandboxes are deleted when they stop.

What was exercised here (no network), in tests/sandboxes/test_sandbox_cloud.py:
- the real SDK, unpatched, over HTTP against a stand-in of the Daytona API and toolbox on
  127.0.0.1 (tests/sandboxes/daytona_standin.py: create, get, delete, list by label, execute,
  folder, bulk upload, bulk download, work-dir), with a Harbor task end to end;
- the mapping against the SDK's own parameter models (pydantic validates every field name and
  type we pass) with the AsyncDaytona client patched, every call bound to the real signatures.
Not exercised: a real Daytona deployment (image builds, snapshots, auto-stop, real TTL expiry; the
stand-in answers "started" at once and refuses the socket.io event stream, so the SDK's event
path is not covered).
"""

from __future__ import annotations

import math
import os
import posixpath
import shlex
import time
from typing import Any, Mapping

from miles.sandboxes.base import (Backend, ExecResult, SandboxCreateError, SandboxSpec,
                                  SandboxSpecError, check, sandbox_path)
from miles.sandboxes.cloud import (CloudSandbox, provider_labels, remote_command, require_sdk,
                                   result, sdk_timeout_s)


class DaytonaSandbox(CloudSandbox):
    backend_name = "daytona"

    def __init__(self, backend: Any, handle: Any, spec: SandboxSpec, workdir: str):
        super().__init__(backend, handle, spec, workdir, sandbox_id=handle.id)

    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult:
        b = self.backend
        started = time.monotonic()
        try:
            r = await self.handle.process.exec(
                remote_command(argv, timeout_s, b.kill_after_s), cwd=cwd, env=env or None,
                timeout=sdk_timeout_s(timeout_s, b.kill_after_s))
        except b.timeout_errors as exc:
            return result(None, "", str(exc), started, timeout_s, b.max_output_bytes,
                          timed_out=True)
        return result(r.exit_code, r.result, "", started, timeout_s, b.max_output_bytes)

    async def _upload(self, path: str, data: bytes, mode: int) -> None:
        await self.handle.fs.create_folder(posixpath.dirname(path), "755")
        await self.handle.fs.upload_file(data, path)

    async def upload_dir(self, path: str, files: Mapping[str, bytes]) -> None:
        self._check_live()
        base = sandbox_path(path, self.workdir)
        targets = {sandbox_path(posixpath.join(base, rel), "/"): data
                   for rel, data in files.items()}
        for parent in sorted({posixpath.dirname(t) for t in targets}):
            await self.handle.fs.create_folder(parent, "755")
        upload = self.backend.sdk.FileUpload
        await self.handle.fs.upload_files([upload(data, t) for t, data in targets.items()])

    async def _download(self, path: str) -> bytes:
        try:
            data = await self.handle.fs.download_file(path)
        except self.backend.not_found_errors:
            raise FileNotFoundError(2, "no such file in sandbox", path) from None
        if data is None:
            raise FileNotFoundError(2, "no such file in sandbox", path)
        return bytes(data)

    async def _destroy(self) -> None:
        await self.backend.client().delete(self.handle)


class DaytonaBackend(Backend):
    """Options: api_key, api_url, target, snapshot (default snapshot when a spec has no image),
    auto_stop_interval_min, create_timeout_s, default_timeout_s, max_output_bytes,
    kill_after_s, sdk (the `daytona` module or a stand-in)."""

    name = "daytona"

    def __init__(self, *, api_key: str | None = None, api_url: str | None = None,
                 target: str | None = None, snapshot: str | None = None,
                 auto_stop_interval_min: int = 30, create_timeout_s: float = 180.0,
                 default_timeout_s: float = 600.0, max_output_bytes: int = 1 << 20,
                 kill_after_s: float = 2.0, sdk: Any = None):
        self.sdk = require_sdk("daytona", self.name, sdk)
        self.config = dict(api_key=api_key, api_url=api_url, target=target)
        self.snapshot = snapshot
        self.auto_stop_interval_min = auto_stop_interval_min
        self.create_timeout_s = create_timeout_s
        self.default_timeout_s = default_timeout_s
        self.max_output_bytes = max_output_bytes
        self.kill_after_s = kill_after_s
        self._client = None
        errs = lambda *names: tuple(getattr(self.sdk, n) for n in names  # noqa: E731
                                    if hasattr(self.sdk, n))
        self.timeout_errors = errs("DaytonaProcessExecutionTimeoutError", "DaytonaTimeoutError")
        self.not_found_errors = errs("DaytonaFileNotFoundError", "DaytonaNotFoundError")
        self.retryable_errors = errs("DaytonaRateLimitError", "DaytonaServiceUnavailableError",
                                     "DaytonaBadGatewayError", "DaytonaConnectionError",
                                     "DaytonaConnectionTimeoutError", "DaytonaTimeoutError",
                                     "DaytonaQueueTimeoutError", "DaytonaInternalServerError")

    def client(self):
        if self._client is None:
            cfg = self.sdk.DaytonaConfig(**{k: v for k, v in self.config.items() if v})
            self._client = self.sdk.AsyncDaytona(cfg)
        return self._client

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, self.retryable_errors) or super().is_retryable(exc)

    async def close(self) -> None:
        if self._client is not None and hasattr(self._client, "close"):
            await self._client.close()
        self._client = None

    def params(self, spec: SandboxSpec):
        if spec.rootfs is not None:
            raise SandboxSpecError(f"SandboxSpec.rootfs={spec.rootfs!r} is invalid for backend "
                                   "daytona: give an image or a Dockerfile")
        sdk = self.sdk
        common = dict(
            env_vars=dict(spec.env), labels=provider_labels(spec.labels),
            network_block_all=not spec.network, ttl_minutes=max(1, math.ceil(spec.ttl_s / 60)),
            auto_stop_interval=self.auto_stop_interval_min, ephemeral=True)
        if spec.image is None and spec.dockerfile is None:
            if self.snapshot is None:
                raise SandboxSpecError("SandboxSpec.image=None and dockerfile=None: backend "
                                       "daytona needs an image, a Dockerfile or a snapshot")
            return sdk.CreateSandboxFromSnapshotParams(snapshot=self.snapshot, **common)
        image = spec.image if spec.image is not None else sdk.Image.from_dockerfile(
            os.path.abspath(spec.dockerfile))
        resources = sdk.Resources(cpu=max(1, math.ceil(spec.cpu)),
                                  memory=max(1, math.ceil(spec.memory_mb / 1024)),
                                  disk=max(1, math.ceil(spec.disk_mb / 1024)))
        return sdk.CreateSandboxFromImageParams(image=image, resources=resources, **common)

    async def create(self, spec: SandboxSpec) -> DaytonaSandbox:
        handle = await self.client().create(self.params(spec), timeout=self.create_timeout_s)
        sandbox = DaytonaSandbox(self, handle, spec, workdir=spec.workdir or "/")
        try:
            if spec.workdir:
                r = await sandbox.exec(f"mkdir -p {shlex.quote(spec.workdir)}", cwd="/",
                                       timeout_s=60)
                if not r.ok:
                    raise SandboxCreateError(f"daytona: preparing workdir failed: {r.stdout}")
            else:
                sandbox.workdir = await handle.get_work_dir() or "/"
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def sweep(self, labels: Mapping[str, str]) -> int:
        check(bool(labels), "daytona.sweep(labels)", dict(labels),
              "at least one label (an empty filter would match other runs' sandboxes)")
        query = self.sdk.ListSandboxesQuery(labels=provider_labels(dict(labels)))
        doomed = [sb async for sb in self.client().list(query)]
        for sb in doomed:
            await self.client().delete(sb)
        return len(doomed)
