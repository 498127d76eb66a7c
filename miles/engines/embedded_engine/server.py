"""The aiohttp app: SGLang's native HTTP routes on top of the scheduler.

Design decisions:
- Routes, bodies and response shapes are SGLang's (reference: integration.md section 1), so the
  client, smg and the TITO server cannot tell this engine from SGLang. Extensions are additive and
  named as such: `/weights_checksum`, `/update_weights_from_delta` (disk-delta updates, delta.py),
  `load_format: "miles_cuda_ipc"` on `/update_weights_from_tensor` (colocated CUDA IPC), a
  pipelined `load_format: "flattened_bucket"` distributed update (weights.py) with an optional
  `bucket_seq` that orders receives so a trainer may keep several calls in flight, and extra keys in
  `/model_info` (`num_hidden_layers`, `num_experts_per_tok`, ...) that let a client decode routed
  experts without reading config.json; the P2P weight routes (p2p_routes.py).
- At --tp-size > 1 (tp.py) `/server_info` says `tp_size: N`; `/weights_checksum` and
  `/get_weights_by_name` answer for the full tensors (gathered to rank 0 under the step lock);
  the one-rank update paths (tensor, distributed, delta) answer 400 naming `tp_size`.
- Bad input gets a 400 `{"error": {"message", "type", "param", "code"}}` naming the field and value
  and nothing is queued; an exception inside a handler becomes a 500 with the same shape. The
  scheduler keeps running either way.
- Bounds on `/generate` (a 400 naming the field, the value and the limit; all checked before a
  text is tokenized or a request is built, so refusing costs microseconds):
  prompts per call and prompts x `n` <= `--max-batch-size` (1024); `sampling_params.n` <=
  `--max-n` (64); `top_logprobs_num` in [0, `--max-top-logprobs-num`] (64); prompt positions with
  logprobs (`logprob_start_len`) <= `--max-prompt-logprob-tokens` (4096; each is a vocabulary-wide
  fp32 logits row); entries of `stop`, `stop_token_ids` and `logit_bias` <= `--max-stop` (64);
  prompt tokens < the context length and prompt + `max_new_tokens` <= the context length and the
  KV pool (SGLang's checks and wording).
- A client that disconnects from `/generate` aborts its request (handler cancellation), like SGLang.
- `/health` is cheap (the scheduler task is alive and not wedged); `/health_generate` runs a real
  one-token generation, except while generation is paused, where it answers 200 at once: a paused
  engine is healthy and a health probe must not stall behind a weight update.
- Load endpoints (`/get_load`, `/v1/loads`, `/metrics`) are answered from counters, no locking,
  because smg polls them continuously.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import time
import uuid

import msgspec
import numpy as np
from aiohttp import web

from miles.engines.embedded_engine import protocol as P
from miles.engines.embedded_engine import weights as W
from miles.engines.embedded_engine.delta import DeltaUpdates
from miles.engines.embedded_engine.protocol import BadRequest, RequestLimits, decode_body
from miles.engines.embedded_engine.request import Request
from miles.engines.embedded_engine.responses import error_response as _error
from miles.engines.embedded_engine.responses import json_response as _json
from miles.engines.embedded_engine.scheduler import Scheduler
from miles.engines.embedded_engine.server_weights import WeightRoutes

log = logging.getLogger(__name__)

ENGINE_VERSION = "0.5.23-miles-embedded"  # SGLang API level we mirror


class EngineServer(WeightRoutes):
    def __init__(self, runner, tokenizer, args):
        self.runner = runner
        self.tokenizer = tokenizer
        self.args = args
        self.model_path = args.model_path
        self.served_model_name = args.served_model_name or args.model_path
        self.rng = random.Random(args.random_seed)
        self.limits = RequestLimits(max_n=args.max_n, max_batch_size=args.max_batch_size,
                                    max_top_logprobs_num=args.max_top_logprobs_num,
                                    max_prompt_logprob_tokens=args.max_prompt_logprob_tokens,
                                    max_stop=args.max_stop)
        self.started_s = time.time()
        shape = runner.shape
        eos = set(shape.eos_token_ids)
        from miles.engines.embedded_engine.shapes import read_generation_eos
        eos.update(read_generation_eos(args.model_path))
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.scheduler = Scheduler(runner, max_running_requests=args.max_running_requests,
                                   max_prefill_tokens=args.max_prefill_tokens,
                                   weight_version=args.weight_version,
                                   stats_interval_s=args.log_stats_interval_s,
                                   prefill_interval=args.prefill_interval_steps,
                                   inline_steps=args.inline_steps,
                                   prefix_cache=not args.disable_radix_cache,
                                   prefix_cache_max_share=args.prefix_cache_max_share,
                                   detokenize=self._detok if tokenizer is not None else None)
        self.groups = W.UpdateGroups(runner.device)
        self._bucket_turn = asyncio.Condition()
        self._bucket_next: dict[str, int] = {}  # group -> the bucket_seq whose turn it is
        self._recv_timing: dict[str, float] = {}
        self.weights_serial = 0  # bumped by every weight change (a prepared delta checks it)
        self.delta = DeltaUpdates(self)
        self._ipc_targets = None  # (cuda_ipc.IpcTargets, its JSON, the shared flat tensors kept)

    def _detok(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 31)
        r = app.router
        r.add_route("*", "/generate", self.generate)
        for path in ("/health", "/ready"):
            r.add_get(path, self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/models", self.v1_models)
        r.add_get("/version", lambda _: _json({"version": ENGINE_VERSION}))
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_get("/loads", self.v1_loads)
        r.add_get("/metrics", self.metrics)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_get("/ipc_weight_targets", self.ipc_weight_targets)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_get("/weights_checksum", self.weights_checksum)
        r.add_post("/update_weights_from_delta", self.update_weights_from_delta)
        from miles.engines.embedded_engine.p2p_routes import P2PRoutes
        P2PRoutes(self).add_to(r)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        app.middlewares.append(_errors_middleware)
        return app

    async def _on_startup(self, _app) -> None:
        self.scheduler.start()

    async def _on_cleanup(self, _app) -> None:
        await self.scheduler.close()
        if self.runner.tp is not None:  # the TP workers: told to stop, then ended
            try:
                self.runner.stop_workers()
            except Exception:  # noqa: BLE001 - a worker may be gone already
                pass
            if getattr(self, "tp_workers", None) is not None:
                self.tp_workers.stop()

    # ---- /generate -------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), P.GenerateRequest, "generate")
        reqs, is_batch = self._build_requests(body)
        for r in reqs:
            if r.rid in self.scheduler.by_rid:
                raise BadRequest(f"rid: {r.rid!r} is already in flight", "rid")
        if body.stream:  # one event for the whole call: the stream wakes once per step, not per request
            progress = asyncio.Event()
            for r in reqs:
                r.progress = progress
        for r in reqs:
            self.scheduler.submit(r)
        try:
            if body.stream:
                return await self._stream(request, reqs, body)
            await asyncio.gather(*(r.done.wait() for r in reqs))
        except asyncio.CancelledError:
            for r in reqs:  # the client went away: don't keep generating for nobody
                if not r.finished:
                    asyncio.get_running_loop().create_task(self.scheduler.abort(r.rid, "client disconnected"))
            raise
        out = [self._response(r, body) for r in reqs]
        return _json(out if is_batch else out[0])

    async def _stream(self, request, reqs: list[Request], body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        # The requests share one progress event (set in `generate`); a request gets a chunk when
        # it has new tokens or has finished. Waiting on that one event directly (not on a task per
        # request) resumes this handler in the loop iteration right after the step that set it,
        # so a CPU engine that runs its steps on the event loop still streams every token.
        progress = reqs[0].progress
        pending, sent = list(reqs), {id(r): 0 for r in reqs}  # tokens already streamed
        while pending:
            progress.clear()
            for r in list(pending):
                if len(r.output_ids) > sent[id(r)] or r.finished:
                    sent[id(r)] = len(r.output_ids)
                    chunk = self._response(r, body, streaming=True)
                    await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                    if r.finished:
                        pending.remove(r)
            if pending:
                await progress.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _build_requests(self, body: P.GenerateRequest) -> tuple[list[Request], bool]:
        shape, lim = self.runner.shape, self.limits
        if body.input_embeds is not None:
            raise BadRequest("input_embeds: not supported by the embedded engine", "input_embeds")
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("generate: exactly one of text / input_ids is required", "input_ids")
        if body.input_ids is not None:
            is_batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
            prompts = body.input_ids if is_batch else [body.input_ids]
            if len(prompts) > lim.max_batch_size:
                raise lim.over("input_ids", len(prompts), "max_batch_size", " prompts")
            for b, p in enumerate(prompts):
                where = f"input_ids[{b}]" if is_batch else "input_ids"
                if not isinstance(p, list) or any(isinstance(t, list) for t in p):
                    raise BadRequest(f"{where}: mixes lists and ints; expected list[int] or "
                                     "list[list[int]]", "input_ids")
        else:
            is_batch = isinstance(body.text, list)
            texts = body.text if is_batch else [body.text]
            if len(texts) > lim.max_batch_size:
                raise lim.over("text", len(texts), "max_batch_size", " prompts")
            if self.tokenizer is None:
                raise BadRequest("text: this engine runs without a tokenizer; send input_ids", "text")
            prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        n_prompts = len(prompts)
        params = body.sampling_params
        if isinstance(params, list):
            if len(params) != n_prompts:
                raise BadRequest(f"sampling_params: {len(params)} entries for {n_prompts} prompts",
                                 "sampling_params")
            plist = params
        else:
            plist = [params or P.SamplingParams()] * n_prompts

        def per(value, i, name, default):
            if isinstance(value, list):
                if len(value) != n_prompts:
                    raise BadRequest(f"{name}: {len(value)} entries for {n_prompts} prompts", name)
                return value[i]
            return default if value is None else value

        if body.return_routed_experts and not self.args.enable_return_routed_experts:
            raise BadRequest("return_routed_experts: the server was started without "
                             "--enable-return-routed-experts", "return_routed_experts")
        if isinstance(body.rid, list) and len(body.rid) != n_prompts:
            raise BadRequest(f"rid: {len(body.rid)} entries for {n_prompts} prompts", "rid")
        # The fan-out first: n is what turns a tiny body into a million requests.
        for i, p in enumerate(plist):
            if p.n > lim.max_n:
                where = f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params"
                raise lim.over(f"{where}.n", p.n, "max_n")
        samples = sum(p.n for p in plist)
        if samples > lim.max_batch_size:
            raise lim.over("sampling_params.n", samples, "max_batch_size",
                           f" requests ({n_prompts} prompts x n)")
        sps = []
        for i in range(n_prompts):
            sp = msgspec.structs.replace(plist[i])
            where = f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params"
            sp.check(shape.vocab_size, where, lim)
            top_num = per(body.top_logprobs_num, i, "top_logprobs_num", 0)
            if not 0 <= top_num <= lim.max_top_logprobs_num:
                raise BadRequest(f"top_logprobs_num: {top_num} is outside [0, "
                                 f"{lim.max_top_logprobs_num}] (--max-top-logprobs-num)",
                                 "top_logprobs_num")
            sps.append(sp)
        reqs: list[Request] = []
        for i, ids in enumerate(prompts):
            sp = sps[i]
            self._check_prompt(ids, sp, f"input_ids[{i}]" if is_batch else "input_ids")
            start_len = per(body.logprob_start_len, i, "logprob_start_len", -1)
            if start_len >= len(ids):
                raise BadRequest(f"logprob_start_len: {start_len} must be < the prompt length "
                                 f"{len(ids)}", "logprob_start_len")
            wants_prompt_lps = start_len >= 0 and per(body.return_logprob, i, "return_logprob", False)
            if wants_prompt_lps and len(ids) - start_len > lim.max_prompt_logprob_tokens:
                raise lim.over("logprob_start_len", start_len, "max_prompt_logprob_tokens",
                               f" asks for logprobs of {len(ids) - start_len} prompt tokens, which")
            if not 0 <= body.routed_experts_start_len <= len(ids):
                raise BadRequest(f"routed_experts_start_len: {body.routed_experts_start_len} "
                                 f"outside [0, {len(ids)}]", "routed_experts_start_len")
            base_rid = body.rid[i] if isinstance(body.rid, list) else (
                f"{body.rid}_{i}" if (body.rid and is_batch) else body.rid)
            for j in range(sp.n):
                rid = base_rid or uuid.uuid4().hex
                if sp.n > 1:
                    rid = f"{rid}_{j}"
                seed = sp.sampling_seed if sp.sampling_seed is not None else self.rng.getrandbits(63)
                stops = set(sp.stop_token_ids or ())
                if not sp.ignore_eos:
                    stops |= self.eos_ids
                stop_strs = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
                reqs.append(Request(
                    rid=rid, input_ids=list(ids), params=sp, seed=seed + j,
                    max_new_tokens=sp.max_new_tokens if sp.max_new_tokens is not None
                    else self.runner.context_length - len(ids),
                    return_logprob=bool(per(body.return_logprob, i, "return_logprob", False)),
                    logprob_start_len=start_len,
                    top_logprobs_num=int(per(body.top_logprobs_num, i, "top_logprobs_num", 0)),
                    return_routed_experts=body.return_routed_experts,
                    routed_experts_start_len=body.routed_experts_start_len, stream=body.stream,
                    stop_token_ids=frozenset(stops), stop_strs=stop_strs))
        return reqs, is_batch or len(reqs) > 1

    def _check_prompt(self, ids: list[int], sp: P.SamplingParams, where: str) -> None:
        V, ctx = self.runner.shape.vocab_size, self.runner.context_length
        if not ids:
            raise BadRequest(f"{where}: empty prompt", "input_ids")
        if min(ids) < 0 or max(ids) >= V:  # min/max run in C; the generator only on a bad prompt
            bad = next(t for t in ids if not 0 <= t < V)
            raise BadRequest(f"{where}: token id {bad} is out of the vocabulary [0, {V})", "input_ids")
        if len(ids) >= ctx:
            raise BadRequest(f"{where}: the input ({len(ids)} tokens) is longer than the model's "
                             f"context length ({ctx} tokens)", "input_ids")
        new = sp.max_new_tokens if sp.max_new_tokens is not None else 0
        if len(ids) + new > ctx:  # SGLang's wording, with the field in front
            raise BadRequest(f"sampling_params.max_new_tokens: {new}: Requested token count exceeds "
                             f"the model's maximum context length of {ctx} tokens. You requested a "
                             f"total of {len(ids) + new} tokens: {len(ids)} tokens from the input "
                             f"messages and {new} tokens for the completion. Please reduce the "
                             "number of tokens in the input messages or the completion to fit "
                             "within the limit.", "sampling_params.max_new_tokens")
        if len(ids) + new > self.runner.max_total_tokens:
            raise BadRequest(f"{where}: {len(ids)} input + {new} new tokens exceed the KV pool "
                             f"(max_total_tokens={self.runner.max_total_tokens})", "input_ids")

    def _response(self, r: Request, body: P.GenerateRequest, streaming: bool = False) -> dict:
        sp = r.params
        text = ""
        if self.tokenizer is not None:
            text = self._detok(r.output_ids, sp.skip_special_tokens)
            if r.matched_stop_str and not sp.no_stop_trim:
                cut = text.find(r.matched_stop_str)
                text = text[:cut] if cut >= 0 else text
        meta: dict = {
            "id": r.rid, "finish_reason": r.finish,
            "prompt_tokens": len(r.input_ids), "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens, "weight_version": self.scheduler.weight_version,
            "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in r.spans],
            "num_retractions": r.num_retractions,
            "e2e_latency": (r.finished_s or time.time()) - r.created_s, "dp_rank": 0,
            # provenance (miles/rl/provenance.py): who answered; the pid changes on a restart
            "engine_id": f"{self.args.host}:{self.args.port}", "engine_incarnation": os.getpid(),
        }
        if r.return_logprob:
            tok_text = (lambda t: self._detok([t], False)) if (
                body.return_text_in_logprobs and self.tokenizer is not None) else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, tok_text(t)] for lp, t in
                                             zip(r.output_logprobs, r.output_ids)]
            meta["output_token_logprobs_length"] = len(r.output_ids)
            if r.input_logprobs is not None:
                first = max(r.logprob_start_len, 0)
                ids = r.input_ids[first:]
                meta["input_token_logprobs"] = [[lp, t, tok_text(t)] for lp, t in
                                                zip(r.input_logprobs, ids)]
            else:
                meta["input_token_logprobs"] = []
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, tok_text(t)] for lp, t in top]
                                               for top in r.output_top]
        if r.return_routed_experts:
            if r.routed is None:
                meta["routed_experts"] = None
            else:
                end = len(r.input_ids) + len(r.output_ids) - 1
                arr = np.ascontiguousarray(r.routed[r.routed_experts_start_len:end], dtype="<i4")
                meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
        out = {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}
        if body.return_prompt_token_ids:
            out["prompt_token_ids"] = list(r.input_ids)
        return out

    # ---- health / info / load --------------------------------------------------------------

    async def health(self, _request) -> web.Response:
        sch = self.scheduler
        if not sch.alive():
            return _error("scheduler is not running", 503)
        return web.Response(status=200)

    async def health_generate(self, _request) -> web.Response:
        if self.scheduler.paused:
            return web.Response(status=200)
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                      params=P.SamplingParams(max_new_tokens=1, temperature=0.0), seed=0,
                      max_new_tokens=1)
        self.scheduler.submit(req)
        try:
            await asyncio.wait_for(req.done.wait(), timeout=20.0)
        except asyncio.TimeoutError:
            await self.scheduler.abort(req.rid, "health check timed out")
            return _error("health generation timed out after 20 s", 503)
        return web.Response(status=200)

    def _model_info(self) -> dict:
        s, cfg = self.runner.shape, self.runner.hf_config
        return {
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": self.args.tokenizer_path or self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.scheduler.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": s.model_type,
            "architectures": s.architectures or list(getattr(cfg, "architectures", None) or []),
            # extensions (not in SGLang): enough to decode routed experts and size requests
            "engine": "miles-embedded", "vocab_size": s.vocab_size,
            "context_length": self.runner.context_length, "num_hidden_layers": s.num_layers,
            "num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok,
            "dtype": self.args.dtype, "device": str(self.runner.device),
            "quantization": getattr(self.args, "quantization", None),
        }

    async def model_info(self, _request) -> web.Response:
        return _json(self._model_info())

    async def server_info(self, _request) -> web.Response:
        a = self.args
        info = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, type(None)))}
        info.update({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "version": ENGINE_VERSION, "startup_time": self.started_s, "dp_size": 1,
            "tp_size": self.runner.tp.size if self.runner.tp is not None else 1,
            "pp_size": 1, "ep_size": 1, "max_total_num_tokens": self.runner.max_total_tokens,
            "context_length": self.runner.context_length, "page_size": 1,
            "max_running_requests": a.max_running_requests, "weight_version": self.scheduler.weight_version,
            "enable_return_routed_experts": a.enable_return_routed_experts,
            "disaggregation_mode": "null", "status": "ready", "engine": "miles-embedded",
            "internal_states": [{**self.scheduler.load(), "dp_rank": 0,
                                 "cuda_graph": self.runner.use_graphs}],
        })
        return _json(info)

    async def v1_models(self, _request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(self.started_s),
            "owned_by": "sglang", "root": self.model_path,
            "max_model_len": self.runner.context_length}]})

    async def get_load(self, _request) -> web.Response:
        ld = self.scheduler.load()
        return _json([{"dp_rank": 0, "num_reqs": ld["num_running_reqs"] + ld["num_waiting_reqs"],
                       "num_waiting_reqs": ld["num_waiting_reqs"], "num_tokens": ld["num_tokens"]}])

    async def v1_loads(self, _request) -> web.Response:
        ld = self.scheduler.load()
        entry = {"dp_rank": 0, "num_running_reqs": ld["num_running_reqs"],
                 "num_waiting_reqs": ld["num_waiting_reqs"],
                 "num_total_reqs": ld["num_running_reqs"] + ld["num_waiting_reqs"],
                 "num_used_tokens": ld["num_used_tokens"],
                 "max_total_num_tokens": ld["max_total_num_tokens"], "token_usage": ld["token_usage"],
                 "max_running_requests": self.args.max_running_requests}
        return _json({"timestamp": time.time(), "dp_rank_count": 1, "loads": [entry],
                      "aggregate": {k: v for k, v in entry.items() if k != "dp_rank"}})

    async def metrics(self, _request) -> web.Response:
        ld, st = self.scheduler.load(), self.scheduler.stats
        label = f'{{model_name="{self.served_model_name}"}}'
        gauges = {"num_running_reqs": ld["num_running_reqs"], "num_queue_reqs": ld["num_waiting_reqs"],
                  "num_used_tokens": ld["num_used_tokens"], "token_usage": ld["token_usage"],
                  "max_total_num_tokens": ld["max_total_num_tokens"],
                  "cache_hit_rate": ld["cache_hit_rate"]}
        counters = {"generation_tokens_total": st["generated_tokens"],
                    "prompt_tokens_total": st["prompt_tokens"], "cached_tokens_total": st["cached_tokens"],
                    "num_requests_total": st["finished"] + st["aborted"],
                    "num_aborted_requests_total": st["aborted"], "num_retractions_total": st["retractions"]}
        lines = []
        for k, v in gauges.items():
            lines += [f"# TYPE sglang:{k} gauge", f"sglang:{k}{label} {v}"]
        for k, v in counters.items():
            lines += [f"# TYPE sglang:{k} counter", f"sglang:{k}{label} {v}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # ---- control ---------------------------------------------------------------------------

    async def pause_generation(self, request) -> web.Response:
        body = decode_body(await request.read(), P.PauseGenerationReq, "pause_generation")
        await self.scheduler.pause(body.mode)
        weights = self.runner.model.weights
        if weights.device.type == "cuda":  # idle device: a colocated trainer may write the weights now
            await self.scheduler.run_compute(W.sync_device, weights)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request) -> web.Response:
        decode_body(await request.read(), P.ContinueGenerationReq, "continue_generation")
        await self.scheduler.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request) -> web.Response:
        body = decode_body(await request.read(), P.AbortReq, "abort_request")
        if body.abort_all:
            await self.scheduler.abort(None)
        elif body.rid:
            await self.scheduler.abort(body.rid)
        return web.Response(status=200)

    async def flush_cache(self, _request) -> web.Response:
        sch = self.scheduler
        if sch.running or sch.waiting:
            return web.Response(status=400, text="Cache not flushed: there are running or waiting "
                                f"requests ({len(sch.running)} running, {len(sch.waiting)} waiting).")
        async with sch.step_lock:
            sch.flush_prefix_cache()
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will not be performed.)\n")

@web.middleware
async def _errors_middleware(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(e.message, e.status, e.param)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never take the server down for one bad call
        log.exception("%s %s failed", request.method, request.path)
        return _error(f"{type(e).__name__}: {e}", 500)
