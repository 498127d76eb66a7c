"""ModelRunner: the model, its KV pool, and the decode step (eager or CUDA graph).

Design decisions:
- Everything here runs on the scheduler's single compute thread; nothing here knows about HTTP
  or requests, only token ids, KV slots and request rows.
- Decode shapes are bucketed: the batch is padded to a batch bucket (1, 2, 4, 8, 16, 24, 32, 48,
  64, ...), and the keys each row gathers from the pool to a kv-length bucket (a power of two
  >= 64). A (batch, kv) bucket pair is one CUDA graph, replayed whenever that pair comes again;
  all graphs share one memory pool. At start-up every batch bucket is captured for every kv bucket
  up to `cuda_graph_precapture_kv` (default 1024: 85 graphs at 256 requests, ~4 s for a 0.2B
  model on an H200), largest batch first; longer kv buckets are captured lazily, the first time
  they are needed. Lazily only, a short RL run paid ~1.2 s of its ~4.3 s measured in captures
  (~48 ms each, 0.2B, H200), in the middle of generation. Padding rows point at the reserved
  scratch row/slot 0 of the pool, so replaying a graph never touches a live request it doesn't own.
- The eager path runs the very same `Model.decode`, but gives each row its *own* kv bucket: rows
  are sorted by position and attention runs once per bucket (`segments`), so with heavy-tailed
  lengths a batch of short requests does not gather and attend over the longest one's keys
  (measured on CPU, RL pattern with lengths up to 10x the median: 3.9k -> 6.9k tok/s). It also
  makes a row's numbers independent of its batch neighbours' lengths. Graph and eager agree to
  rounding (a GPU test checks it); the lm_head and sampling run eagerly after the graph because
  their cost is one matmul and their inputs (per-request sampling params) vary.
- Prefill is one eager forward over the new sequences, packed: every index it needs is built on
  the host and moved in one transfer (`PrefillInputs`), so it never syncs the device mid-forward.
  Attention is causal SDPA over a right-padded view, or on CUDA FlashAttention varlen (the
  trainer's probed kernel, miles.backends.attention) for batches whose padding would more than
  double the work (`--prefill-attention auto`; `varlen` and `sdpa` force one path). cuDNN SDPA
  is excluded on CUDA because it builds a plan per shape and every prefill has a new one.
  Before, with a masked padded SDPA (cuDNN allowed), a prefill of ~20 prompts of ~50 tokens
  took 75-100 ms on the compute thread of an H200 engine (0.2B model, in the RL loop), against
  3-4 ms per decode step; host-built indices alone did not change that, the attention change
  did. Whether cuDNN planning or the masked kernel was the cost was not isolated. Measured since
  (bench/engine.py `prefill_ms`, 0.2B, H200, 32 prompts of 48 tokens): padded causal SDPA
  10.4 ms, varlen 17.6 ms, the difference being the varlen op's per-call host cost (a torch
  custom op); at batch 8, 9.9 vs 11.0 ms. A prefill at a shape the engine has not seen costs
  more (`--prefill-shapes`: median 23.8 ms at 8 new shapes, 14.6 ms for the same again), which
  is why RL-loop prefills (every batch a new shape) take 20-40 ms. A torch profile puts the
  extra time (~7 ms per prefill) in `aten::mm`. Padding the packed token count to buckets, and
  then also running one prefill per bucket at start-up, did not remove it (new shapes 30.8 ms,
  the same again 20.1), so it is not the packed length's matmuls; the lm_head's row count (the
  batch) is the remaining suspect. Both attempts were reverted.
- MoE models decode eagerly (the sparse expert loop has data-dependent shapes); CUDA graphs are
  for dense models, which is what the throughput benchmark measures.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from miles.engines.embedded_engine.kv_cache import KVPool
from miles.engines.embedded_engine.model import (DecodeInputs, Model, PrefillInputs, kv_bytes_per_token,
                                                 next_pow2)

log = logging.getLogger(__name__)

BATCH_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                 448, 512]
MIN_KV_BUCKET = 64


@dataclass
class RunnerConfig:
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    context_length: int | None = None
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    cuda_graph_precapture_kv: int = 1024  # capture at start-up for kv buckets up to this (0: none)
    mem_fraction_kv: float = 0.5     # of free device memory after weights, when max_total_tokens is unset
    load_format: str = "auto"        # "dummy": skip the checkpoint's weights (SGLang's flag)
    prefill_attention: str = "auto"  # auto | varlen (required) | sdpa


def torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(table)}")
    return table[name]


class ModelRunner:
    def __init__(self, model_path: str, cfg: RunnerConfig):
        from miles.engines.embedded_engine.model import load_hf_config, load_safetensors_dir
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda" means the current device; make it explicit
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = torch_dtype(cfg.dtype)
        self.hf_config = load_hf_config(model_path)
        ctx = cfg.context_length or self.hf_config.max_position_embeddings
        self.context_length = ctx
        self.model = Model(self.hf_config, self.device, self.dtype, max_positions=ctx)
        self.shape = self.model.shape
        missing = [] if cfg.load_format == "dummy" else load_safetensors_dir(self.model.weights, model_path)
        if missing:
            raise ValueError(f"model_path {model_path!r}: checkpoint lacks {len(missing)} tensors, "
                             f"e.g. {missing[:3]}")
        per_token = kv_bytes_per_token(self.shape, self.dtype)
        total = cfg.max_total_tokens or self._default_pool_tokens(per_token, ctx)
        self.kv = KVPool(self.shape.num_layers, total + 1, self.shape.num_kv_heads,
                         self.shape.head_dim, cfg.max_running_requests, ctx, self.device, self.dtype)
        self.max_total_tokens = total
        self.use_graphs = (self.device.type == "cuda" and cfg.cuda_graph and not self.shape.is_moe)
        self.graphs = _DecodeGraphs(self, min(cfg.cuda_graph_max_bs, cfg.max_running_requests)) \
            if self.use_graphs else None
        if cfg.prefill_attention not in ("auto", "varlen", "sdpa"):
            raise ValueError(f"prefill_attention: {cfg.prefill_attention!r} is not auto, varlen or sdpa")
        if (cfg.prefill_attention != "sdpa" and self.device.type == "cuda"
                and self.dtype in (torch.bfloat16, torch.float16)):
            from miles.backends import attention  # the trainer's probed FlashAttention varlen kernel
            if attention.enable_varlen_kernel(self.device, self.dtype):
                self.model.varlen = attention.varlen_causal
                self.model.varlen_always = cfg.prefill_attention == "varlen"
        if cfg.prefill_attention == "varlen" and self.model.varlen is None:
            raise ValueError(f"prefill_attention: 'varlen' needs a working FlashAttention varlen kernel "
                             f"(CUDA, bf16/fp16); none on {self.device} in {cfg.dtype}")
        log.info("embedded engine: %s %s on %s, KV pool %d tokens (%.1f MiB), cuda graphs %s, "
                 "prefill attention %s", self.shape.model_type, cfg.dtype, self.device, total,
                 self.kv.nbytes() / 2**20, self.use_graphs, self.prefill_attention)
        if self.graphs is not None and cfg.cuda_graph_precapture_kv > 0:
            self.graphs.precapture(self.kv_buckets_up_to(cfg.cuda_graph_precapture_kv))

    @property
    def prefill_attention(self) -> str:
        """The prefill attention in use, in words (auto decides per batch)."""
        if self.model.varlen is None:
            return "sdpa (padded)"
        return "varlen" if self.model.varlen_always else "auto (padded sdpa; varlen if padding > 2x)"

    def _default_pool_tokens(self, per_token: int, ctx: int) -> int:
        want = self.cfg.max_running_requests * ctx
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            cap = int(free * self.cfg.mem_fraction_kv) // per_token
        else:
            cap = (1 << 30) // per_token  # 1 GiB of host memory for the KV pool by default
        return max(2 * ctx, min(want, cap)) if cap >= 2 * ctx else max(cap, 256)

    # ---- prefill ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]], rows: list[int], slots: list[np.ndarray],
                logit_starts: list[int], capture_routing: bool):
        """Forward fresh sequences; returns per-sequence fp32 logits rows and routing.

        `logit_starts[i]` is the first position of sequence i whose logits are wanted (len-1 for
        plain sampling; earlier for prompt logprobs). Routing is [T_i, moe_layers, top_k] per seq.
        """
        dev = self.device
        lens = [len(s) for s in seqs]
        inp = PrefillInputs.build(seqs, slots, rows, logit_starts, dev)
        self.kv.req_to_token[inp.token_rows, inp.positions] = inp.slots
        hidden, routing = self.model.prefill(inp, self.kv, capture_routing and self.shape.is_moe)
        logits = self.model.logits(hidden.index_select(0, inp.logit_index))
        per_seq, off = [], 0
        for n, start in zip(lens, logit_starts):
            per_seq.append(logits[off:off + n - start])
            off += n - start
        routing_np = None
        if routing is not None:
            r = routing.to(torch.int32).cpu().numpy()
            routing_np, off = [], 0
            for n in lens:
                routing_np.append(r[off:off + n])
                off += n
        return per_seq, routing_np

    # ---- decode ----------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, input_ids: list[int], positions: list[int], rows: list[int],
               out_slots: np.ndarray, capture_routing: bool, force_eager: bool = False):
        """One token per request. Returns (fp32 logits [B, V], routing np [B, L, k] or None)."""
        dev = self.device
        n = len(input_ids)
        host = torch.tensor([input_ids, positions, rows, [p + 1 for p in positions],
                             out_slots.tolist()], dtype=torch.long)
        kv_bucket = self.kv_bucket_of(max(positions))
        host = host.to(dev, non_blocking=True)
        self.kv.req_to_token[host[2], host[1]] = host[4]
        hidden = None
        if self.graphs is not None and not force_eager and n <= self.graphs.max_bs:
            try:
                hidden, routing = self.graphs.run(host, kv_bucket)
            except Exception:  # a capture that fails must not take generation down with it
                log.exception("CUDA graph decode failed; decoding eagerly from now on")
                self.graphs, self.use_graphs = None, False
                torch.cuda.synchronize(self.device)
        if hidden is None:
            hidden, routing = self._decode_eager(host, positions, kv_bucket,
                                                 capture_routing and self.shape.is_moe)
        logits = self.model.logits(hidden)
        routing_np = routing.to(torch.int32).cpu().numpy() if (capture_routing and routing is not None) else None
        return logits, routing_np

    def _decode_eager(self, host: torch.Tensor, positions: list[int], kv_bucket: int,
                      capture_routing: bool):
        """Rows sorted by position, attention per kv bucket (`segments`), results in input order."""
        order = sorted(range(len(positions)), key=positions.__getitem__)
        buckets = [self.kv_bucket_of(positions[j]) for j in order]
        if buckets[0] == buckets[-1]:  # one bucket: no reordering needed
            inp = DecodeInputs(host[0], host[1], host[2], host[3], host[4])
            return self.model.decode(inp, kv_bucket, self.kv, self.kv.req_to_token, capture_routing)
        segments, start = [], 0
        for j in range(1, len(buckets) + 1):
            if j == len(buckets) or buckets[j] != buckets[start]:
                segments.append((start, j, buckets[start]))
                start = j
        perm = torch.tensor(order, device=host.device)
        x = host[:, perm]
        inp = DecodeInputs(x[0], x[1], x[2], x[3], x[4])
        hidden, routing = self.model.decode(inp, kv_bucket, self.kv, self.kv.req_to_token,
                                            capture_routing, segments=segments)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(order), device=perm.device)
        return hidden[inverse], (routing[inverse] if routing is not None else None)

    def kv_bucket_of(self, max_position: int) -> int:
        return min(max(MIN_KV_BUCKET, next_pow2(max_position + 1)), self.context_length)

    def kv_buckets_up_to(self, limit: int) -> list[int]:
        """Every kv bucket `kv_bucket_of` can return for positions below `limit`."""
        out = []
        for position in range(min(limit, self.context_length)):
            kv = self.kv_bucket_of(position)
            if not out or out[-1] != kv:
                out.append(kv)
        return out


class _DecodeGraphs:
    """Lazily captured CUDA graphs of `Model.decode`, keyed by (batch bucket, kv bucket)."""

    def __init__(self, runner: ModelRunner, max_bs: int):
        self.runner = runner
        self.buckets = [b for b in BATCH_BUCKETS if b < max_bs] + [max_bs]
        self.max_bs = max_bs
        dev = runner.device
        self.inputs = torch.zeros(5, max_bs, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(max_bs, runner.shape.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0  # time spent capturing, in all (the stats line reports it)
        self.pool = None
        self._pad()

    def _pad(self) -> None:
        self.inputs.zero_()
        self.inputs[3].fill_(1)  # seq_len 1: padding rows attend to their own scratch key only

    def _body(self, b: int, kv_bucket: int) -> None:
        x = self.inputs[:, :b]
        inp = DecodeInputs(x[0], x[1], x[2], x[3], x[4])
        r = self.runner
        hidden, _ = r.model.decode(inp, kv_bucket, r.kv, r.kv.req_to_token, capture_routing=False)
        self.hidden[:b].copy_(hidden)

    def _capture(self, b: int, kv_bucket: int, quiet: bool = False) -> torch.cuda.CUDAGraph:
        saved = self.inputs.clone()
        self._pad()  # capture against scratch rows only
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body(b, kv_bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work another thread may do meanwhile (a checksum, a delta being
        # decoded) must not invalidate this capture. No automatic garbage collection during the
        # capture either (torch.cuda.graph collects once before it starts): a collection that
        # frees an unreachable CUDAGraph (another runner's) resets it mid-capture, which
        # invalidates the capture (seen in the GPU test suite, runners of earlier tests).
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._body(b, kv_bucket)
        finally:
            if gc_enabled:
                gc.enable()
        self.pool = graph.pool()
        self.inputs.copy_(saved)
        if not quiet:
            log.info("captured decode CUDA graph batch=%d kv=%d", b, kv_bucket)
        return graph

    def precapture(self, kv_buckets: list[int]) -> None:
        """Capture every batch bucket for these kv buckets now, largest batch first (the shared
        pool is sized by the first capture and reused by the smaller ones)."""
        t = time.perf_counter()
        for kv_bucket in kv_buckets:
            for b in reversed(self.buckets):
                if (b, kv_bucket) not in self.graphs:
                    self.graphs[(b, kv_bucket)] = self._capture(b, kv_bucket, quiet=True)
        self.capture_s += time.perf_counter() - t
        log.info("captured %d decode CUDA graphs (batch <= %d, kv buckets %s) in %.1f s",
                 len(self.graphs), self.max_bs, kv_buckets, time.perf_counter() - t)

    @property
    def captured(self) -> int:
        return len(self.graphs)

    def run(self, host: torch.Tensor, kv_bucket: int):
        n = host.shape[1]
        b = next(x for x in self.buckets if x >= n)
        key = (b, kv_bucket)
        if key not in self.graphs:
            t = time.perf_counter()
            self.graphs[key] = self._capture(b, kv_bucket)
            self.capture_s += time.perf_counter() - t
        self._pad()
        self.inputs[:, :n].copy_(host, non_blocking=True)
        self.graphs[key].replay()
        return self.hidden[:n], None
