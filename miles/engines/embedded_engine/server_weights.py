"""The embedded engine's weight routes: updates from disk, a delta, tensors (CUDA IPC), a
torch.distributed group; the weight version; reading weights back and their checksums. A part
of `EngineServer` (server.py), whose scheduler applies each update between two decode steps."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from miles.engines.embedded_engine import protocol as P
from miles.engines.embedded_engine import weights as W
from miles.engines.embedded_engine.protocol import BadRequest, decode_body
from miles.engines.embedded_engine.responses import json_response as _json

log = logging.getLogger("miles.engines.embedded_engine.server")
BUCKET_TURN_TIMEOUT_S = 300.0  # a bucket_seq waits this long for the bucket before it


class WeightRoutes:
    """`EngineServer`'s weight-update handlers (the routes are added in `EngineServer.app`)."""

    async def _update(self, fn, *args, weight_version=None, abort_all=False, model_path=None):
        sch = self.scheduler
        if abort_all:
            await sch.abort(None, "Aborted for a weight update")
        try:
            async with sch.step_lock:
                if fn is not self.groups.receive:  # a pipelined flat bucket must land first
                    await sch.run_compute(self.groups.complete_pending, self.runner.model.weights)
                try:
                    await sch.run_compute(fn, *args)
                finally:  # even a failed update may have changed some tensors
                    sch.flush_prefix_cache()
                self.weights_serial += 1
                if weight_version is not None:
                    sch.weight_version = weight_version
                if model_path is not None:
                    self.model_path = model_path
        except (ValueError, KeyError, LookupError, FileNotFoundError, RuntimeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json({"success": False, "message": f"Failed to update weights: {msg}",
                          "num_paused_requests": 0}, 400)
        return _json({"success": True, "message": "Succeeded to update model weights.",
                      "num_paused_requests": len(sch.running) + len(sch.waiting)})

    async def update_weights_from_disk(self, request) -> web.Response:
        b = decode_body(await request.read(), P.UpdateWeightsFromDiskReq, "update_weights_from_disk")
        return await self._update(self.runner.load_from_disk, b.model_path,
                                  weight_version=b.weight_version, abort_all=b.abort_all_requests,
                                  model_path=b.model_path)

    async def update_weights_from_delta(self, request) -> web.Response:
        self._single_rank("/update_weights_from_delta (weights.transport = \"disk_delta\")")
        return await self.delta.handle(request)

    def _single_rank(self, what: str) -> None:
        if self.runner.tp is not None:
            raise BadRequest(f"{what} is not supported by the embedded engine at --tp-size "
                             f"{self.runner.tp.size}; use /update_weights_from_disk or the P2P "
                             "transfer (weights.transport = \"p2p\")", "tp_size")

    async def update_weights_from_tensor(self, request) -> web.Response:
        self._single_rank("/update_weights_from_tensor")
        b = decode_body(await request.read(), P.UpdateWeightsFromTensorReq, "update_weights_from_tensor")
        if b.load_format not in (None, "safetensors", "direct", W.CUDA_IPC_FORMAT, W.CUDA_IPC_DIRECT):
            raise BadRequest(f"load_format: {b.load_format!r} is not supported by the embedded engine "
                             f"(base64 safetensors payloads, {W.CUDA_IPC_FORMAT!r} or {W.CUDA_IPC_DIRECT!r})", "load_format")
        if len(b.serialized_named_tensors) != 1:
            raise BadRequest(f"serialized_named_tensors: {len(b.serialized_named_tensors)} entries; "
                             "this engine has tp_size 1, send exactly one", "serialized_named_tensors")
        if b.load_format == W.CUDA_IPC_DIRECT:
            targets = self._ipc_targets[0] if self._ipc_targets is not None else None
            try:
                W.check_direct_write(targets, b.serialized_named_tensors[0])
            except ValueError as e:
                raise BadRequest(str(e), "serialized_named_tensors") from None
            return await self._update(lambda: None, weight_version=b.weight_version,
                                      abort_all=b.abort_all_requests)
        if b.load_format == W.CUDA_IPC_FORMAT:
            return await self._update(W.apply_cuda_ipc_bucket, self.runner.model.weights,
                                      b.serialized_named_tensors[0], weight_version=b.weight_version,
                                      abort_all=b.abort_all_requests)
        try:
            named = list(W.decode_tensor_payload(b.serialized_named_tensors[0],
                                                 "serialized_named_tensors[0]").items())
        except ValueError as e:
            raise BadRequest(str(e), "serialized_named_tensors") from None
        return await self._update(W.apply_named_tensors, self.runner.model.weights, named,
                                  weight_version=b.weight_version, abort_all=b.abort_all_requests)

    async def ipc_weight_targets(self, request) -> web.Response:
        """This engine's weight storages by CUDA IPC (weights.ipc_targets), shared once per process:
        a colocated trainer writes into them (load_format "miles_cuda_ipc_direct"). `?token=T`
        with this engine's token answers {"token", "unchanged": true} only (a publish's check)."""
        self._single_rank("/ipc_weight_targets")
        asked = request.query.get("token", "")
        if asked and self._ipc_targets is not None and asked == self._ipc_targets[0].token:
            return _json({"token": asked, "unchanged": True})
        if self._ipc_targets is None:
            async with self.scheduler.step_lock:
                if self._ipc_targets is None:
                    try:
                        targets, keep = await self.scheduler.run_compute(W.ipc_targets,
                                                                         self.runner.model.weights)
                    except ValueError as e:
                        raise BadRequest(str(e), "device") from None
                    self._ipc_targets = (targets, msgspec.json.encode(targets), keep)
        return web.Response(body=self._ipc_targets[1], content_type="application/json")

    async def init_weights_update_group(self, request) -> web.Response:
        self._single_rank("/init_weights_update_group (weights.transport = \"nccl\")")
        b = decode_body(await request.read(), P.InitWeightsUpdateGroupReq, "init_weights_update_group")
        try:
            await asyncio.to_thread(self.groups.init, b.master_address, b.master_port, b.rank_offset,
                                    b.world_size, b.group_name, b.backend)
        except (ValueError, RuntimeError) as e:
            return _json({"success": False, "message": f"Failed to init group: {e}"}, 400)
        return _json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request) -> web.Response:
        b = decode_body(await request.read(), P.DestroyWeightsUpdateGroupReq, "destroy_weights_update_group")
        try:
            self.groups.destroy(b.group_name)
            self._bucket_next.pop(b.group_name, None)
        except ValueError as e:
            return _json({"success": False, "message": str(e)}, 400)
        return _json({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weights_from_distributed(self, request) -> web.Response:
        self._single_rank("/update_weights_from_distributed")
        b = decode_body(await request.read(), P.UpdateWeightsFromDistributedReq,
                        "update_weights_from_distributed")
        t0 = time.perf_counter()
        if b.bucket_seq is None:
            return await self._receive(b, t0)
        # Several calls may be in flight (the trainer does not wait for answers between
        # broadcasts): receives are posted strictly in bucket_seq order, which is broadcast order.
        group, seq = b.group_name, b.bucket_seq
        async with self._bucket_turn:
            if seq < 0:
                raise BadRequest(f"bucket_seq: {seq} must be >= 0", "bucket_seq")
            if seq == 0:
                self._bucket_next[group] = 0
            try:
                await asyncio.wait_for(self._bucket_turn.wait_for(
                    lambda: self._bucket_next.get(group) == seq), BUCKET_TURN_TIMEOUT_S)
            except asyncio.TimeoutError:
                return _json({"success": False, "message": f"bucket_seq {seq} of group {group!r}: "
                              f"bucket {seq - 1} never came within {BUCKET_TURN_TIMEOUT_S} s "
                              f"(next expected: {self._bucket_next.get(group)})"}, 400)
        try:
            return await self._receive(b, t0)
        finally:
            async with self._bucket_turn:
                if self._bucket_next.get(group) == seq:
                    self._bucket_next[group] = seq + 1
                self._bucket_turn.notify_all()

    async def _receive(self, b: P.UpdateWeightsFromDistributedReq, t0: float) -> web.Response:
        t1 = time.perf_counter()
        try:
            return await self._update(self.groups.receive, self.runner.model.weights, b.group_name,
                                      b.names, b.dtypes, b.shapes, b.load_format, b.flat_count,
                                      weight_version=b.weight_version, abort_all=b.abort_all_requests)
        finally:  # where a distributed update's time goes, logged at the version barrier
            t = self._recv_timing
            t["turn_wait_s"] = t.get("turn_wait_s", 0.0) + (t1 - t0)
            t["handler_s"] = t.get("handler_s", 0.0) + (time.perf_counter() - t1)

    async def update_weight_version(self, request) -> web.Response:
        b = decode_body(await request.read(), P.UpdateWeightVersionReq, "update_weight_version")
        if b.abort_all_requests:
            await self.scheduler.abort(None, "Aborted for a weight version update")
        async with self.scheduler.step_lock:
            try:  # the barrier after a pipelined distributed update: its last bucket lands here
                await self.scheduler.run_compute(self.groups.complete_pending, self.runner.model.weights)
            except (ValueError, KeyError, RuntimeError) as e:
                self.scheduler.flush_prefix_cache()
                return _json({"success": False, "message": f"Failed to complete the weight update: "
                              f"{e}", "new_version": self.scheduler.weight_version}, 400)
            self.scheduler.weight_version = b.new_version
            self.scheduler.flush_prefix_cache()  # a version barrier: the weights may have changed
        timing = {**self._recv_timing, **self.groups.take_timing()}
        self._recv_timing = {}
        if timing:
            log.info("weight version %s: distributed update %s", b.new_version,
                     " ".join(f"{k}={v * 1e3:.1f}ms" if k.endswith("_s") else f"{k}={v}"
                              for k, v in sorted(timing.items())))
        return _json({"success": True, "message": f"Weight version updated to {b.new_version}",
                      "new_version": b.new_version})

    async def get_weights_by_name(self, request) -> web.Response:
        raw = await request.read()
        if not raw and request.query.get("name"):
            raw = msgspec.json.encode({"name": request.query["name"]})
        b = decode_body(raw, P.GetWeightsByNameReq, "get_weights_by_name")
        try:
            self.runner.model.weights.full_shape(b.name)
        except KeyError as e:
            raise BadRequest(e.args[0], "name") from None
        async with self.scheduler.step_lock:  # at tp > 1 a gather: one command among the steps
            head = await self.scheduler.run_compute(
                lambda: self.runner.full_tensor(b.name).detach().float().reshape(-1)[
                    :b.truncate_size].cpu().tolist())
        return _json(head)

    async def weights_checksum(self, request) -> web.Response:
        """Extension: {"algorithm", "dtype", "weight_version", "checksums": {name: digest}}.

        `?algorithm=sha256` (the default) or `device` (miles.weights.checks.device_digest, on the
        engine's device: milliseconds for a 7B model, so generation barely stalls)."""
        names = [n for n in request.query.get("names", "").split(",") if n]
        algorithm = request.query.get("algorithm", "sha256")
        if algorithm not in W.CHECKSUMS:
            raise BadRequest(f"algorithm: {algorithm!r} is not one of {', '.join(W.CHECKSUMS)}",
                             "algorithm")
        try:
            async with self.scheduler.step_lock:
                await self.scheduler.run_compute(self.groups.complete_pending, self.runner.model.weights)
                sums = await self.scheduler.run_compute(self.runner.checksums, names, algorithm)
        except KeyError as e:
            raise BadRequest(e.args[0], "names") from None
        return _json({"algorithm": algorithm, "dtype": self.args.dtype,
                      "weight_version": self.scheduler.weight_version, "checksums": sums})
