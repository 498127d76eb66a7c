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
  rounding (a GPU test checks it).
- The graph also holds the lm_head and, for plain batches (sampling.is_plain: every RL rollout),
  the sampling and logprobs (`sample_plain`, per-row parameters as tensors): a step is two copies
  in from pinned staging, one replay, one copy out of the tokens and logprobs, and one wait.
  Other batches (top-k/p, min-p, bans, biases, top logprobs) are sampled eagerly from the graph's
  logits. Measured on an H100 (2026-12-07, Qwen2-0.5B bf16, bench/engine.py --baseline-tree):
  1.02-1.04x the engine before it at batch 1-256, because the step was never host-bound: at
  batch 64, 4.2 of its 4.9 ms is the replay itself, ~470 small kernels (elementwise 1.6 ms, the
  KV gathers 0.55, GEMMs 0.65, the sampler's cumsum over the vocabulary 0.25).
- So dense models can decode through `Model.decode_fused` (`--decode-kernels`, kernels.py):
  four Triton kernels between a layer's GEMMs (residual+RMSNorm, norms+RoPE+KV store, paged
  attention over each row's own length through the row table, SiLU*up). Attention no longer
  depends on a kv bucket, so graphs are keyed by batch bucket alone (17 at 256 requests, not 85),
  and the eager path needs no segments. Checked against the torch path on CPU (Triton's
  interpreter, fp32); not yet run on a card, so `--decode-kernels torch` stays the default until
  tests/gpu/test_engine_decode_gpu.py passes and bench/engine.py measures the win.
- Prefill is one eager forward over the new tokens (those past a prefix cache hit), packed: every index it needs is built on
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
- Tensor parallelism (`tp`, tp.py): each public method that touches weights or KV is a command.
  On rank 0 it first broadcasts its own arguments (token ids, rows, slots: small int lists), then
  runs its `_op_*`; workers run the same `_op_*` from their command loop, and the collectives in
  the forward keep them in step. The KV pool is one slot numbering for every rank (the smallest
  pool any rank can hold), so rank 0's host-side allocation is every rank's. Measured on the
  shared 2-core CPU (tiny Qwen3, 16 requests x 64 greedy tokens, load average ~5 from other
  work): tp=1 2700-7200 tok/s, tp=2 610-830 tok/s; seven small gloo collectives per decode step
  (two per layer, the embedding, the logits, one command frame) cost far more than the halved
  matmuls save at this size. TP is for models that do not fit one device, not for CPU speed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from miles.engines.embedded_engine.graphs import DecodeGraphs
from miles.engines.embedded_engine.kv_cache import KVPool
from miles.engines.embedded_engine.model import DecodeInputs, Model, PrefillInputs
from miles.engines.embedded_engine.sampling import SamplingBatch, is_plain, plain_params
from miles.engines.embedded_engine.shapes import kv_bytes_per_token, next_pow2

log = logging.getLogger(__name__)

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
    quantization: str | None = None  # updates arrive in this miles.quant format (quantized.py)
    fp8_gemm: str = "off"            # auto | on | off: FP8 weights + FP8 GEMM for dense linears (fp8)
    decode_kernels: str = "torch"    # auto | triton (required) | torch: Model.decode_fused or decode


def runner_config(args, device: str | None = None) -> RunnerConfig:
    """The RunnerConfig of the engine's command-line flags (rank 0 and every TP worker alike)."""
    return RunnerConfig(device=device or args.device, dtype=args.dtype,
                        max_running_requests=args.max_running_requests,
                        max_total_tokens=args.max_total_tokens, context_length=args.context_length,
                        cuda_graph=not args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
                        cuda_graph_precapture_kv=args.cuda_graph_precapture_kv,
                        mem_fraction_kv=args.mem_fraction_kv, load_format=args.load_format,
                        quantization=args.quantization, prefill_attention=args.prefill_attention,
                        fp8_gemm=getattr(args, "fp8_gemm", "off"),
                        decode_kernels=getattr(args, "decode_kernels", "auto"))


def torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(table)}")
    return table[name]


