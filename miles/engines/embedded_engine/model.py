"""A small Qwen-family decoder (Qwen2, Qwen3, Qwen3-MoE, Llama) that reads HF weights directly.

Design decisions:
- We do not run the transformers module tree: its per-layer Python and its DynamicCache cannot
  batch requests of different lengths in one step, nor be captured in a CUDA graph. Instead this
  file holds the weights as plain tensors and runs a forward over a *flat* token batch (every
  request's tokens concatenated), reading and writing a token-slot KV pool (kv_cache.py).
- The math mirrors transformers' modules op for op where it matters for numerics (RMSNorm in fp32
  then cast, RoPE cos/sin cast to the activation dtype, router softmax in fp32), so fp32 logits
  match the HF forward within 1e-5 and bf16 stays close. A test checks it.
- Weights are stored fused where that makes the forward faster (q|k|v, gate|up, all experts of a
  layer in one [E, 2I, H] tensor), and every checkpoint name (`model.layers.0.self_attn.q_proj.weight`,
  `model.layers.0.mlp.experts.3.gate_proj.weight`, ...) maps to a *view* into those tensors. Loading
  and updating by name is a `view.copy_(tensor)`, so per-expert checkpoint names, transformers 5's
  fused in-memory names (`mlp.experts.gate_up_proj`) and SGLang's names all land in the same storage.
- Two attention paths: `prefill` (fresh sequences, padded batch + SDPA with a causal/padding mask;
  after a cached prefix, the new tokens over keys read back from the pool) and `decode` (one new token per request, gathering its keys from the pool through
  `req_to_token`). The decode path has static shapes given (batch, kv bucket), which is what lets
  runner.py capture it in a CUDA graph.
- Tensor parallelism (tp.py) is Megatron's layout over the same code: a rank holds its q/k/v
  heads and gate/up rows (column-parallel), the matching o_proj / down_proj columns (row-parallel,
  an all-reduce after each), its vocabulary rows of the embeddings (looked up where they fall,
  zeros elsewhere, all-reduced: exact) and of lm_head (logits all-gathered to the full
  vocabulary in fp32), its experts (EP; every rank routes with the whole router and runs only its
  experts, then all-reduce). Norms and the router are replicated. `Model.shape` is the rank's
  (heads / tp, ...); `full_shape` and `Weights.full_shapes` the whole model's.
- Decode attention on CPU is one SDPA call (`enable_gqa`, additive mask) over the gathered keys:
  the matmul form below permutes the keys and values into copies and upcasts the scores, and
  SDPA's CPU kernel reads them as they are (28 rows x 256 keys, 2 kv heads: 0.9 ms against 4.9 ms
  per layer; equal to 5e-7 in fp32). On CUDA the matmul form stays, the one the GPU tests (HF
  agreement, graph == eager) were run on, until SDPA's kernels there are measured and tested
  under capture.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from miles.engines.embedded_engine import kernels
from miles.engines.embedded_engine.params import Weights
from miles.engines.embedded_engine.shapes import ModelShape, local_shape, shape_from_config


def rope_inv_freq(config, shape: ModelShape) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling, computed exactly as transformers does."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = shape.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"config.rope_parameters.rope_type: {rope_type!r} depends on the sequence "
                         "length and is not supported by the embedded engine")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


@dataclass
class DecodeInputs:
    """Static-shape inputs of one decode step (the CUDA graph's input buffers)."""
    input_ids: torch.Tensor    # [B] int64
    positions: torch.Tensor    # [B] int64: position of the new token
    req_rows: torch.Tensor     # [B] int64: row of req_to_token
    seq_lens: torch.Tensor     # [B] int64: tokens in the KV after this step (position + 1)
    out_slots: torch.Tensor    # [B] int64: KV slot the new token's key/value go to


# Auto prefill attention pads (one SDPA call per layer) unless padding would cost more than this
# many times the real tokens: on an H200 (0.2B model, 32 prompts of 48 tokens) the padded path's
# prefill took 10.4 ms against varlen's 17.6, whose per-call host cost (a torch custom op) is the
# difference; varlen pays off where lengths are uneven enough for padding to dominate.
VARLEN_PAD_RATIO = 2.0


def _prefill_sdpa_backends(cuda: bool):
    """On CUDA, SDPA without the cuDNN backend: cuDNN builds an execution plan for every new
    shape (reported at hundreds of ms each, and each prefill batch has a new [B, Tmax]); flash
    and memory-efficient kernels have no per-shape set-up."""
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@dataclass
class PrefillInputs:
    """Device inputs of one prefill over B sequences: T new tokens in all, padded to Tmax, after
    cached prefixes of `prefix_lens` tokens whose K/V are already in the pool (0: fresh)."""
    input_ids: torch.Tensor    # [T] int64, the new tokens of every sequence concatenated
    positions: torch.Tensor    # [T] int64
    slots: torch.Tensor        # [T] int64: KV slot of each token
    cu_seqlens: torch.Tensor   # [B + 1] int32: where each sequence starts, then T
    pad_index: torch.Tensor    # [B * Tmax] int64: flat token behind each padded position
    valid_index: torch.Tensor  # [T] int64: padded position of each token
    token_rows: torch.Tensor   # [T] int64: req_to_token row of each token's request
    logit_index: torch.Tensor  # [W] int64: the tokens whose logits are wanted
    prefix: torch.Tensor       # [B] int64: cached tokens before each sequence's new ones
    rows: torch.Tensor         # [B] int64: req_to_token row of each sequence
    table_rows: torch.Tensor   # [P] int64: req_to_token entries of the cached prefixes (row,
    table_positions: torch.Tensor  # position, slot); empty for fresh sequences
    table_slots: torch.Tensor
    batch: int
    max_len: int
    max_kv: int                # longest prefix + new tokens (keys an extend prefill reads)

    @property
    def extend(self) -> bool:
        return self.table_slots.shape[0] > 0

    @classmethod
    def build(cls, seqs: list[list[int]], slots: list[np.ndarray], rows: list[int],
              logit_starts: list[int], device: torch.device,
              prefix_lens: list[int] | None = None) -> PrefillInputs:
        """`seqs[i]`/`slots[i]` are whole sequences (prefix included); `logit_starts[i]` >=
        `prefix_lens[i]`. Every index computed on the host and moved in one transfer: the forward
        then runs without a device sync."""
        pre = np.asarray(prefix_lens or [0] * len(seqs), dtype=np.int64)
        full = np.asarray([len(q) for q in seqs], dtype=np.int64)
        lens = full - pre
        if (lens < 1).any():
            raise ValueError(f"prefix_lens: {pre.tolist()} leave no new token in sequences of {full.tolist()}")
        B, T, Tmax = len(seqs), int(lens.sum()), int(lens.max())
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        ar = np.arange(Tmax)
        valid = ar[None, :] < lens[:, None]
        # A padded position reads token 0: as a key it comes after every real token of its row
        # (hidden by the causal mask), as a query its output is dropped, so any real token will
        # do (and no zero row has to be appended to q/k/v in every layer).
        pad_index = np.where(valid, starts[:, None] + ar[None, :], 0).reshape(-1)
        valid_index = np.flatnonzero(valid.reshape(-1))
        positions = np.concatenate([np.arange(p, n) for p, n in zip(pre, full)])
        logit_index = np.concatenate([np.arange(o + first - p, o + n)
                                      for o, n, first, p in zip(starts, lens, logit_starts, pre)])
        rows_np = np.asarray(rows, dtype=np.int64)
        new_ids = (t for q, p in zip(seqs, pre) for t in q[p:])
        cached = pre > 0
        parts = [np.fromiter(new_ids, dtype=np.int64, count=T), positions,
                 np.concatenate([s[p:] for s, p in zip(slots, pre)]), np.append(starts, T), pad_index,
                 valid_index, np.repeat(rows_np, lens), logit_index, pre, rows_np,
                 np.repeat(rows_np[cached], pre[cached]),
                 np.concatenate([np.arange(p) for p in pre[cached]] or [np.zeros(0, np.int64)]),
                 np.concatenate([s[:p] for s, p in zip(slots, pre) if p] or [np.zeros(0, np.int64)])]
        dev = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)
        split = list(torch.split(dev, [len(p) for p in parts]))
        split[3] = split[3].to(torch.int32)
        return cls(*split, batch=B, max_len=Tmax, max_kv=int(full.max()))


