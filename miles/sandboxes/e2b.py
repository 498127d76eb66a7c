"""The `e2b` backend (E2B cloud) and `agentenv` (kvcache-ai AgentENV, a self-hosted server speaking
the E2B API), both through the `e2b` SDK's AsyncSandbox (written against e2b 2.63).

Mapping:
    create   AsyncSandbox.create(template, timeout=ttl_s, metadata=labels, envs=env,
             allow_internet_access=network, **ApiParams)   then one `mkdir -p workdir`/`pwd` exec
    exec     sandbox.commands.run("timeout -k 2 T /bin/sh -c CMD", envs, cwd, user, timeout)
             (user: the backend's `user` option, or exec's `user=`)
             (a non-zero exit raises CommandExitException, which carries exit_code/stdout/stderr)
    upload   sandbox.files.write(path, data, user)
    download sandbox.files.read(path, format="bytes", user)
    destroy  sandbox.kill()
    sweep    AsyncSandbox.list(query=SandboxQuery(metadata=labels)) pages -> AsyncSandbox.kill(id)
    images   spec.image names an E2B template; spec.dockerfile is built once into a template
             named miles-<hash> with AsyncTemplate.build(Template(file_context_path=ctx)
             .from_dockerfile(path), name=...) unless AsyncTemplate.exists(name)

AgentENV = this backend with `api_url` (and usually `sandbox_url`) pointing at the AgentENV server;
it needs no real key, so a placeholder is sent. e2b 2.63 marks `api_url`/`sandbox_url` deprecated
"for the next major version": pin `e2b<3` for AgentENV until that changes.

What was exercised here (no network), in tests/sandboxes/test_sandbox_cloud.py:
- the real SDK, unpatched, over HTTP/1.1 against a stand-in of the E2B API and envd on 127.0.0.1
  (tests/sandboxes/e2b_standin.py: create, list by metadata, kill, process Start over the Connect
  protocol with the JSON codec, file upload/download), through `agentenv` with
  api_url/sandbox_url, with a Harbor task end to end;
- the mapping with AsyncSandbox/AsyncTemplate patched, every call bound to the real signatures
  (including the Dockerfile -> template build, which the stand-in does not implement).
Not exercised: a real E2B or AgentENV server (HTTP/2, template builds, TTL expiry, pause/resume).
"""

from __future__ import annotations

import math
import os
import shlex
import time
from typing import Any, Mapping

from miles.sandboxes.base import (Backend, ExecResult, SandboxCreateError,
                                  SandboxSpec, SandboxSpecError, check)
from miles.sandboxes.cloud import (CloudSandbox, provider_labels, remote_command, require_sdk,
                                   result, sdk_timeout_s)


class E2BSandbox(CloudSandbox):
    backend_name = "e2b"

    def __init__(self, backend: Any, handle: Any, spec: SandboxSpec, workdir: str):
        super().__init__(backend, handle, spec, workdir, sandbox_id=handle.sandbox_id)

    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult:
        return await self._run(argv, cwd, env, timeout_s, self.backend.user)

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        return await self._run(argv, cwd, env, timeout_s, user)

    async def _run(self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float,
                   user: str | None) -> ExecResult:
        b = self.backend
        started = time.monotonic()
        try:
            r = await self.handle.commands.run(
                remote_command(argv, timeout_s, b.kill_after_s), envs=env or None, cwd=cwd,
                user=user, timeout=sdk_timeout_s(timeout_s, b.kill_after_s),
                request_timeout=b.request_timeout_s)
        except b.sdk.CommandExitException as exc:
            return result(exc.exit_code, exc.stdout, exc.stderr, started, timeout_s,
                          b.max_output_bytes)
        except b.sdk.TimeoutException as exc:
            return result(None, "", str(exc), started, timeout_s, b.max_output_bytes,
                          timed_out=True)
        return result(r.exit_code, r.stdout, r.stderr, started, timeout_s, b.max_output_bytes)

    async def _upload(self, path: str, data: bytes, mode: int) -> None:
        await self.handle.files.write(path, data, user=self.backend.user)

    async def _download(self, path: str) -> bytes:
        try:
            data = await self.handle.files.read(path, format="bytes", user=self.backend.user)
        except self.backend.sdk.FileNotFoundException:
            raise FileNotFoundError(2, "no such file in sandbox", path) from None
        return bytes(data)

    async def _destroy(self) -> None:
        await self.handle.kill()


