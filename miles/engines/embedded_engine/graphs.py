"""CUDA graphs of the decode step, captured per (batch bucket, kv bucket) on first use; the
runner replays one per decode step (the design decisions are in `runner.py`)."""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.engines.embedded_engine.model import DecodeInputs
from miles.engines.embedded_engine.sampling import sample_plain

if TYPE_CHECKING:  # the runner holds its graphs; they only read its fields
    from miles.engines.embedded_engine.runner import ModelRunner

log = logging.getLogger("miles.engines.embedded_engine.runner")

BATCH_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                 448, 512]


class DecodeGraphs:
    """Lazily captured CUDA graphs of `Model.decode`, the lm_head and `sample_plain`, keyed by
    (batch bucket, kv bucket). A graph's inputs are two device buffers filled by one copy each
    from pinned host staging (token ids, positions, rows, seq lens, slots; logprob temperature,
    uniform, greedy flag); its outputs are the fp32 logits (for batches `sample_plain` cannot
    take, sampled eagerly after the replay) and the sampled tokens and logprobs, packed."""

    def __init__(self, runner: ModelRunner, max_bs: int):
        self.runner = runner
        self.buckets = [b for b in BATCH_BUCKETS if b < max_bs] + [max_bs]
        self.max_bs = max_bs
        dev = runner.device
        self.inputs = torch.zeros(5, max_bs, dtype=torch.long, device=dev)
        self.params = torch.zeros(3, max_bs, dtype=torch.float32, device=dev)
        self.host_inputs = torch.zeros(5, max_bs, dtype=torch.long).pin_memory()
        self.host_params = torch.zeros(3, max_bs, dtype=torch.float32).pin_memory()
        self.host_out = torch.zeros(2 * max_bs, dtype=torch.float64).pin_memory()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0  # time spent capturing, in all (the stats line reports it)
        self.pool = None
        self._pad()

    def _pad(self) -> None:
        self.inputs.zero_()
        self.inputs[3].fill_(1)  # seq_len 1: padding rows attend to their own scratch key only
        self.params.copy_(torch.tensor([[1.0], [0.5], [1.0]]).expand(3, self.max_bs))

    def _body(self, b: int, kv_bucket: int):
        x = self.inputs[:, :b]
        r = self.runner
        # The step's KV slots enter the row table in the graph (padding rows: scratch row 0).
        r.kv.req_to_token[x[2], x[1]] = x[4]
        inp = DecodeInputs(x[0], x[1], x[2], x[3], x[4])
        if r.fused_decode:
            hidden = r.model.decode_fused(inp, r.kv, r.kv.req_to_token)
        else:
            hidden, _ = r.model.decode(inp, kv_bucket, r.kv, r.kv.req_to_token, capture_routing=False)
        logits = r.model.logits(hidden)
        p = self.params[:, :b]
        tokens, logprobs = sample_plain(logits, p[0], p[1], p[2] > 0)
        return logits, torch.stack([tokens.double(), logprobs.double()])

    def _capture(self, b: int, kv_bucket: int, quiet: bool = False) -> torch.cuda.CUDAGraph:
        saved, saved_params = self.inputs.clone(), self.params.clone()
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
                self.outs[(b, kv_bucket)] = self._body(b, kv_bucket)
        finally:
            if gc_enabled:
                gc.enable()
        self.pool = graph.pool()
        self.inputs.copy_(saved)
        self.params.copy_(saved_params)
        if not quiet:
            log.info("captured decode CUDA graph batch=%d kv=%d", b, kv_bucket)
        return graph

    def _kv_key(self, kv_bucket: int) -> int:
        """The fused decode attends over each row's own length: one graph for every kv bucket."""
        return 0 if self.runner.fused_decode else kv_bucket

    def precapture(self, kv_buckets: list[int]) -> None:
        """Capture every batch bucket for these kv buckets now, largest batch first (the shared
        pool is sized by the first capture and reused by the smaller ones)."""
        t = time.perf_counter()
        for kv_bucket in dict.fromkeys(self._kv_key(kv) for kv in kv_buckets):
            for b in reversed(self.buckets):
                if (b, kv_bucket) not in self.graphs:
                    self.graphs[(b, kv_bucket)] = self._capture(b, kv_bucket, quiet=True)
        self.capture_s += time.perf_counter() - t
        log.info("captured %d decode CUDA graphs (batch <= %d, kv buckets %s) in %.1f s",
                 len(self.graphs), self.max_bs, kv_buckets, time.perf_counter() - t)

    @property
    def captured(self) -> int:
        return len(self.graphs)

    def _graph(self, n: int, kv_bucket: int) -> tuple[int, int]:
        key = (next(x for x in self.buckets if x >= n), self._kv_key(kv_bucket))
        if key not in self.graphs:
            t = time.perf_counter()
            self.graphs[key] = self._capture(*key)
            self.capture_s += time.perf_counter() - t
        return key

    def run(self, host: torch.Tensor, kv_bucket: int):
        """Replay with `host` [5, n] (on the device) as inputs; returns fp32 logits [n, V]."""
        n = host.shape[1]
        key = self._graph(n, kv_bucket)
        self._pad()
        self.inputs[:, :n].copy_(host, non_blocking=True)
        self.graphs[key].replay()
        return self.outs[key][0][:n], None

    def run_sampled(self, input_ids, positions, rows, out_slots: np.ndarray, params: np.ndarray,
                    kv_bucket: int) -> tuple[list[int], list[float]]:
        """One step of a plain batch: stage the inputs in pinned memory, two copies in, one
        replay, one copy out of the tokens and logprobs, one wait for it (the scheduler needs the
        tokens for the next step)."""
        n = len(input_ids)
        key = self._graph(n, kv_bucket)
        hi = self.host_inputs.numpy()
        hi[:, n:] = 0
        hi[3, n:] = 1
        hi[0, :n] = input_ids
        hi[1, :n] = positions
        hi[2, :n] = rows
        hi[3, :n] = hi[1, :n] + 1
        hi[4, :n] = out_slots
        hp = self.host_params.numpy()
        hp[:, n:] = np.array([[1.0], [0.5], [1.0]], dtype=np.float32)
        hp[:, :n] = params
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        self.params.copy_(self.host_params, non_blocking=True)
        self.graphs[key].replay()
        b = key[0]
        out = self.host_out[:2 * b].view(2, b)
        out.copy_(self.outs[key][1], non_blocking=True)
        torch.cuda.current_stream().synchronize()
        both = out.numpy()
        return both[0, :n].astype(np.int64).tolist(), both[1, :n].tolist()
