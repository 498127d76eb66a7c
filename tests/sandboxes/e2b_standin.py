"""A local stand-in for the E2B API (the control plane) and envd (the in-sandbox agent), on
127.0.0.1, for driving the real `e2b` SDK through its `api_url` / `sandbox_url` overrides (the
AgentENV set-up). Each E2B sandbox is backed by a real local host sandbox, so commands and files
really happen.

Implemented, as the SDK (e2b 2.63) uses them:
- POST /v2/sandboxes, GET /v2/sandboxes (metadata filter), DELETE /sandboxes/{id}
- envd: POST /process.Process/Start (Connect protocol, server streaming, JSON codec: 5-byte
  envelopes, `{"event": {"start"|"data"|"end": ...}}` messages, then an end-of-stream envelope),
  GET /files (download), POST /files (multipart upload), GET /health
Sandboxes are told apart by the E2b-Sandbox-Id header the SDK sends with every envd request.
Everything else answers 501 and is recorded in `unhandled`, so a test notices SDK drift.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid

from aiohttp import web

from miles.sandboxes.base import SandboxSpec


def envelope(obj: dict, flags: int = 0) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


class E2BStandIn:
    def __init__(self, engine):
        self.engine = engine            # a host Backend that backs every E2B sandbox
        self.sandboxes: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        for entry in list(self.sandboxes.values()):
            await entry["box"].destroy()
        if self.runner is not None:
            await self.runner.cleanup()

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        self.requests.append((method, path))
        if path == "/v2/sandboxes" and method == "POST":
            return await self.create(request)
        if path == "/v2/sandboxes" and method == "GET":
            return self.list(request)
        if path.startswith("/sandboxes/") and method == "DELETE":
            return await self.kill(path.rsplit("/", 1)[-1])
        box = self.sandboxes.get(request.headers.get("E2b-Sandbox-Id", ""), {}).get("box")
        if path == "/health":
            return web.Response(status=204 if box else 502)
        if box is not None and path == "/process.Process/Start":
            return await self.start_process(request, box)
        if box is not None and path == "/files" and method == "GET":
            return await self.read_file(request, box)
        if box is not None and path == "/files" and method == "POST":
            return await self.write_file(request, box)
        self.unhandled.append((method, path))
        return web.json_response({"code": 501, "message": f"stand-in: {method} {path}"},
                                 status=501)

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        box = await self.engine.create(SandboxSpec(ttl_s=body.get("timeout", 300),
                                                   env=body.get("envVars") or {}))
        sid = "sb" + uuid.uuid4().hex[:10]
        self.sandboxes[sid] = {"box": box, "body": body, "started": time.time()}
        return web.json_response({
            "templateID": body["templateID"], "sandboxID": sid, "clientID": "standin",
            "envdVersion": "0.4.0", "envdAccessToken": "token-" + sid, "domain": None},
            status=201)

    def list(self, request: web.Request) -> web.Response:
        wanted = dict(p.split("=", 1) for p in request.query.get("metadata", "").split("&") if p)
        out = []
        for sid, entry in self.sandboxes.items():
            meta = entry["body"].get("metadata") or {}
            if all(meta.get(k) == v for k, v in wanted.items()):
                started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry["started"]))
                out.append({"templateID": entry["body"]["templateID"], "sandboxID": sid,
                            "clientID": "standin", "startedAt": started, "endAt": started,
                            "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 1024,
                            "metadata": meta, "state": "running", "envdVersion": "0.4.0"})
        return web.json_response(out)

    async def kill(self, sid: str) -> web.Response:
        entry = self.sandboxes.pop(sid, None)
        if entry is None:
            return web.json_response({"code": 404, "message": "not found"}, status=404)
        await entry["box"].destroy()
        return web.Response(status=204)

    async def start_process(self, request: web.Request, box) -> web.StreamResponse:
        raw = await request.read()
        flags, size = struct.unpack(">BI", raw[:5])
        message = json.loads(raw[5:5 + size])
        proc = message["process"]
        argv = [proc["cmd"], *proc.get("args", [])]
        resp = web.StreamResponse(status=200, headers={"Content-Type":
                                                       "application/connect+json"})
        await resp.prepare(request)
        await resp.write(envelope({"event": {"start": {"pid": 4242}}}))
        r = await box.exec(argv, cwd=proc.get("cwd") or None, env=proc.get("envs") or {},
                           timeout_s=3600)
        for name, text in (("stdout", r.stdout), ("stderr", r.stderr)):
            if text:
                data = base64.b64encode(text.encode()).decode()
                await resp.write(envelope({"event": {"data": {name: data}}}))
        await resp.write(envelope({"event": {"end": {
            "exitCode": r.exit_code, "exited": True, "status": f"exit status {r.exit_code}"}}}))
        await resp.write(envelope({}, flags=0x02))
        await resp.write_eof()
        return resp

    async def read_file(self, request: web.Request, box) -> web.Response:
        try:
            data = await box.download(request.query["path"])
        except FileNotFoundError:
            return web.json_response({"code": 404, "message": "file not found"}, status=404)
        return web.Response(body=data, content_type="application/octet-stream")

    async def write_file(self, request: web.Request, box) -> web.Response:
        path = request.query.get("path")
        written = []
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            async for part in reader:
                target = path or part.filename
                await box.upload(target, await part.read())
                written.append(target)
        else:
            await box.upload(path, await request.read())
            written.append(path)
        return web.json_response([{"name": p.rsplit("/", 1)[-1], "type": "file", "path": p}
                                  for p in written])
