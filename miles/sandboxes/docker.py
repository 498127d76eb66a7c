"""The `docker` backend: one container per sandbox, driven over the Engine API (docker_api.py).

create  = `docker run -d` of the image with `sleep <ttl_s>` as its only process (under docker's
          init), `--network none` unless `network=True`, memory = memory-swap = memory_mb, cpus,
          pids-limit = max_processes, fsize ulimit = disk_mb, no-new-privileges, AutoRemove, and
          labels `miles.sandbox=1`, `miles.deadline=<epoch>`, `miles.label.<key>=<value>`.
exec    = Engine exec of `timeout -k 2 T /bin/sh -c CMD`. The timeout must run inside: killing a
          `docker exec` client leaves its command running in the container (verified by hand).
          `exec(user=)` is the exec's User (`docker exec --user`: a name or uid of the image).
upload  = PUT archive (one tar), download = GET archive.
destroy = force remove.

Design decisions:
- TTL: the container's main process is `sleep ttl_s`; when it ends the container stops and docker
  removes it (AutoRemove), controller or not. sweep() removes by label, and anything past its
  `miles.deadline` label.
- Images: `spec.image` must exist locally (nothing is pulled: this backend runs where registries
  are unreachable). `spec.dockerfile` is built with the daemon's builder, cached by a hash of the
  Dockerfile and its context. A FROM image that is not present is rewritten through
  `base_image_map` ({"debian:bookworm-slim": "..."}) or else `fallback_base_image`; with
  `fallback_base_image="host"` the backend imports an image made from host binaries
  (baseimage.py) and uses that.
- `disk_mb` is enforced per file (RLIMIT_FSIZE through --ulimit fsize); a per-container size quota
  needs overlay2 on xfs with pquota, which is not assumed.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import posixpath
import tarfile
import time
import uuid
from typing import Mapping

from miles.sandboxes import dockerfile as df
from miles.sandboxes.base import (Backend, DEFAULT_WORKDIR, ExecResult, Sandbox, SandboxCreateError,
                                  SandboxError, SandboxSpec, SandboxSpecError, check, labels_match,
                                  sandbox_path, timed_out_from, timeout_argv)
from miles.sandboxes.docker_api import DockerAPI, DockerAPIError
from miles.sandboxes.rootfs import context_files, template_key

LABEL_PREFIX = "miles.label."
BACKSTOP_GRACE_S = 5.0


class DockerSandbox(Sandbox):
    backend_name = "docker"

    def __init__(self, backend: "DockerBackend", cid: str, spec: SandboxSpec, workdir: str,
                 created_at: float):
        super().__init__(cid[:12], spec, workdir=workdir,
                         default_timeout_s=backend.default_timeout_s)
        self.backend = backend
        self.container_id = cid
        self.created_at = created_at

    async def _exec(self, argv: list[str], cwd: str, env: dict[str, str],
                    timeout_s: float) -> ExecResult:
        return await self._run(argv, cwd, env, timeout_s, None)

    async def _exec_as(self, user: str, argv: list[str], cwd: str, env: dict[str, str],
                       timeout_s: float) -> ExecResult:
        return await self._run(argv, cwd, env, timeout_s, user)

    async def _run(self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float,
                   user: str | None) -> ExecResult:
        started = time.monotonic()
        kill_after = self.backend.kill_after_s
        code, out, err, truncated = await self.backend.api.exec(
            self.container_id, timeout_argv(timeout_s, argv, kill_after), env=env, workdir=cwd,
            user=user, timeout_s=timeout_s + kill_after + BACKSTOP_GRACE_S,
            max_output_bytes=self.backend.max_output_bytes)
        elapsed = time.monotonic() - started
        if code is None:
            return ExecResult(137, out, err, timed_out=True, duration_s=elapsed,
                              truncated=truncated)
        return ExecResult(code, out, err, timed_out=timed_out_from(code, elapsed, timeout_s),
                          duration_s=elapsed, truncated=truncated)

    async def _upload(self, path: str, data: bytes, mode: int) -> None:
        await self.upload_dir_abs({path: (data, mode)})

    async def upload_dir(self, path: str, files: Mapping[str, bytes]) -> None:
        self._check_live()
        base = sandbox_path(path, self.workdir)
        await self.upload_dir_abs({sandbox_path(posixpath.join(base, rel), "/"): (data, 0o644)
                                   for rel, data in files.items()})

    async def upload_dir_abs(self, files: dict[str, tuple[bytes, int]]) -> None:
        """One tar for many files; parent directories are created by the daemon's extraction."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            dirs = set()
            for path in files:
                parent = posixpath.dirname(path)
                while parent not in ("/", "") and parent not in dirs:
                    dirs.add(parent)
                    parent = posixpath.dirname(parent)
            for d in sorted(dirs):
                info = tarfile.TarInfo(d.lstrip("/"))
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
                tar.addfile(info)
            for path, (data, mode) in files.items():
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode & 0o777, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        await self.backend.api.put_archive(self.container_id, "/", buf.getvalue())

    async def _download(self, path: str) -> bytes:
        try:
            raw = await self.backend.api.get_archive(self.container_id, path)
        except DockerAPIError as exc:
            if exc.status == 404:
                raise FileNotFoundError(2, "no such file in sandbox", path) from None
            raise
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                kind = "empty" if member is None else "not a regular file"
                raise SandboxError(f"download source {path!r} in sandbox {self.id} is {kind}")
            return tar.extractfile(member).read()

    async def _destroy(self) -> None:
        await self.backend.api.remove(self.container_id)


