"""Continuous batching: requests join and leave the running batch at every step.

Design decisions:
- One asyncio task owns all scheduling state; weight copies and other device work run on one
  dedicated compute thread (`run_compute`), and so do the steps' forward and sampling on CUDA. A
  step holds `step_lock`; control operations (pause, abort, weight updates) take the same lock, so
  they always land *between* two steps and never see a half-applied batch. Nothing else mutates
  the batch.
- On CPU the steps' forward and sampling run inline on the event loop (`inline_steps`): the hop
  to the thread and back costs about as much as a small step, and two threads that both run
  parallel torch ops (two OpenMP pools) contend on a small machine. bench/engine.py, tiny model,
  2 cores, two runs each: batch 8, 1.1 ms per step inline against 1.6-2.1 ms on the thread with
  1 torch thread and 3.0-3.5 ms with 2; batch 32 with 2 torch threads, 1.7-2.0 against 3.1-3.2
  ms (with 1, 2.6-3.1 both ways). The event loop is then blocked for a step (milliseconds);
  handlers run between steps. CUDA keeps the thread: its steps mostly wait on the device, and
  that is the configuration its GPU tests and benchmarks ran. `--inline-steps prefill` (eager
  prefills on the loop, so they never wait for the GIL behind HTTP handlers) was tried in the RL
  bench on 2x H200 (0.2B): prefill share of the engine's time 17.8% against 19.5%, fully-async
  2.04x against 2.31x, one run each; `auto` keeps every CUDA step on the thread.
  A prefill of more than `INLINE_MAX_TOKENS` (2048) tokens still goes to the thread: seconds
  of a blocked loop would fail the gateway's health checks (every 2 s, 2 failures).
- Each iteration runs either one prefill (newly admitted or recomputed requests, up to
  `max_prefill_tokens`) or one decode step over every running request, like SGLang's
  prefill/decode alternation. A request admitted mid-flight joins the next decode step; a finished
  one frees its KV slots immediately.
- While requests decode, arrivals are prefilled every `prefill_interval` decode steps (default 4,
  `--prefill-interval-steps`), or at once when max(8, running/4) of them wait: an RL rollout
  submits groups one at a time, and prefilling each the moment it came stalled every running
  request once per group. Measured on the RL bench (2-core CPU, 4 runs each): fully-async
  0.228 s/step with 4 against 0.238 with 0 (prefill at once); a new request waits at most 4 decode
  steps longer for its first token.
- Admission is bounded by `max_running_requests`, free request rows and free KV slots (keeping one
  slot of headroom per running request). If the pool still runs dry during decode, the newest
  requests are *retracted* (KV freed, put back at the head of the queue, recomputed later), as
  SGLang does; `num_retractions` counts it.
- Pause modes (SGLang semantics): `abort` finishes every in-flight and queued request with
  finish_reason abort (partial output included); `in_place` stops scheduling and keeps every
  request and its KV; `retract` keeps the requests but frees their KV, which is recomputed with
  the then-current weights after `continue_generation`. While paused, new requests queue.
- Weight versions: every output token records the version of the weights that produced its logits;
  runs of equal versions become `weight_versions` spans `{"version", "start", "end"}` (half-open
  ranges of output positions), so a request that crossed an update reports both versions.
- Every `stats_interval_s` (`--log-stats-interval-s`, default 30; 0: never) one INFO line says
  where the time went since the last one, like SGLang's decode log: decode steps, average batch,
  ms per step, prefills and their time, paused time, tokens/s, CUDA graphs captured meanwhile.
- Routed experts (R3): position p's routing is recorded when token p is forwarded (prefill for
  prompt positions, decode for outputs); recomputation after a retract overwrites them with the
  routing under the new weights, as SGLang's per-slot capture does. Positions served from the
  prefix cache take the routing recorded when the cache's copy was forwarded.
- Prefix cache (prefix_cache.py, on unless `--disable-radix-cache`): admission matches each
  request's longest cached prefix (at most all but its last token, and not past the first
  position whose prompt logprobs it wants), locks it and prefills only the rest; a prefilled
  request's prompt, and a finished request's whole KV, go into the cache. Admission and decode
  evict unreferenced cache entries before retracting anything; a retracted request unlocks its
  prefix and frees only its own slots. Every weight update resets the cache (server.py).
  `cached_tokens` counts prompt tokens served from the cache at a request's first admission
  (recomputes after a retract are not counted), and the hit rate is cached / all prompt tokens
  since start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from miles.engines.embedded_engine.prefix_cache import NO_HIT, PrefixCache
from miles.engines.embedded_engine.request import Request
from miles.engines.embedded_engine.runner import ModelRunner
from miles.engines.embedded_engine.sampling import SamplingBatch, device_uniforms, sample

log = logging.getLogger(__name__)

INLINE_MAX_TOKENS = 2048  # a step over more tokens runs on the compute thread even if inline (see above)
INLINE_MODES = ("auto", "all", "prefill", "none")


class _Window:
    """Counters since the last stats line."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.sums: dict[str, float] = {}
        self.tokens0 = self.captured0 = 0
        self.capture_s0 = 0.0

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def get(self, key: str) -> float:
        return self.sums.get(key, 0.0)

    def age(self) -> float:
        return time.perf_counter() - self.t0


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_running_requests: int, max_prefill_tokens: int,
                 weight_version: str, detokenize=None, stats_interval_s: float = 30.0,
                 prefill_interval: int = 4, inline_steps: str = "auto", prefix_cache: bool = True,
                 prefix_cache_max_share: float = 0.5):
        self.runner = runner
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.detokenize = detokenize  # ids -> str, for stop strings; None without a tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.paused: str | None = None
        self.step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-compute",
                                           initializer=self._init_compute_thread)
        self._task: asyncio.Task | None = None
        self.last_step_s = time.time()
        self.stats = {"steps": 0, "prefills": 0, "generated_tokens": 0, "finished": 0,
                      "aborted": 0, "retractions": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self.layers_topk = (runner.shape.num_layers, runner.shape.num_experts_per_tok)
        self.stats_interval_s = stats_interval_s
        if prefill_interval < 0:
            raise ValueError(f"prefill_interval: {prefill_interval} must be >= 0 (0: prefill arrivals at once)")
        self.prefill_interval = prefill_interval
        # Which steps' forward and sampling run on the event loop itself (see the docstring)
        if inline_steps not in INLINE_MODES:
            raise ValueError(f"inline_steps: {inline_steps!r} is not one of {', '.join(INLINE_MODES)}")
        if inline_steps == "auto":
            inline_steps = "all" if runner.device.type == "cpu" else "none"
        self.inline_steps = inline_steps
        self._decodes_since_prefill = 0
        self._window = _Window()
        if not 0.0 <= prefix_cache_max_share <= 1.0:
            raise ValueError(f"prefix_cache_max_share: {prefix_cache_max_share} is not in [0, 1]")
        self.cache = PrefixCache(runner.kv, int(prefix_cache_max_share * runner.max_total_tokens)) \
            if prefix_cache else None
        self._prefilling: list[Request] = []  # admitted, not yet running (an error finishes them)

    # ---- lifecycle -------------------------------------------------------------------------

    def _init_compute_thread(self) -> None:
        # The current CUDA device (and so current_stream, graph capture, NCCL) is per thread.
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._compute.shutdown(wait=True, cancel_futures=True)

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def run_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def _timed_compute(self, key: str, fn, tokens: int, prefill: bool):
        """A step's forward and sampling over `tokens` tokens: on the compute thread, or on the
        event loop where `inline_steps` says so, unless over `INLINE_MAX_TOKENS` tokens; its own
        time is added to the stats window under `key` (beside the step's wall time, it shows what
        the hop to the thread and the GIL cost)."""
        def timed():
            t = time.perf_counter()
            return fn(), time.perf_counter() - t
        inline = (self.inline_steps == "all" or (prefill and self.inline_steps == "prefill")) \
            and tokens <= INLINE_MAX_TOKENS
        out, seconds = timed() if inline else await self.run_compute(timed)
        self._window.add(key, seconds)
        return out

    # ---- requests --------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if req.rid in self.by_rid:
            raise ValueError(f"rid: {req.rid!r} is already in flight")
        if req.return_routed_experts and self.runner.shape.is_moe:
            L, k = self.layers_topk
            # -1 (SGLang's "no expert") until a forward writes a row: never a silent expert 0
            req.routed = np.full((len(req.input_ids) + req.max_new_tokens, L, k), -1, dtype=np.int32)
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        self._wake.set()

    async def abort(self, rid: str | None = None, message: str = "Aborted by request") -> int:
        """Abort one request (by rid) or all; returns how many were aborted."""
        async with self.step_lock:
            targets = list(self.by_rid.values()) if rid is None else (
                [self.by_rid[rid]] if rid in self.by_rid else [])
            for req in targets:
                self._finish(req, {"type": "abort", "message": message, "status_code": None,
                                   "err_type": None})
            return len(targets)

    def flush_prefix_cache(self) -> None:
        """Drop the prefix cache (weights changed, or /flush_cache). Call under `step_lock`."""
        if self.cache is not None:
            self.cache.reset()

    # ---- pause / continue ------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        async with self.step_lock:
            self.paused = mode
            if mode == "abort":
                for req in list(self.by_rid.values()):
                    self._finish(req, {"type": "abort", "message": "Generation paused (abort)",
                                       "status_code": None, "err_type": None})
            elif mode == "retract":
                for req in reversed(self.running):
                    self._release_kv(req)
                    req.num_retractions += 1
                    self.stats["retractions"] += 1
                    self.waiting.appendleft(req)
                self.running.clear()

    async def resume(self) -> None:
        async with self.step_lock:
            self.paused = None
        self._wake.set()

    # ---- the loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self.last_step_s = time.time()
            if self.stats_interval_s and self._window.age() >= self.stats_interval_s:
                self._log_window()
            if self.paused or not (self.waiting or self.running):
                self._wake.clear()
                if self.paused or not (self.waiting or self.running):
                    t = time.perf_counter()
                    await self._wake.wait()
                    self._window.add("paused_s" if self.paused else "idle_s", time.perf_counter() - t)
                continue
            async with self.step_lock:
                if self.paused:
                    continue
                try:
                    t = time.perf_counter()
                    batch = self._admit() if self._prefill_due() else []
                    if batch:
                        self._decodes_since_prefill = 0
                        await self._prefill(batch)
                        self._window.add("prefill_s", time.perf_counter() - t)
                        self._window.add("prefills", 1)
                        self._window.add("prefill_reqs", len(batch))
                    elif self.running:
                        n = len(self.running)
                        ctx = sum(len(r.input_ids) + len(r.output_ids) for r in self.running)
                        await self._decode()
                        self._decodes_since_prefill += 1
                        self._window.add("decode_s", time.perf_counter() - t)
                        self._window.add("decodes", 1)
                        self._window.add("decode_rows", n)
                        self._window.add("decode_ctx", ctx)
                except Exception as e:  # a bug in one step must not kill the server
                    log.exception("engine step failed; aborting the requests of that step")
                    for req in list(self.running) + self._prefilling:
                        self._finish(req, {"type": "abort", "message": f"engine error: {e!r}",
                                           "status_code": 500, "err_type": "InternalServerError"})
                finally:
                    self._prefilling = []
            await asyncio.sleep(0)  # let HTTP handlers and control calls in between steps

    def _log_window(self) -> None:
        w, self._window = self._window, _Window()
        captured = self.runner.graphs.captured if self.runner.graphs is not None else 0
        g = w.get
        steps = g("decodes")
        log.info("engine stats over %.1f s: decode %d steps, batch %.1f, %.2f ms/step | prefill %d "
                 "(%d requests, %.1f ms) | paused %.1f ms, idle %.1f ms | %.0f tok/s | "
                 "running %d, waiting %d | prefix cache hit rate %.3f, %d tokens | cuda graphs captured %d (%.1f ms, %d in all) | "
                 "compute thread: decode %.2f ms/step, prefill %.1f ms | context %.1f tokens/step",
                 w.age(), steps, g("decode_rows") / max(steps, 1), 1e3 * g("decode_s") / max(steps, 1),
                 g("prefills"), g("prefill_reqs"), 1e3 * g("prefill_s"), 1e3 * g("paused_s"),
                 1e3 * g("idle_s"), (self.stats["generated_tokens"] - w.tokens0) / max(w.age(), 1e-9),
                 len(self.running), len(self.waiting), self.cache_hit_rate(),
                 self.cache.tokens if self.cache else 0, captured - w.captured0,
                 1e3 * ((self.runner.graphs.capture_s if self.runner.graphs else 0.0) - w.capture_s0),
                 captured, 1e3 * g("decode_compute_s") / max(steps, 1), 1e3 * g("prefill_compute_s"),
                 g("decode_ctx") / max(steps, 1))
        self._window.tokens0 = self.stats["generated_tokens"]
        self._window.captured0 = captured
        self._window.capture_s0 = self.runner.graphs.capture_s if self.runner.graphs else 0.0

    def _prefill_due(self) -> bool:
        """Prefill now, or decode `prefill_interval` more steps first (collecting arrivals into one
        larger prefill)? Always when nothing is decoding or enough requests wait."""
        return (not self.running or self._decodes_since_prefill >= self.prefill_interval
                or len(self.waiting) >= max(8, len(self.running) // 4))

    def _admit(self) -> list[Request]:
        kv = self.runner.kv
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_running and kv.free_rows:
            req = self.waiting[0]
            hit = self._match(req)
            need = len(req.input_ids) + len(req.output_ids) - hit.length
            if batch and tokens + need > self.max_prefill_tokens:
                break
            # one free slot for the next token of every request that will be decoding
            headroom = len(self.running) + len(batch) + (req.max_new_tokens > len(req.output_ids))
            if hit.length:
                self.cache.lock(hit.node)  # before evicting: the hit itself must stay
            if kv.free_slots < need + headroom and self.cache is not None:
                self.cache.evict(need + headroom - kv.free_slots)
            if kv.free_slots < need + headroom:
                if hit.length:
                    self.cache.unlock(hit.node)
                break
            self.waiting.popleft()
            req.row = kv.alloc_row()
            req.slots = [np.concatenate([hit.slots, kv.alloc(need)])]
            if hit.length:
                req.prefix, req.prefix_len = hit.node, hit.length
                if req.routed is not None:
                    req.routed[:hit.length] = hit.routing
            req.kv_epoch = self.cache.epoch if self.cache is not None else -1
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = min(hit.length, len(req.input_ids))
                self.stats["prompt_tokens"] += len(req.input_ids)
                self.stats["cached_tokens"] += req.cached_tokens
            batch.append(req)
            tokens += need
        self._prefilling = batch
        return batch

    def _match(self, req: Request):
        """The request's longest usable cached prefix: at most all but its last token (one must be
        forwarded for the next token's logits), not past the first position whose prompt logprobs
        it wants, and only entries with routing if it records routed experts."""
        n = len(req.input_ids) + len(req.output_ids)
        if self.cache is None:
            return NO_HIT
        limit = n - 1
        if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return self.cache.match(req.all_tokens, limit, need_routing=req.routed is not None)

    def cache_hit_rate(self) -> float:
        return self.stats["cached_tokens"] / max(self.stats["prompt_tokens"], 1)

    def _release_kv(self, req: Request, cache: bool = False) -> None:
        """Free the request's KV: its own slots back to the pool, or (`cache`) into the prefix
        cache, unless its KV predates the last reset (it crossed a weight update)."""
        if not req.slots:
            return
        slots = np.concatenate(req.slots)
        if cache and self.cache is not None and req.kv_epoch == self.cache.epoch:
            routing = req.routed[:len(slots)] if req.routed is not None else None
            self.cache.insert(req.all_tokens[:len(slots)], slots, req.prefix_len, routing)
        else:
            self.runner.kv.free(slots[req.prefix_len:])
        if req.prefix is not None:
            self.cache.unlock(req.prefix)
            self.cache.trim()  # what it referenced may now go, if over budget
        req.prefix, req.prefix_len = None, 0
        req.slots = []
        self.runner.kv.free_row(req.row)
        req.row = 0

    def _finish(self, req: Request, reason: dict) -> None:
        if req.finished:
            return
        req.finish = reason
        req.finished_s = time.time()
        # An engine error may have left this step's slots unwritten: never cache those.
        self._release_kv(req, cache=reason.get("status_code") != 500)
        # Membership first: a failed deque.remove formats the repr of the whole Request.
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.by_rid.pop(req.rid, None)
        self.stats["aborted" if reason["type"] == "abort" else "finished"] += 1
        req.progress.set()
        req.done.set()

    # ---- prefill ---------------------------------------------------------------------------

    async def _prefill(self, batch: list[Request]) -> None:
        seqs = [r.all_tokens for r in batch]
        prefix = [r.prefix_len for r in batch]
        starts = []
        for r, s in zip(batch, seqs):
            wants_input = r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids
            starts.append(max(r.logprob_start_len - 1, 0) if wants_input else len(s) - 1)
        capture = any(r.routed is not None for r in batch)
        sb = self._sampling_batch(batch)

        def compute():
            uniforms = device_uniforms(sb, self.runner.device)  # before the forward: see there
            per_seq, routing = self.runner.prefill(seqs, [r.row for r in batch],
                                                   [r.slots[0] for r in batch], starts, capture, prefix)
            out = sample(torch.stack([lg[-1] for lg in per_seq]), sb, uniforms)
            input_lps = []
            for r, s, start, lg in zip(batch, seqs, starts, per_seq):
                if start == len(s) - 1:
                    input_lps.append(None)
                    continue
                nxt = torch.tensor(s[start + 1:], device=lg.device)
                lp = torch.log_softmax(lg[:-1], dim=-1).gather(1, nxt[:, None])[:, 0]
                input_lps.append(lp.tolist())
            return _to_host(out), routing, input_lps

        (tokens, logprobs, tops), routing, input_lps = await self._timed_compute(
            "prefill_compute_s", compute, sum(len(q) - p for q, p in zip(seqs, prefix)), prefill=True)
        self.stats["prefills"] += 1
        for i, req in enumerate(batch):
            if req.finished:  # aborted while computing cannot happen (lock), but stay safe
                continue
            if input_lps[i] is not None:
                first = max(req.logprob_start_len, 0)
                req.input_logprobs = ([None] if first == 0 else []) + input_lps[i]
            if routing is not None and req.routed is not None:
                req.routed[prefix[i]:prefix[i] + len(routing[i])] = routing[i]
            self._cache_prefilled(req)
            self.running.append(req)
            if req.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            self._append(req, tokens[i], logprobs[i], tops[i] if tops else None)

    def _cache_prefilled(self, req: Request) -> None:
        """Put a just-prefilled request's forwarded tokens into the prefix cache, referenced by
        the request from now on; where the cache already held them (a sample of the same prompt
        in this prefill), the request moves onto the cache's slots and its copies are freed."""
        if self.cache is None or req.kv_epoch != self.cache.epoch:
            return
        slots = req.slots[0]
        if len(slots) <= req.prefix_len:
            return
        routing = req.routed[:len(slots)] if req.routed is not None else None
        node, held = self.cache.insert(req.all_tokens[:len(slots)], slots, req.prefix_len, routing,
                                       lock=True)
        if req.prefix is not None:
            self.cache.unlock(req.prefix)
        req.prefix, req.prefix_len = node, len(slots)
        if not np.array_equal(held, slots):
            req.slots = [held]
            self.runner.set_row_slots(req.row, held)

    # ---- decode ----------------------------------------------------------------------------

    async def _decode(self) -> None:
        kv = self.runner.kv
        while kv.free_slots < len(self.running):
            if self.cache is not None and self.cache.evict(len(self.running) - kv.free_slots):
                continue  # unreferenced cache entries go before any running request
            if len(self.running) <= 1:
                break
            victim = self.running.pop()  # newest first, like SGLang's retract_decode
            self._release_kv(victim)
            victim.num_retractions += 1
            self.stats["retractions"] += 1
            self.waiting.appendleft(victim)
        batch = list(self.running)
        out_slots = kv.alloc(len(batch))
        for i, req in enumerate(batch):
            req.slots.append(out_slots[i:i + 1])
        ids = [r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in batch]
        positions = [len(r.input_ids) + len(r.output_ids) - 1 for r in batch]
        rows = [r.row for r in batch]
        capture = any(r.routed is not None for r in batch)
        sb = self._sampling_batch(batch)

        def compute():
            if not capture:  # plain batches: sampled in the CUDA graph, one wait per step
                fused = self.runner.decode_sampled(ids, positions, rows, out_slots, sb)
                if fused is not None:
                    return (*fused, None), None
            uniforms = device_uniforms(sb, self.runner.device)
            logits, routing = self.runner.decode(ids, positions, rows, out_slots, capture)
            return _to_host(sample(logits, sb, uniforms)), routing

        (tokens, logprobs, tops), routing = await self._timed_compute("decode_compute_s", compute,
                                                                       len(batch), prefill=False)
        self.stats["steps"] += 1
        for i, req in enumerate(batch):
            if routing is not None and req.routed is not None:
                req.routed[positions[i]] = routing[i]
            self._append(req, tokens[i], logprobs[i], tops[i] if tops else None)

    # ---- per-token bookkeeping -------------------------------------------------------------

    def _sampling_batch(self, batch: list[Request]) -> SamplingBatch:
        banned, biases = [], []
        for i, r in enumerate(batch):
            p = r.params
            if len(r.output_ids) < p.min_new_tokens:
                banned.extend((i, t) for t in r.stop_token_ids)
            for tok, b in (p.logit_bias or {}).items():
                biases.append((i, int(tok), float(b)))
        return SamplingBatch(
            temperatures=[r.params.temperature for r in batch],
            top_ps=[r.params.top_p for r in batch], top_ks=[r.params.top_k for r in batch],
            min_ps=[r.params.min_p for r in batch], seeds=[r.seed for r in batch],
            steps=[len(r.output_ids) for r in batch], banned=banned, biases=biases,
            top_logprobs_num=max((r.top_logprobs_num for r in batch), default=0))

    def _append(self, req: Request, token: int, logprob: float, top) -> None:
        i = len(req.output_ids)
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        if req.top_logprobs_num and top is not None:
            req.output_top.append(top[:req.top_logprobs_num])
        v = self.weight_version
        if req.spans and req.spans[-1][0] == v and req.spans[-1][2] == i:
            req.spans[-1][2] = i + 1
        else:
            req.spans.append([v, i, i + 1])
        self.stats["generated_tokens"] += 1
        reason = self._check_finished(req, token)
        if reason is not None:
            self._finish(req, reason)
        elif req.stream:
            req.progress.set()

    def _check_finished(self, req: Request, token: int) -> dict | None:
        # Same precedence as SGLang's Req.check_finished: length first, then stop ids, then strings.
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        if token in req.stop_token_ids:
            return {"type": "stop", "matched": token}
        if req.stop_strs and self.detokenize is not None:
            tail = self.detokenize(req.output_ids[-16:])
            for s in req.stop_strs:
                if s in tail:
                    req.matched_stop_str = s
                    return {"type": "stop", "matched": s}
        if len(req.input_ids) + len(req.output_ids) >= self.runner.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    # ---- load reporting --------------------------------------------------------------------

    def load(self) -> dict:
        kv = self.runner.kv
        # Like SGLang: evictable cache entries count as free
        evictable = self.cache.evictable_tokens() if self.cache is not None else 0
        used = self.runner.max_total_tokens - kv.free_slots - evictable
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_tokens": sum(len(r.input_ids) + len(r.output_ids) for r in self.running),
                "num_used_tokens": max(used, 0), "max_total_num_tokens": self.runner.max_total_tokens,
                "token_usage": max(used, 0) / max(self.runner.max_total_tokens, 1),
                "paused": self.paused, "cache_hit_rate": self.cache_hit_rate(),
                "cached_tokens_total": self.stats["cached_tokens"],
                "prompt_tokens_total": self.stats["prompt_tokens"],
                "prefix_cache_tokens": self.cache.tokens if self.cache is not None else 0}


def _to_host(out):
    # One device->host transfer per step (token ids < 2**53 are exact in float64).
    both = torch.stack([out.tokens.double(), out.logprobs.double()]).cpu()
    tokens = [int(t) for t in both[0].tolist()]
    logprobs = both[1].tolist()
    tops = None
    if out.top_ids is not None:
        ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        tops = [list(zip(lp_row, id_row)) for lp_row, id_row in zip(lps, ids)]
    return tokens, logprobs, tops