class E2BBackend(Backend):
    """Options: template (default template name), api_key, api_url, sandbox_url, domain,
    request_timeout_s, http_version ("1.1" or "2"), user (command/file user, default root),
    default_timeout_s, max_output_bytes, kill_after_s, sdk (the `e2b` module or a stand-in)."""

    name = "e2b"

    def __init__(self, *, template: str | None = None, api_key: str | None = None,
                 api_url: str | None = None, sandbox_url: str | None = None,
                 domain: str | None = None, request_timeout_s: float = 60.0,
                 http_version: str | None = None, user: str | None = "root",
                 default_timeout_s: float = 600.0, max_output_bytes: int = 1 << 20,
                 kill_after_s: float = 2.0, sdk: Any = None):
        self.sdk = require_sdk("e2b", self.name, sdk)
        self.template = template
        self.user = user
        self.request_timeout_s = request_timeout_s
        self.default_timeout_s = default_timeout_s
        self.max_output_bytes = max_output_bytes
        self.kill_after_s = kill_after_s
        self.api_params = {k: v for k, v in dict(
            api_key=api_key, api_url=api_url, sandbox_url=sandbox_url, domain=domain,
            request_timeout=request_timeout_s, http_version=http_version).items()
            if v is not None}
        self._templates: dict[str, str] = {}

    def is_retryable(self, exc: BaseException) -> bool:
        retryable = tuple(getattr(self.sdk, n) for n in (
            "RateLimitException", "TimeoutException", "ServiceBusyException",
            "SandboxUnreachableException") if hasattr(self.sdk, n))
        return isinstance(exc, retryable) or super().is_retryable(exc)

    async def _template_for(self, spec: SandboxSpec) -> str | None:
        if spec.rootfs is not None:
            raise SandboxSpecError(f"SandboxSpec.rootfs={spec.rootfs!r} is invalid for backend "
                                   f"{self.name}: give an image (template) or a Dockerfile")
        if spec.image is not None:
            return spec.image
        if spec.dockerfile is None:
            return self.template
        path = os.path.abspath(spec.dockerfile)
        if path not in self._templates:
            from miles.sandboxes.rootfs import template_key
            name = f"miles-{template_key(self.name, path)[:20]}"
            if not await self.sdk.AsyncTemplate.exists(name, **self.api_params):
                builder = self.sdk.Template(file_context_path=os.path.dirname(path))
                await self.sdk.AsyncTemplate.build(
                    builder.from_dockerfile(path), name=name,
                    cpu_count=max(1, math.ceil(spec.cpu)), memory_mb=spec.memory_mb,
                    **self.api_params)
            self._templates[path] = name
        return self._templates[path]

    async def create(self, spec: SandboxSpec) -> E2BSandbox:
        template = await self._template_for(spec)
        kwargs: dict[str, Any] = dict(
            timeout=int(math.ceil(spec.ttl_s)), metadata=provider_labels(spec.labels),
            envs=dict(spec.env), allow_internet_access=spec.network, **self.api_params)
        if template is not None:
            kwargs["template"] = template
        handle = await self.sdk.AsyncSandbox.create(**kwargs)
        sandbox = E2BSandbox(self, handle, spec, workdir=spec.workdir or "/")
        try:
            probe = (f"mkdir -p {shlex.quote(spec.workdir)} && cd {shlex.quote(spec.workdir)} "
                     "&& pwd") if spec.workdir else "pwd"
            r = await sandbox.exec(probe, cwd="/", timeout_s=60)
            if not r.ok:
                raise SandboxCreateError(f"{self.name}: preparing workdir failed: {r.stderr}")
            sandbox.workdir = r.stdout.strip() or "/"
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def sweep(self, labels: Mapping[str, str]) -> int:
        check(bool(labels), f"{self.name}.sweep(labels)", dict(labels),
              "at least one label (an empty filter would match other runs' sandboxes)")
        query = self.sdk.SandboxQuery(metadata=provider_labels(dict(labels)))
        paginator = self.sdk.AsyncSandbox.list(query=query, **self.api_params)
        n = 0
        while paginator.has_next:
            for info in await paginator.next_items():
                n += bool(await self.sdk.AsyncSandbox.kill(info.sandbox_id, **self.api_params))
        return n


class AgentEnvBackend(E2BBackend):
    """AgentENV: `api_url` is required; `sandbox_url` when sandboxes are reached through one
    proxy address; the API key is a placeholder (AgentENV has no authorization)."""

    name = "agentenv"

    def __init__(self, *, api_url: str | None = None, api_key: str | None = None,
                 http_version: str | None = "1.1", **opts: Any):
        api_url = api_url or os.environ.get("AGENTENV_API_URL")
        check(bool(api_url), "agentenv.api_url", api_url,
              "the AgentENV server's URL (option api_url or $AGENTENV_API_URL)")
        super().__init__(api_url=api_url, api_key=api_key or "e2b_" + "0" * 40,
                         http_version=http_version, **opts)

