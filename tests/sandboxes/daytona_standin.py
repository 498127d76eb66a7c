"""A local stand-in for the Daytona API and its toolbox, on 127.0.0.1, for driving the real
`daytona` SDK through DaytonaConfig(api_url=...). Each Daytona sandbox is backed by a real local
host sandbox.

Implemented, as the SDK (daytona 0.226) uses them:
- POST /sandbox (answers state "started" at once), GET /sandbox/{id}, DELETE /sandbox/{id},
  GET /sandbox (one cursor page, label filter)
- toolbox, under the toolboxProxyUrl we hand out (<url>/toolbox/<sandbox id>):
  POST /process/execute, POST /files/folder, POST /files/bulk-upload (multipart),
  POST /files/bulk-download (multipart answer; a missing file is an `error` part with
  statusCode 404), GET /work-dir
The SDK's socket.io event stream is refused (it then polls). Anything else answers 501 and is
recorded in `unhandled`.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from miles.sandboxes.base import SandboxSpec


class DaytonaStandIn:
    def __init__(self, engine):
        self.engine = engine
        self.sandboxes: dict[str, dict] = {}
        self.created: list[dict] = []   # every POST /sandbox body, in order
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
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for entry in list(self.sandboxes.values()):
            await entry["box"].destroy()
        if self.runner is not None:
            await self.runner.cleanup()

    def dto(self, sid: str) -> dict:
        entry = self.sandboxes[sid]
        body = entry["body"]
        res = body.get("resources") or {}
        return {"id": sid, "organizationId": "org", "name": sid, "user": "root",
                "env": body.get("env") or {}, "labels": body.get("labels") or {},
                "public": False, "networkBlockAll": bool(body.get("networkBlockAll")),
                "kvm": False, "target": "local", "cpu": body.get("cpu", 1), "gpu": 0,
                "memory": body.get("memory", 1), "disk": body.get("disk", 1),
                "state": "started", "desiredState": "started",
                "autoStopInterval": body.get("autoStopInterval", 15),
                "autoDeleteInterval": body.get("autoDeleteInterval", -1),
                "createdAt": entry["created"], "updatedAt": entry["created"],
                "toolboxProxyUrl": f"{self.url}/toolbox", "resources": res}

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        self.requests.append((method, path))
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["sandbox"]:
            if len(parts) == 1 and method == "POST":
                return await self.create(request)
            if len(parts) == 1:
                return self.list(request, paginated=False)
            sid = parts[1]
            if sid not in self.sandboxes:
                return web.json_response({"statusCode": 404, "message": "not found"},
                                         status=404)
            if len(parts) == 2 and method == "GET":
                return web.json_response(self.dto(sid))
            if len(parts) == 2 and method == "DELETE":
                entry = self.sandboxes.pop(sid)
                await entry["box"].destroy()
                return web.json_response(self.dto_gone(sid, entry))
        if parts[:1] == ["toolbox"] and len(parts) >= 3 and parts[1] in self.sandboxes:
            box = self.sandboxes[parts[1]]["box"]
            route = "/" + "/".join(parts[2:])
            if route == "/process/execute":
                return await self.execute(request, box)
            if route == "/files/folder":
                await box.exec(["mkdir", "-p", request.query["path"]])
                return web.Response(status=200)
            if route == "/files/bulk-upload":
                return await self.bulk_upload(request, box)
            if route == "/files/bulk-download":
                return await self.bulk_download(request, box)
            if route == "/work-dir":
                return web.json_response({"dir": box.workdir})
        self.unhandled.append((method, path))
        return web.json_response({"statusCode": 501, "message": f"stand-in: {method} {path}"},
                                 status=501)

    def dto_gone(self, sid: str, entry: dict) -> dict:
        self.sandboxes[sid] = entry
        try:
            out = self.dto(sid)
        finally:
            del self.sandboxes[sid]
        out["state"] = "destroyed"
        return out

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.created.append(body)
        ttl_s = 60 * (body.get("ttlMinutes") or 10)
        box = await self.engine.create(SandboxSpec(ttl_s=ttl_s, env=body.get("env") or {}))
        sid = "dt-" + uuid.uuid4().hex[:10]
        self.sandboxes[sid] = {"box": box, "body": body,
                               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
        return web.json_response(self.dto(sid))

    def list(self, request: web.Request, paginated: bool) -> web.Response:
        wanted = json.loads(request.query.get("labels", "{}") or "{}")
        items = [self.dto(sid) for sid, e in self.sandboxes.items()
                 if all((e["body"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
        # GET /sandbox answers one cursor page: {"items": [...], "nextCursor": null}.
        return web.json_response({"items": items, "nextCursor": None})

    async def execute(self, request: web.Request, box) -> web.Response:
        body = await request.json()
        r = await box.exec(["/bin/sh", "-c", body["command"]], cwd=body.get("cwd") or None,
                           env=body.get("envs") or body.get("env") or {}, timeout_s=3600)
        return web.json_response({"exitCode": r.exit_code, "result": r.stdout + r.stderr})

    async def bulk_upload(self, request: web.Request, box) -> web.Response:
        reader = await request.multipart()
        pending: dict[str, dict] = {}
        async for part in reader:
            # Fields come as files[i].path and files[i].file.
            index, _, kind = part.name.partition("].")
            slot = pending.setdefault(index, {})
            slot[kind] = await part.read() if kind == "file" else (await part.text())
        for slot in pending.values():
            await box.upload(slot["path"], slot["file"])
        return web.Response(status=200)

    async def bulk_download(self, request: web.Request, box) -> web.Response:
        import aiohttp
        paths = (await request.json())["paths"]
        # Raw Content-Disposition: aiohttp's helper would percent-encode the '/' of the path.
        disposition = 'form-data; name="{}"; filename="{}"'
        with aiohttp.MultipartWriter("form-data") as mp:
            for path in paths:
                try:
                    data = await box.download(path)
                except FileNotFoundError:
                    mp.append_json({"message": f"file not found: {path}", "statusCode": 404,
                                    "code": "FILE_NOT_FOUND", "source": path},
                                   {"Content-Disposition": disposition.format("error", path)})
                    continue
                mp.append(data, {"Content-Type": "application/octet-stream",
                                 "Content-Disposition": disposition.format("file", path)})
        return web.Response(body=mp, headers={"Content-Type": mp.content_type})