class ModelRunner:
    """`tp` (a tp.TPGroup, tp > 1): this process is one TP rank; on rank 0 every public method
    that touches weights or KV first broadcasts itself as a command (tp.py), then every rank runs
    the same `_op_*`."""

    def __init__(self, model_path: str, cfg: RunnerConfig, tp=None):
        from miles.engines.embedded_engine.params import load_safetensors_dir
        from miles.engines.embedded_engine.shapes import load_hf_config
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
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.model = Model(self.hf_config, self.device, self.dtype, max_positions=ctx, tp=self.tp)
        self.shape = self.model.full_shape  # the whole model (the KV pool holds this rank's heads)
        self.p2p = None  # (P2PGroup, EngineRank) once the engine joined a P2P weight group
        from miles.engines.embedded_engine.quantized import QuantLoader, fp8_gemm_for
        gemm = fp8_gemm_for(cfg.fp8_gemm, cfg.quantization, self.device, self.dtype) \
            if cfg.quantization or cfg.fp8_gemm == "on" else None
        if cfg.quantization:
            self.model.weights.quant = QuantLoader(cfg.quantization, self.model.weights, gemm=gemm)
        missing = [] if cfg.load_format == "dummy" else load_safetensors_dir(self.model.weights, model_path)
        if missing:
            raise ValueError(f"model_path {model_path!r}: checkpoint lacks {len(missing)} tensors, "
                             f"e.g. {missing[:3]}")
        local = self.model.shape
        per_token = kv_bytes_per_token(local, self.dtype)
        total = cfg.max_total_tokens or self._default_pool_tokens(per_token, ctx)
        if self.tp is not None:  # one slot numbering for every rank: the smallest pool
            t = torch.tensor([total], dtype=torch.int64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.ctrl)
            total = int(t)
        self.kv = KVPool(local.num_layers, total + 1, local.num_kv_heads,
                         local.head_dim, cfg.max_running_requests, ctx, self.device, self.dtype)
        self.max_total_tokens = total
        self.use_graphs = (self.device.type == "cuda" and cfg.cuda_graph and not self.shape.is_moe
                           and self.tp is None)
        if cfg.decode_kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"decode_kernels: {cfg.decode_kernels!r} is not auto, triton or torch")
        fused_ok = self.model.fused_decode_supported()
        if cfg.decode_kernels == "triton" and not fused_ok:
            raise ValueError(f"decode_kernels: 'triton' needs triton and a dense model with a "
                             f"power-of-two head_dim >= 16 (is_moe={self.shape.is_moe}, "
                             f"head_dim={self.shape.head_dim})")
        # the fused decode: one graph per batch size serves every kv length (no kv buckets)
        self.fused_decode = fused_ok and (cfg.decode_kernels == "triton" or (
            cfg.decode_kernels == "auto" and self.device.type == "cuda"))
        self.graphs = DecodeGraphs(self, min(cfg.cuda_graph_max_bs, cfg.max_running_requests)) \
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
                 "prefill attention %s, decode kernels %s", self.shape.model_type, cfg.dtype,
                 self.device, total, self.kv.nbytes() / 2**20, self.use_graphs,
                 self.prefill_attention, "triton" if self.fused_decode else "torch")
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

    def _command(self, op: str, *args) -> None:
        """Rank 0 of a TP engine: tell the workers to run `_op_<op>(*args)` too."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send([op, *args])

    def prefill(self, seqs: list[list[int]], rows: list[int], slots: list[np.ndarray],
                logit_starts: list[int], capture_routing: bool, prefix_lens: list[int] | None = None):
        if self.tp is not None:
            self._command("prefill", seqs, rows, [np.asarray(x).tolist() for x in slots],
                          logit_starts, capture_routing, prefix_lens)
        return self._op_prefill(seqs, rows, slots, logit_starts, capture_routing, prefix_lens)

    def decode(self, input_ids: list[int], positions: list[int], rows: list[int],
               out_slots: np.ndarray, capture_routing: bool, force_eager: bool = False):
        """One token per request. Returns (fp32 logits [B, V], routing np [B, L, k] or None)."""
        if self.tp is not None:
            self._command("decode", input_ids, positions, rows, np.asarray(out_slots).tolist(),
                          capture_routing, force_eager)
        return self._op_decode(input_ids, positions, rows, out_slots, capture_routing, force_eager)

    def set_row_slots(self, row: int, slots: np.ndarray) -> None:
        """A request row's first len(slots) positions now live at `slots` (a prefix-cache merge)."""
        if self.tp is not None:
            self._command("set_row_slots", row, np.asarray(slots).tolist())
        self._op_set_row_slots(row, slots)

    def _op_set_row_slots(self, row: int, slots) -> None:
        held = torch.as_tensor(np.asarray(slots, dtype=np.int64)).to(self.device)
        self.kv.req_to_token[row, :len(held)] = held

    # ---- weights at tp > 1: every rank its slices ------------------------------------------

    def load_from_disk(self, model_path: str) -> int:
        """`/update_weights_from_disk`: rank 0 validates and loads first (a bad directory fails
        before any worker is told), then every worker loads its slices of the same files."""
        from miles.engines.embedded_engine import weights as W
        n = W.load_from_disk(self.model.weights, model_path)
        self._command("load_from_disk", model_path)
        return n

    def _op_load_from_disk(self, model_path: str) -> None:
        from miles.engines.embedded_engine import weights as W
        W.load_from_disk(self.model.weights, model_path)

    def checksums(self, names: list[str] | None, algorithm: str) -> dict[str, str]:
        """Digests of the *full* tensors: at tp > 1 each is gathered to rank 0 (`full_tensor`)
        and hashed there, so they equal a tp=1 engine's and the trainer's, name by name."""
        from miles.engines.embedded_engine import weights as W
        if self.tp is None:
            return W.checksums(self.model.weights, names, algorithm)
        for n in names or []:
            self.model.weights.full_shape(n)  # a bad name: KeyError before any worker is told
        self._command("checksums", names, algorithm)
        return self._op_checksums(names, algorithm)

    def _op_checksums(self, names, algorithm: str) -> dict[str, str]:
        from miles.weights.checks import CHECKSUMS
        digest = CHECKSUMS[algorithm]
        out = {}
        for name in names or self.model.weights.full_names:
            full = self._gather(name)
            if full is not None:
                out[name] = digest(full)
        return out

    def full_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (gathered from every TP rank at tp > 1)."""
        if self.tp is None:
            return self.model.weights.lookup(name)
        self.model.weights.full_shape(name)
        self._command("full_tensor", name)
        return self._op_full_tensor(name)

    def _op_full_tensor(self, name: str):
        return self._gather(name)

    def _gather(self, name: str) -> torch.Tensor | None:
        """Collective over the TP ranks: the full `name` on rank 0 (None elsewhere). Replicated
        tensors are rank 0's own; a split one is all-gathered and concatenated on its split dim;
        an expert is broadcast from the rank that holds it."""
        w, tp = self.model.weights, self.tp
        shape = w.full_shape(name)
        boxes = [w.box(name, r) for r in range(tp.size)]
        full_box = [(0, n) for n in shape]
        if all(b == full_box for b in boxes):
            return w.lookup(name) if tp.rank == 0 else None
        holders = [r for r, b in enumerate(boxes) if b is not None]
        if len(holders) == 1:
            src = holders[0]
            if tp.rank == src:
                buf = w.lookup(name).contiguous()
            else:
                buf = torch.empty(shape, dtype=w.dtype, device=w.device)
            torch.distributed.broadcast(buf, src=src, group=tp.pg)
            return buf if tp.rank == 0 else None
        dim = next(d for d, (start, n) in enumerate(boxes[0]) if n != shape[d])
        local = w.lookup(name).contiguous()
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        torch.distributed.all_gather(parts, local, group=tp.pg)
        return torch.cat(parts, dim=dim) if tp.rank == 0 else None

    # ---- P2P weight transfer: each rank receives its own slices ------------------------------

    def p2p_join(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                 group_name: str, plan: bytes, dtype: str, backend: str, timeout_s: float) -> None:
        """Join the trainers' P2P group at `rank_offset` + this TP rank (every rank joins). The
        plan is checked here first, for every rank's boxes, so a bad one is refused before any
        worker is told."""
        self._check_p2p_plan(plan)
        self._command("p2p_join", master_address, master_port, rank_offset, world_size, group_name,
                      plan, dtype, backend, timeout_s)
        self._op_p2p_join(master_address, master_port, rank_offset, world_size, group_name, plan,
                          dtype, backend, timeout_s)

    def _check_p2p_plan(self, blob: bytes) -> None:
        from miles.weights.p2p import Plan
        plan = msgspec.msgpack.decode(blob, type=Plan)  # a DecodeError names the field
        size = self.tp.size if self.tp is not None else 1
        if plan.engine.tp != size:
            raise ValueError(f"p2p plan: engine tp={plan.engine.tp} != this engine's --tp-size {size}")
        w = self.model.weights
        for t, spec in enumerate(plan.specs):
            if tuple(spec.shape) != w.full_shapes.get(spec.name):
                raise ValueError(f"p2p plan: tensor {spec.name!r} {spec.shape} is not one of this "
                                 f"engine's (its shape: {w.full_shapes.get(spec.name)})")
            for r in range(size):
                box = plan.engine_boxes[t][r]
                mine = w.box(spec.name, r)
                if (box is None) != (mine is None) or box is not None and \
                        [tuple(b) for b in box] != [tuple(b) for b in mine]:
                    raise ValueError(f"p2p plan: {spec.name} on engine rank {r} is {box}; this "
                                     f"engine holds {mine} there")

    def _op_p2p_join(self, master_address, master_port, rank_offset, world_size, group_name, plan,
                     dtype, backend, timeout_s) -> None:
        from miles.weights.p2p import P2PGroup, Plan
        from miles.weights.p2p_receiver import EngineRank
        from miles.weights.process_group import init_custom_process_group
        self._op_p2p_leave()
        plan = msgspec.msgpack.decode(plan, type=Plan)
        rank = self.tp.rank if self.tp is not None else 0
        if plan.engine.tp != (self.tp.size if self.tp is not None else 1):
            raise ValueError(f"p2p plan: engine tp={plan.engine.tp} != this engine's "
                             f"--tp-size {self.tp.size if self.tp is not None else 1}")
        w = self.model.weights
        if w.fp8:
            raise ValueError("p2p: this engine holds its dense linears in FP8 (--fp8-gemm) and P2P "
                             "writes high-precision tensors in place; start it with --fp8-gemm off")
        shards = {}
        for t, spec in enumerate(plan.specs):
            box = plan.engine_boxes[t][rank]
            if box is None:
                continue
            dst = w.lookup(spec.name)  # KeyError names a tensor this engine does not have
            if list(dst.shape) != [n for _, n in box]:
                raise ValueError(f"p2p plan: {spec.name} slice {box} does not match this rank's "
                                 f"{list(dst.shape)}")
            shards[t] = dst
        pg = init_custom_process_group(backend, master_address, master_port, world_size,
                                       rank_offset + rank, group_name, timeout_s)
        group = P2PGroup(pg, plan.trainer_world, rank_offset + rank,
                         self.device if backend == "nccl" else None)
        self.p2p = (group, EngineRank(plan, rank, getattr(torch, dtype), shards=shards,
                                      device=self.device if backend == "nccl" else None))

    def p2p_receive(self) -> tuple[int, dict[int, int]]:
        """One version from the trainers (every rank its slices); returns (version, bytes per
        trainer rank received by rank 0)."""
        if self.p2p is None:
            raise RuntimeError("update_weights_from_p2p: this engine has not joined a P2P group "
                               "(/init_p2p_group first)")
        self._command("p2p_receive")
        return self._op_p2p_receive()

    @torch.no_grad()
    def _op_p2p_receive(self):
        group, engine = self.p2p
        version = engine.receive_version(group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return version, dict(engine.received)

    def p2p_leave(self) -> None:
        self._command("p2p_leave")
        self._op_p2p_leave()

    def _op_p2p_leave(self) -> None:
        if self.p2p is not None:
            from miles.weights.process_group import destroy_group
            destroy_group(self.p2p[0].pg)
            self.p2p = None

    def stop_workers(self) -> None:
        self._command("stop")

    @torch.no_grad()
    def _op_prefill(self, seqs: list[list[int]], rows: list[int], slots: list[np.ndarray],
                    logit_starts: list[int], capture_routing: bool, prefix_lens: list[int] | None = None):
        """Forward sequences past their cached prefixes; returns per-sequence fp32 logits rows and
        routing.

        `seqs[i]`/`slots[i]` cover the whole sequence; its first `prefix_lens[i]` tokens (default
        0) are a prefix cache hit whose K/V are already at those slots, and only the rest is
        forwarded. `logit_starts[i]` (>= the prefix) is the first position of sequence i whose
        logits are wanted (len-1 for plain sampling; earlier for prompt logprobs). Routing is
        [new tokens of i, moe_layers, top_k] per seq.
        """
        dev = self.device
        slots = [np.asarray(x, dtype=np.int64) for x in slots]
        pre = prefix_lens or [0] * len(seqs)
        lens = [len(s) - p for s, p in zip(seqs, pre)]
        inp = PrefillInputs.build(seqs, slots, rows, logit_starts, dev, pre)
        t2t = self.kv.req_to_token
        t2t[inp.token_rows, inp.positions] = inp.slots
        if inp.extend:
            t2t[inp.table_rows, inp.table_positions] = inp.table_slots
        hidden, routing = self.model.prefill(inp, self.kv, capture_routing and self.shape.is_moe)
        logits = self.model.logits(hidden.index_select(0, inp.logit_index))
        per_seq, off = [], 0
        for s, start in zip(seqs, logit_starts):
            per_seq.append(logits[off:off + len(s) - start])
            off += len(s) - start
        routing_np = None
        if routing is not None:
            r = self._all_layers(routing.to(torch.int32).cpu().numpy())
            routing_np, off = [], 0
            for n in lens:
                routing_np.append(r[off:off + n])
                off += n
        return per_seq, routing_np

    # ---- decode ----------------------------------------------------------------------------

    @torch.no_grad()
    def _op_decode(self, input_ids: list[int], positions: list[int], rows: list[int],
                   out_slots, capture_routing: bool, force_eager: bool = False):
        out_slots = np.asarray(out_slots, dtype=np.int64)
        dev = self.device
        n = len(input_ids)
        host = torch.tensor([input_ids, positions, rows, [p + 1 for p in positions],
                             out_slots.tolist()], dtype=torch.long)
        kv_bucket = self.kv_bucket_of(max(positions))
        host = host.to(dev, non_blocking=True)
        self.kv.req_to_token[host[2], host[1]] = host[4]
        logits = None
        if self.graphs is not None and not force_eager and n <= self.graphs.max_bs:
            try:
                logits, routing = self.graphs.run(host, kv_bucket)
            except Exception:  # a capture that fails must not take generation down with it
                self._graphs_failed()
        if logits is None:
            hidden, routing = self._decode_eager(host, positions, kv_bucket,
                                                 capture_routing and self.shape.is_moe)
            logits = self.model.logits(hidden)
        routing_np = (self._all_layers(routing.to(torch.int32).cpu().numpy())
                      if (capture_routing and routing is not None) else None)
        return logits, routing_np

    def _graphs_failed(self) -> None:
        log.exception("CUDA graph decode failed; decoding eagerly from now on")
        self.graphs, self.use_graphs = None, False
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def decode_sampled(self, input_ids: list[int], positions: list[int], rows: list[int],
                       out_slots: np.ndarray, sb: SamplingBatch):
        """One token per request, sampled inside the CUDA graph (`sample_plain`): returns
        (tokens, logprobs) as lists, or None where the graph path does not apply (no graphs, a
        batch over the largest captured one, or a batch `sample_plain` cannot take); then
        `decode` and `sample` do the step. Dense models at tp = 1 only (graphs need both)."""
        g = self.graphs
        if g is None or len(input_ids) > g.max_bs or not is_plain(sb, self.shape.vocab_size):
            return None
        try:
            return g.run_sampled(input_ids, positions, rows, out_slots, plain_params(sb),
                                 self.kv_bucket_of(max(positions)))
        except Exception:  # as in _op_decode: generation goes on, eagerly
            self._graphs_failed()
            return None

    def _all_layers(self, routing: np.ndarray) -> np.ndarray:
        """[n, moe_layers, k] -> SGLang's [n, num_layers, k] with -1 on the dense layers."""
        moe, L = self.shape.moe_layers, self.shape.num_layers
        if len(moe) == L:
            return routing
        full = np.full((routing.shape[0], L, routing.shape[2]), -1, np.int32)
        full[:, moe] = routing
        return full

    def _decode_eager(self, host: torch.Tensor, positions: list[int], kv_bucket: int,
                      capture_routing: bool):
        """Rows sorted by position, attention per kv bucket (`segments`), results in input order."""
        if self.fused_decode:  # attention over each row's own length: no kv buckets to sort by
            inp = DecodeInputs(host[0], host[1], host[2], host[3], host[4])
            return self.model.decode_fused(inp, self.kv, self.kv.req_to_token), None
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
