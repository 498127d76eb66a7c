"""The engine's side of the P2P weight transfer (`weights.transport = "p2p"`, miles/weights/p2p.py).

    GET  /p2p_layout              {"tp_size", "dtype", "specs": [[name, full shape], ...]}
    POST /init_p2p_group          {master_address, master_port, rank_offset, world_size,
                                   group_name, plan (base64 msgpack Plan), dtype, backend, timeout_s}
    POST /update_weights_from_p2p {"weight_version"?}: receive one version, then answer
    POST /destroy_p2p_group       {}

Design decisions:
- The engine names the tensors (its full checkpoint names and shapes, `/p2p_layout`), so the
  trainers' plan indexes exactly what this engine holds; the trainer sends the plan back in the
  join, and every TP rank cuts its own boxes out of it (runner.py `_op_p2p_join`).
- Every TP rank joins the one group of trainers + engine ranks at `rank_offset` + its TP rank and
  receives only its slices, straight into its Weights views (p2p_receiver.EngineRank): nothing
  is gathered on rank 0 and nothing is broadcast.
- One `/update_weights_from_p2p` call is one version: it holds the step lock (the publisher has
  paused generation), runs the receive on every rank and answers after the closing barrier, so
  its answer is the trainer's "loaded" signal. The version itself is set by the publisher's
  `/update_weight_version`, as for the other transports.
- The join blocks until every trainer and engine rank is in, so it also runs under the step lock,
  on the compute thread: generation stalls for the join (once per run), never in the middle of
  a step's collectives.
"""

from __future__ import annotations

import base64

import msgspec
from aiohttp import web

from miles.engines.embedded_engine.protocol import BadRequest, decode_body


class InitP2PGroupReq(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    plan: str
    dtype: str = "float32"
    backend: str = "gloo"
    timeout_s: float = 120.0


class UpdateFromP2PReq(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    weight_version: str | None = None


class DestroyP2PGroupReq(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_name: str | None = None


def _json(data, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


class P2PRoutes:
    def __init__(self, server):
        self.server = server

    def add_to(self, r) -> None:
        r.add_get("/p2p_layout", self.layout)
        r.add_post("/init_p2p_group", self.init_group)
        r.add_post("/update_weights_from_p2p", self.update)
        r.add_post("/destroy_p2p_group", self.destroy)

    async def layout(self, _request) -> web.Response:
        runner = self.server.runner
        w = runner.model.weights
        return _json({"tp_size": runner.tp.size if runner.tp is not None else 1,
                      "dtype": self.server.args.dtype,
                      "specs": [[n, list(w.full_shapes[n])] for n in w.full_names]})

    async def init_group(self, request) -> web.Response:
        b = decode_body(await request.read(), InitP2PGroupReq, "init_p2p_group")
        if b.backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend: {b.backend!r} is not gloo or nccl", "backend")
        if b.dtype not in ("float32", "bfloat16", "float16"):
            raise BadRequest(f"dtype: {b.dtype!r} is not float32, bfloat16 or float16", "dtype")
        try:
            plan = base64.b64decode(b.plan, validate=True)
        except ValueError:
            raise BadRequest("plan: not base64 (a msgpack-encoded miles.weights.p2p.Plan)", "plan") from None
        sch = self.server.scheduler
        try:
            async with sch.step_lock:
                await sch.run_compute(self.server.runner.p2p_join, b.master_address, b.master_port,
                                      b.rank_offset, b.world_size, b.group_name, plan, b.dtype,
                                      b.backend, b.timeout_s)
        except (ValueError, KeyError, RuntimeError, msgspec.DecodeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json({"success": False, "message": f"Failed to join the P2P group: {msg}"}, 400)
        return _json({"success": True, "message": "Joined the P2P weight group."})

    async def update(self, request) -> web.Response:
        b = decode_body(await request.read(), UpdateFromP2PReq, "update_weights_from_p2p")
        server = self.server
        got: dict = {}

        def receive():
            got["version"], got["received"] = server.runner.p2p_receive()

        response = await server._update(receive, weight_version=b.weight_version)
        if response.status == 200 and "version" in got:
            return _json({"success": True, "message": "Succeeded to update model weights.",
                          "version": got["version"], "received_bytes": got["received"]})
        return response

    async def destroy(self, request) -> web.Response:
        decode_body(await request.read() or b"{}", DestroyP2PGroupReq, "destroy_p2p_group")
        sch = self.server.scheduler
        async with sch.step_lock:
            await sch.run_compute(self.server.runner.p2p_leave)
        return _json({"success": True, "message": "Left the P2P weight group."})