class Model:
    """The forward. `kv` is a kv_cache.KVPool; routing is captured per MoE layer when asked."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype, max_positions: int,
                 tp=None):
        self.config = config
        self.full_shape = shape_from_config(config)
        self.tp = tp if tp is not None and tp.size > 1 else None  # a tp.TPGroup
        size, rank = (self.tp.size, self.tp.rank) if self.tp else (1, 0)
        self.weights = Weights(self.full_shape, device, dtype, tp_rank=rank, tp_size=size)
        self.shape = local_shape(self.full_shape, size)  # this rank's heads and rows
        self.device, self.dtype = device, dtype
        inv_freq, scaling = rope_inv_freq(config, self.shape)
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos/sin computed in fp32 like HF, then cast to the activation dtype like HF.
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)
        self.scaling = self.shape.head_dim ** -0.5
        self.varlen = None  # packed causal attention for prefill (set by the runner on CUDA)
        self.varlen_always = False  # else only for batches that padding would mostly waste

    # ---- building blocks -----------------------------------------------------------------

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results (after o_proj, down_proj, experts); tp=1: as it is."""
        if self.tp is not None:
            self.tp.all_reduce(x)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.weights.embed[ids]
        # vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is exact
        w = self.weights
        local = ids - w.vocab_start
        mine = (local >= 0) & (local < w.embed.shape[0])
        x = w.embed[local.clamp(0, w.embed.shape[0] - 1)] * mine[:, None].to(w.embed.dtype)
        return self._reduce(x)

    @staticmethod
    def _linear(L, key: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The dense linears' one seam (q|k|v, o, gate|up, down): `L[key]` is a weight in the engine
        dtype (F.linear) or, under --fp8-gemm, a quantized.FP8Linear (the FP8 block-wise GEMM)."""
        w = L[key]
        return F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w(x, bias)

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        # HF: normalise in fp32, cast back, then scale by the weight in the activation dtype.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.rms_norm_eps).to(x.dtype)
        return h if w is None else w * h

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, d]; cos/sin [T, 1, d]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, d] of `positions`, looked up once per forward for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _qkv(self, L, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        # q and k heads are normalised and rotated together (one set of kernels, not two): the
        # per-head math is identical, only the norm weights differ (applied on the two views).
        s = self.shape
        qkv = self._linear(L, "qkv_w", h, L.get("qkv_b"))
        T, H, d = qkv.shape[0], s.num_heads, s.head_dim
        qk = qkv[:, :s.q_size + s.kv_size].view(T, H + s.num_kv_heads, d)
        v = qkv[:, s.q_size + s.kv_size:].view(T, s.num_kv_heads, d)
        if s.qk_norm:
            qk = self._rms(qk, None)
            qk[:, :H] *= L["q_norm"]
            qk[:, H:] *= L["k_norm"]
        qk = self._rope(qk, *rope)
        return qk[:, :H], qk[:, H:], v

    def _mlp(self, i: int, L, h: torch.Tensor, routing_out: list | None) -> torch.Tensor:
        if "router_w" not in L:
            gate, up = self._linear(L, "gate_up_w", h).chunk(2, dim=-1)
            return self._reduce(self._linear(L, "down_w", F.silu(gate) * up))
        s = self.shape
        logits = F.linear(h, L["router_w"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, s.num_experts_per_tok, dim=-1)
        if s.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        if routing_out is not None:
            routing_out.append(top_i)
        return self._reduce(self._experts(L, h, top_i, top_w))

    def _experts(self, L, h, top_i, top_w) -> torch.Tensor:
        """Loop over the experts that got tokens (data-dependent shapes: eager only). With EP
        (tp > 1) only this rank's experts run; the caller sums the ranks' outputs."""
        out = torch.zeros_like(h)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.shape.num_experts).tolist()
        token_of = order // top_i.shape[1]
        weight_of = top_w.reshape(-1)[order]
        first, held = self.weights.expert_start, L["experts_gate_up"].shape[0]
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or not first <= e < first + held:
                start += n
                continue
            tok = token_of[start:start + n]
            gate, up = F.linear(h[tok], L["experts_gate_up"][e - first]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, L["experts_down"][e - first]) * weight_of[start:start + n, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out

    def _experts_dense(self, L, h, top_i, top_w) -> torch.Tensor:
        """Static-shape MoE (every expert on every token, weighted by a dense routing matrix).

        E/top_k times the FLOPs of the sparse loop, but capturable in a CUDA graph; used only for
        small decode batches of small MoE models (runner decides).
        """
        E = self.shape.num_experts
        dense_w = torch.zeros(h.shape[0], E, device=h.device, dtype=h.dtype)
        dense_w.scatter_(1, top_i, top_w)
        first, held = self.weights.expert_start, L["experts_gate_up"].shape[0]
        dense_w = dense_w[:, first:first + held]  # EP: this rank's experts (all of them at tp=1)
        gu = torch.einsum("th,eoh->eto", h, L["experts_gate_up"])
        gate, up = gu.chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, L["experts_down"])
        return torch.einsum("eth,te->th", y, dense_w)

    def _o_proj(self, L, attn: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._linear(L, "o_w", attn, L.get("o_b"))
        o = self._reduce(self._linear(L, "o_w", attn))
        return o + L["o_b"] if "o_b" in L else o

    def _layer_end(self, i, L, x, attn, routing_out):
        x = x + self._o_proj(L, attn)
        return x + self._mlp(i, L, self._rms(x, L["post_norm"]), routing_out)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms(x, self.weights.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of (already normed) hidden states; the matmul runs in the model dtype like HF."""
        local = F.linear(hidden, self.weights.lm_head).float()
        return local if self.tp is None else self.tp.gather_last(local)  # vocab-parallel

    # ---- prefill: new tokens, after a cached prefix or fresh --------------------------------

    def prefill(self, inp: PrefillInputs, kv, capture_routing: bool):
        """Forward over the concatenated new tokens; writes their K/V into `kv` at `inp.slots`.

        With cached prefixes (`inp.extend`, the prefix cache's hits) the new tokens' queries attend
        over the keys gathered from the pool through `req_to_token` (prefix and new alike), with a
        mask that lets query p see keys 0..p (`_extend_attention`); the fresh path is unchanged.

        Attention is causal within each sequence: SDPA with `is_causal` over a right-padded
        [B, Tmax] view (a padded key only ever follows a sequence's real tokens, so the causal
        mask alone hides it; padded queries are dropped), or the FlashAttention varlen kernel over
        the packed tokens when `self.varlen` is set (CUDA, found working at start-up) and either
        `varlen_always` or padding would more than double the work (B * Tmax > 2T). Every index
        comes in `inp`, built on the host: the forward never syncs the device.
        Returns (normed hidden [T, H], routing [T, moe_layers, top_k] or None).
        """
        s = self.shape
        B, Tmax, T = inp.batch, inp.max_len, inp.input_ids.shape[0]
        g = s.num_heads // s.num_kv_heads
        cuda = inp.input_ids.is_cuda
        use_varlen = self.varlen is not None and (self.varlen_always or B * Tmax > VARLEN_PAD_RATIO * T)
        rope = self._rope_at(inp.positions)
        routing: list | None = [] if capture_routing else None
        x = self._embed(inp.input_ids)
        if inp.extend:
            # Keys padded to a multiple of 64 (within the table): CUDA's memory-efficient SDPA
            # kernel wants an aligned mask, and fewer distinct shapes reach the kernels.
            kmax = min(-(-inp.max_kv // 64) * 64, kv.req_to_token.shape[1])
            q_pos = inp.prefix[:, None] + torch.arange(Tmax, device=x.device)[None, :]     # [B, Tmax]
            mask = torch.arange(kmax, device=x.device)[None, None, :] <= q_pos[:, :, None]
            ext = (kv.req_to_token[inp.rows, :kmax], mask[:, None])  # [B, Kmax], [B, 1, Tmax, Kmax]
        with _prefill_sdpa_backends(cuda):
            for i, L in enumerate(self.weights.layers):
                h = self._rms(x, L["in_norm"])
                q, k, v = self._qkv(L, h, rope)
                kv.write(i, inp.slots, k, v)
                if inp.extend:
                    o = self._extend_attention(i, q, inp, kv, *ext)
                elif use_varlen:
                    o = self.varlen(q.contiguous(), k.contiguous(), v.contiguous(), inp.cu_seqlens, Tmax,
                                    self.scaling)
                    o = o.reshape(T, s.q_size)
                else:
                    pad = lambda t: t.index_select(0, inp.pad_index).view(B, Tmax, *t.shape[1:])  # noqa: E731
                    qp, kp, vp = pad(q), pad(k), pad(v)
                    if g > 1 and cuda:  # explicit copies keep the flash kernel eligible
                        kp, vp = kp.repeat_interleave(g, dim=2), vp.repeat_interleave(g, dim=2)
                    o = F.scaled_dot_product_attention(
                        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True,
                        scale=self.scaling, enable_gqa=g > 1 and not cuda)
                    o = o.transpose(1, 2).reshape(B * Tmax, s.q_size).index_select(0, inp.valid_index)
                x = self._layer_end(i, L, x, o, routing)
        hidden = self.final_hidden(x)
        return hidden, (torch.stack(routing, dim=1) if routing else None)

    def _extend_attention(self, layer: int, q: torch.Tensor, inp: PrefillInputs, kv,
                          token_slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """New tokens' queries (padded to [B, Tmax]) over every key of their sequence, read back
        from the pool (the new tokens' own keys were just written there). Keys past a sequence's
        end are stale slots or scratch: finite, and masked because they lie past every query."""
        s = self.shape
        B, Tmax, g = inp.batch, inp.max_len, s.num_heads // s.num_kv_heads
        cuda = q.is_cuda
        keys, values = kv.gather(layer, token_slots)                       # [B, Kmax, kvh, d]
        kp, vp = keys.transpose(1, 2), values.transpose(1, 2)
        if g > 1 and cuda:
            kp, vp = kp.repeat_interleave(g, dim=1), vp.repeat_interleave(g, dim=1)
        qp = q.index_select(0, inp.pad_index).view(B, Tmax, s.num_heads, s.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scaling,
                                           enable_gqa=g > 1 and not cuda)
        return o.transpose(1, 2).reshape(B * Tmax, s.q_size).index_select(0, inp.valid_index)

    # ---- decode: one token per request against the pool ------------------------------------

    def decode(self, inp: DecodeInputs, kv_len_bucket: int, kv, req_to_token: torch.Tensor,
               capture_routing: bool, dense_moe: bool = False,
               segments: list[tuple[int, int, int]] | None = None):
        """One token per row; keys gathered from the pool up to `kv_len_bucket` (static shape).

        `segments` (eager only): contiguous row ranges `(start, end, kv_bucket)` covering the batch,
        each attending over its own bucket, so short rows do not pay for the longest one.
        """
        s = self.shape
        B = inp.input_ids.shape[0]
        g = s.num_heads // s.num_kv_heads
        cpu = inp.input_ids.device.type == "cpu"
        segs = []
        for start, end, tk in (segments or [(0, B, kv_len_bucket)]):
            token_slots = req_to_token[inp.req_rows[start:end], :tk]              # [b, Tk]
            key_mask = torch.arange(tk, device=inp.input_ids.device)[None, :] < inp.seq_lens[start:end, None]
            # CPU: SDPA's mask in the activation dtype; CUDA: added to the fp32 scores below
            bias = torch.zeros(key_mask.shape, device=key_mask.device, dtype=self.dtype if cpu else torch.float)
            bias = bias.masked_fill(~key_mask, float("-inf"))[:, None, None, :]  # [b, 1, 1, Tk]
            segs.append((start, end, token_slots, bias))
        routing: list | None = [] if capture_routing else None
        rope = self._rope_at(inp.positions)
        x = self._embed(inp.input_ids)
        for i, L in enumerate(self.weights.layers):
            h = self._rms(x, L["in_norm"])
            q, k, v = self._qkv(L, h, rope)
            kv.write(i, inp.out_slots, k, v)
            outs = []
            for start, end, token_slots, bias in segs:
                keys, values = kv.gather(i, token_slots)                     # [b, Tk, kvh, d]
                if cpu:
                    qh = q[start:end].view(end - start, s.num_heads, 1, s.head_dim)
                    o_seg = F.scaled_dot_product_attention(
                        qh, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=bias,
                        scale=self.scaling, enable_gqa=g > 1)
                    outs.append(o_seg.reshape(end - start, s.q_size))
                    continue
                qg = q[start:end].view(end - start, s.num_kv_heads, g, s.head_dim)
                scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * self.scaling  # [b, kvh, g, Tk]
                probs = torch.softmax(scores + bias, dim=-1).to(v.dtype)
                outs.append(torch.matmul(probs, values.transpose(1, 2)).reshape(end - start, s.q_size))
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            if dense_moe and "router_w" in L:
                x = x + self._o_proj(L, o)
                hm = self._rms(x, L["post_norm"])
                logits = F.linear(hm, L["router_w"])
                probs_r = torch.softmax(logits, dim=-1, dtype=torch.float)
                top_w, top_i = torch.topk(probs_r, s.num_experts_per_tok, dim=-1)
                if s.norm_topk_prob:
                    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
                if routing is not None:
                    routing.append(top_i)
                x = x + self._reduce(self._experts_dense(L, hm, top_i, top_w.to(hm.dtype)))
            else:
                x = self._layer_end(i, L, x, o, routing)
        hidden = self.final_hidden(x)
        return hidden, (torch.stack(routing, dim=1) if routing else None)

    def fused_decode_supported(self) -> bool:
        """Dense models whose head size the fused kernels tile, with Triton importable."""
        return not self.shape.is_moe and kernels.supports(self.shape.head_dim) and kernels.available()

    def decode_fused(self, inp: DecodeInputs, kv, req_to_token: torch.Tensor,
                     splits: int | None = None) -> torch.Tensor:
        """`decode` of a dense model through the fused kernels (kernels.py): the same math, four
        kernels between the GEMMs of a layer, attention over each row's own length (no kv
        bucket). Returns the final-normed hidden states [B, hidden]."""
        s, layers, eps = self.shape, self.weights.layers, self.shape.rms_norm_eps
        x = self._embed(inp.input_ids).contiguous()
        h = kernels.rms_norm(x, None, layers[0]["in_norm"], eps)
        for i, L in enumerate(layers):
            qkv = self._linear(L, "qkv_w", h, L.get("qkv_b"))
            q = kernels.rope_store(qkv, inp.positions, inp.out_slots, self.cos, self.sin,
                                   L["q_norm"] if s.qk_norm else None,
                                   L["k_norm"] if s.qk_norm else None, kv.k[i], kv.v[i],
                                   s.num_heads, s.num_kv_heads, s.head_dim, eps)
            o = kernels.decode_attention(q, kv.k[i], kv.v[i], req_to_token, inp.req_rows,
                                         inp.seq_lens, self.scaling, splits)
            h = kernels.rms_norm(x, self._o_proj(L, o), L["post_norm"], eps)
            gate_up = self._linear(L, "gate_up_w", h)
            down = self._reduce(self._linear(L, "down_w", kernels.silu_mul(gate_up)))
            nxt = layers[i + 1]["in_norm"] if i + 1 < len(layers) else self.weights.final_norm
            h = kernels.rms_norm(x, down, nxt, eps)
        return h