class DockerBackend(Backend):
    name = "docker"

    def __init__(self, *, socket: str | None = None, base_image_map: dict[str, str] | None = None,
                 fallback_base_image: str | None = None, default_timeout_s: float = 600.0,
                 max_output_bytes: int = 1 << 20, kill_after_s: float = 2.0,
                 build_timeout_s: float = 1800.0, include_python_in_base: bool = True):
        self.api = DockerAPI(socket)
        self.base_image_map = dict(base_image_map or {})
        self.fallback_base_image = fallback_base_image
        self.default_timeout_s = default_timeout_s
        self.max_output_bytes = max_output_bytes
        self.kill_after_s = kill_after_s
        self.build_timeout_s = build_timeout_s
        self.include_python_in_base = include_python_in_base
        self._built: dict[str, str] = {}
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._host_base: str | None = None

    async def available(self) -> bool:
        return await self.api.ping()

    async def close(self) -> None:
        await self.api.close()

    def is_retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, DockerAPIError):
            return exc.status >= 500 and "No such image" not in exc.message
        return super().is_retryable(exc)

    # Images ------------------------------------------------------------------------------------

    async def _resolve_from(self, image: str) -> str:
        if image in self.base_image_map:
            return self.base_image_map[image]
        if await self.api.image_config(image) is not None:
            return image
        if self.fallback_base_image == "host":
            if self._host_base is None:
                from miles.sandboxes.baseimage import ensure_base_image
                self._host_base = await ensure_base_image(self.api, self.include_python_in_base)
            return self._host_base
        if self.fallback_base_image:
            return self.fallback_base_image
        raise SandboxCreateError(
            f"docker: base image {image!r} is not present locally and nothing is pulled here; "
            "build or load it, or set base_image_map / fallback_base_image")

    async def image_for(self, spec: SandboxSpec) -> str:
        if spec.image is not None:
            if await self.api.image_config(spec.image) is None:
                raise SandboxCreateError(f"docker: SandboxSpec.image={spec.image!r} is not "
                                         "present locally (nothing is pulled here)")
            return spec.image
        if spec.dockerfile is None:
            raise SandboxSpecError("SandboxSpec.image=None and dockerfile=None: the docker "
                                   "backend needs an image or a Dockerfile")
        lock = self._build_locks.setdefault(spec.dockerfile, asyncio.Lock())
        async with lock:
            if spec.dockerfile not in self._built:
                self._built[spec.dockerfile] = await self._build(spec.dockerfile)
        return self._built[spec.dockerfile]

    async def _build(self, path: str) -> str:
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise SandboxSpecError(f"SandboxSpec.dockerfile={path!r}: no such file")
        with open(path) as f:
            text = f.read()
        steps = df.parse(text, path)
        stages = {i.args.split()[-1].lower() for i in steps
                  if i.cmd == "FROM" and " as " in i.args.lower()}
        lines = text.splitlines()
        mapping = {}
        for ins in steps:
            if ins.cmd == "FROM":
                image = ins.args.split()[0]
                if image.lower() not in stages and image != "scratch":
                    mapping[image] = await self._resolve_from(image)
                    lines[ins.line - 1] = lines[ins.line - 1].replace(image, mapping[image], 1)
        key = template_key("docker", path) + hashlib.sha256(
            json.dumps(mapping, sort_keys=True).encode()).hexdigest()[:8]
        tag = f"miles-sandbox-task:{key}"
        if await self.api.image_config(tag) is not None:
            return tag
        context = os.path.dirname(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for rel in context_files(context):
                tar.add(os.path.join(context, rel), arcname=rel, recursive=False)
            data = ("\n".join(lines) + "\n").encode()
            info = tarfile.TarInfo(".miles.Dockerfile")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        try:
            await self.api.build(buf.getvalue(), tag, ".miles.Dockerfile", self.build_timeout_s)
        except DockerAPIError as exc:
            raise df.DockerfileError(f"{path}: docker build failed: {exc.message[-1500:]}") \
                from None
        return tag

    # Lifecycle ---------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        if spec.rootfs is not None:
            raise SandboxSpecError(f"SandboxSpec.rootfs={spec.rootfs!r} is invalid for backend "
                                   "docker: give an image or a Dockerfile")
        image = await self.image_for(spec)
        config = await self.api.image_config(image) or {}
        workdir = spec.workdir or config.get("WorkingDir") or DEFAULT_WORKDIR
        now = time.time()
        labels = {"miles.sandbox": "1", "miles.deadline": f"{now + spec.ttl_s:.0f}",
                  **{LABEL_PREFIX + k: v for k, v in spec.labels.items()}}
        host_config = {
            "NetworkMode": "bridge" if spec.network else "none",
            "Memory": spec.memory_mb << 20, "MemorySwap": spec.memory_mb << 20,
            "NanoCpus": int(spec.cpu * 1e9), "PidsLimit": spec.max_processes,
            "Ulimits": [{"Name": "fsize", "Soft": spec.disk_mb << 20,
                         "Hard": spec.disk_mb << 20}],
            "AutoRemove": True, "Init": True, "SecurityOpt": ["no-new-privileges"],
        }
        body = {"Image": image, "Entrypoint": ["sleep"], "Cmd": [str(int(spec.ttl_s) + 1)],
                "WorkingDir": workdir, "Hostname": "sandbox", "Labels": labels,
                "Env": [f"{k}={v}" for k, v in spec.env.items()],
                "NetworkDisabled": not spec.network, "HostConfig": host_config}
        name = f"miles-sbx-{uuid.uuid4().hex[:16]}"
        try:
            cid = await self.api.create_container(body, name)
        except DockerAPIError as exc:
            raise SandboxCreateError(str(exc), retryable=self.is_retryable(exc)) from exc
        try:
            await self.api.start(cid)
        except BaseException as exc:
            await self.api.remove(cid)
            if isinstance(exc, DockerAPIError):
                raise SandboxCreateError(str(exc), retryable=self.is_retryable(exc)) from exc
            raise
        return DockerSandbox(self, cid, spec, workdir, now)

    async def sweep(self, labels: Mapping[str, str]) -> int:
        check(bool(labels), "docker.sweep(labels)", dict(labels),
              "at least one label (an empty filter would match other runs' sandboxes)")
        now = time.time()
        n = 0
        for c in await self.api.list_containers({"miles.sandbox": "1"}):
            have = {k[len(LABEL_PREFIX):]: v for k, v in (c.get("Labels") or {}).items()
                    if k.startswith(LABEL_PREFIX)}
            deadline = float((c.get("Labels") or {}).get("miles.deadline", "inf"))
            if labels_match(have, labels) or deadline < now:
                n += await self.api.remove(c["Id"])
        return n

    async def live_ids(self, labels: Mapping[str, str] | None = None) -> list[str]:
        want = {"miles.sandbox": "1", **{LABEL_PREFIX + k: v for k, v in (labels or {}).items()}}
        return sorted(c["Id"][:12] for c in await self.api.list_containers(want))
