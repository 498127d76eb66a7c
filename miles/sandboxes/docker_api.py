"""A small async client for the Docker Engine HTTP API over its unix socket (aiohttp).

Only what the docker backend needs: containers (create/start/remove/list), exec with demultiplexed
output, archive upload/download, image inspect/import/build.

Design decisions:
- The Engine API instead of the `docker` CLI: one CLI call costs a Go process start (~30-50 ms)
  and a create+exec+rm cycle needed four of them; over the socket it is three or four requests on
  a kept-alive connection, and errors come back as structured JSON.
- `DOCKER_HOST=unix:///path` is honoured; the default is the standard socket path. TCP daemons are
  not supported (no TLS handling here).
- Exec output is the documented multiplexed stream (8-byte frame headers: stream id, 0, 0, 0,
  big-endian length), read into capped buffers like the host backends do.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from typing import Any

import aiohttp

from miles.sandboxes.base import BackendUnavailableError, SandboxError
from miles.sandboxes.procs import CappedBuffer

DEFAULT_SOCKET = "/var/run/docker.sock"


class DockerAPIError(SandboxError):
    def __init__(self, status: int, message: str, what: str):
        super().__init__(f"docker {what}: HTTP {status}: {message}")
        self.status = status
        self.message = message


def socket_path() -> str:
    host = os.environ.get("DOCKER_HOST", "")
    if host.startswith("unix://"):
        return host[len("unix://"):]
    if host:
        raise BackendUnavailableError(f"DOCKER_HOST={host!r} is not supported: expected "
                                      "unix:///path/to/docker.sock")
    return DEFAULT_SOCKET


class DockerAPI:
    def __init__(self, socket: str | None = None, request_timeout_s: float = 120.0):
        self.socket = socket or socket_path()
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket, limit=64),
                base_url="http://docker")
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(self, method: str, path: str, what: str, *, params: dict | None = None,
                      body: Any = None, data: bytes | None = None,
                      headers: dict | None = None, timeout_s: float | None = None,
                      ok: tuple[int, ...] = (200, 201, 204, 304)) -> bytes:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s)
        try:
            async with self.session().request(method, path, params=params, json=body, data=data,
                                              headers=headers, timeout=timeout) as resp:
                payload = await resp.read()
                if resp.status not in ok:
                    raise DockerAPIError(resp.status, _message(payload), what)
                return payload
        except (aiohttp.ClientConnectorError, FileNotFoundError) as exc:
            raise BackendUnavailableError(f"docker daemon not reachable at {self.socket}: "
                                          f"{exc}") from exc

    async def ping(self) -> bool:
        try:
            return await self.request("GET", "/_ping", "ping", timeout_s=5) == b"OK"
        except (SandboxError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    # Containers --------------------------------------------------------------------------------

    async def create_container(self, config: dict, name: str) -> str:
        out = await self.request("POST", "/containers/create", f"create {name}",
                                 params={"name": name}, body=config)
        return json.loads(out)["Id"]

    async def start(self, cid: str) -> None:
        await self.request("POST", f"/containers/{cid}/start", f"start {cid[:12]}")

    async def remove(self, cid: str) -> bool:
        """Force-remove; False when it was already gone."""
        try:
            await self.request("DELETE", f"/containers/{cid}", f"remove {cid[:12]}",
                               params={"force": "true", "v": "true"})
            return True
        except DockerAPIError as exc:
            if exc.status == 404 or (exc.status == 409 and "in progress" in exc.message):
                return False
            raise

    async def list_containers(self, labels: dict[str, str]) -> list[dict]:
        filters = json.dumps({"label": [f"{k}={v}" for k, v in labels.items()]})
        out = await self.request("GET", "/containers/json", "list containers",
                                 params={"all": "true", "filters": filters})
        return json.loads(out)

    async def exec(self, cid: str, cmd: list[str], *, env: dict[str, str], workdir: str,
                   timeout_s: float, max_output_bytes: int, user: str | None = None
                   ) -> tuple[int | None, str, str, bool]:
        """Run `cmd` in the container, as `user` (None: the image's USER); (exit_code or None if
        the stream was cut, stdout, stderr, truncated). `timeout_s` is the backstop for the whole
        request."""
        body = {"AttachStdin": False, "AttachStdout": True, "AttachStderr": True, "Tty": False,
                "Cmd": cmd, "Env": [f"{k}={v}" for k, v in env.items()], "WorkingDir": workdir}
        if user is not None:
            body["User"] = user
        out = await self.request("POST", f"/containers/{cid}/exec", f"exec in {cid[:12]}",
                                 body=body)
        exec_id = json.loads(out)["Id"]
        bufs = {1: CappedBuffer(max_output_bytes), 2: CappedBuffer(max_output_bytes)}
        try:
            async with self.session().post(
                    f"/exec/{exec_id}/start", json={"Detach": False, "Tty": False},
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise DockerAPIError(resp.status, _message(await resp.read()),
                                         f"exec start in {cid[:12]}")
                while True:
                    try:
                        header = await resp.content.readexactly(8)
                    except asyncio.IncompleteReadError:
                        break
                    stream, size = header[0], struct.unpack(">I", header[4:8])[0]
                    chunk = await resp.content.readexactly(size)
                    buf = bufs.get(stream, bufs[2])
                    room = buf.cap - len(buf.data)
                    if room > 0:
                        buf.data += chunk[:room]
                    if len(chunk) > max(room, 0):
                        buf.truncated = True
        except asyncio.TimeoutError:
            await self._kill_exec(exec_id)
            return None, bufs[1].text(), bufs[2].text(), bufs[1].truncated or bufs[2].truncated
        info = json.loads(await self.request("GET", f"/exec/{exec_id}/json", "exec inspect"))
        return (info.get("ExitCode"), bufs[1].text(), bufs[2].text(),
                bufs[1].truncated or bufs[2].truncated)

    async def _kill_exec(self, exec_id: str) -> None:
        # Backstop only (the in-container `timeout` normally fires first): with a local daemon
        # the exec's Pid is a host pid leading its own session.
        try:
            info = json.loads(await self.request("GET", f"/exec/{exec_id}/json", "exec inspect"))
            if info.get("Running") and info.get("Pid"):
                os.killpg(int(info["Pid"]), 9)
        except (SandboxError, OSError, ValueError):
            pass

    async def put_archive(self, cid: str, path: str, tar: bytes) -> None:
        await self.request("PUT", f"/containers/{cid}/archive", f"upload to {cid[:12]}:{path}",
                           params={"path": path}, data=tar,
                           headers={"Content-Type": "application/x-tar"})

    async def get_archive(self, cid: str, path: str) -> bytes:
        return await self.request("GET", f"/containers/{cid}/archive",
                                  f"download {cid[:12]}:{path}", params={"path": path})

    # Images ------------------------------------------------------------------------------------

    async def image_config(self, name: str) -> dict | None:
        try:
            out = await self.request("GET", f"/images/{name}/json", f"inspect image {name}")
        except DockerAPIError as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(out).get("Config") or {}

    async def import_image(self, tar: bytes, repo: str, tag: str) -> None:
        out = await self.request("POST", "/images/create", f"import {repo}:{tag}",
                                 params={"fromSrc": "-", "repo": repo, "tag": tag}, data=tar,
                                 headers={"Content-Type": "application/x-tar"}, timeout_s=600)
        _raise_stream_error(out, f"import {repo}:{tag}")

    async def build(self, context_tar: bytes, tag: str, dockerfile: str,
                    timeout_s: float) -> str:
        out = await self.request("POST", "/build", f"build {tag}", params={
            "t": tag, "dockerfile": dockerfile, "rm": "1", "forcerm": "1", "pull": "0",
            "labels": json.dumps({"miles.sandbox.image": "1"})}, data=context_tar,
            headers={"Content-Type": "application/x-tar"}, timeout_s=timeout_s)
        return _raise_stream_error(out, f"build {tag}")


def _message(payload: bytes) -> str:
    try:
        return json.loads(payload).get("message", payload.decode(errors="replace"))
    except (ValueError, AttributeError):
        return payload.decode(errors="replace").strip()


def _raise_stream_error(payload: bytes, what: str) -> str:
    """Build/import answer with a stream of JSON objects; an `error` one means failure."""
    log = []
    for line in payload.decode(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if item.get("error"):
            raise DockerAPIError(200, item["error"] + "\n" + "".join(log)[-2000:], what)
        log.append(item.get("stream") or item.get("status") or "")
    return "".join(log)
