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
- Two attention paths: `prefill` (fresh sequences, padded batch + SDPA with a causal/padding mask)
  and `decode` (one new token per request, gathering its keys from the pool through
  `req_to_token`). The decode path has static shapes given (batch, kv bucket), which is what lets
  runner.py capture it in a CUDA graph.
- Decode attention on CPU is one SDPA call (`enable_gqa`, additive mask) over the gathered keys:
  the matmul form below permutes the keys and values into copies and upcasts the scores, and
  SDPA's CPU kernel reads them as they are (28 rows x 256 keys, 2 kv heads: 0.9 ms against 4.9 ms
  per layer; equal to 5e-7 in fp32). On CUDA the matmul form stays, the one the GPU tests (HF
  agreement, graph == eager) were run on, until SDPA's kernels there are measured and tested
  under capture.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")


@dataclass
class ModelShape:
    """What the forward needs to know from config.json."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_hf_config(model_path: str | Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(model_path))


def shape_from_config(config) -> ModelShape:
    mt = config.model_type
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.model_type: {mt!r} is not supported by the embedded engine; "
                         f"expected one of {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("config.use_sliding_window: true is not supported by the embedded engine")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    moe_layers: list[int] = []
    if mt == "qwen3_moe" and config.num_experts > 0:
        skip = set(getattr(config, "mlp_only_layers", []) or [])
        moe_layers = [i for i in range(config.num_hidden_layers)
                      if i not in skip and (i + 1) % config.decoder_sparse_step == 0]
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelShape(
        model_type=mt, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=True if mt == "qwen2" else attention_bias,
        o_bias=False if mt == "qwen2" else attention_bias,
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        max_position_embeddings=config.max_position_embeddings, eos_token_ids=eos_ids,
        num_experts=getattr(config, "num_experts", 0) or 0,
        num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) or 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
        moe_layers=moe_layers, architectures=list(getattr(config, "architectures", None) or []))


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


class Weights:
    """Fused weight storage plus a name -> view map in checkpoint naming."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype):
        s = shape
        self.shape, self.device, self.dtype = s, device, dtype
        new = lambda *dims: torch.zeros(*dims, device=device, dtype=dtype)  # noqa: E731
        self.embed = new(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else new(s.vocab_size, s.hidden_size)
        self.final_norm = new(s.hidden_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        self.names: dict[str, torch.Tensor] = {}   # checkpoint name -> view (what checksums cover)
        self.aliases: dict[str, torch.Tensor] = {}  # other accepted names (fused HF, tied lm_head)
        self.alias_covers: dict[str, list[str]] = {}  # alias -> the checkpoint names it writes
        self.names["model.embed_tokens.weight"] = self.embed
        self.names["model.norm.weight"] = self.final_norm
        if s.tie_word_embeddings:
            self.aliases["lm_head.weight"] = self.embed
            self.alias_covers["lm_head.weight"] = ["model.embed_tokens.weight"]
        else:
            self.names["lm_head.weight"] = self.lm_head
        qkv_rows = s.q_size + 2 * s.kv_size
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            L: dict[str, torch.Tensor] = {
                "in_norm": new(s.hidden_size), "post_norm": new(s.hidden_size),
                "qkv_w": new(qkv_rows, s.hidden_size), "o_w": new(s.hidden_size, s.q_size)}
            self.names[p + "input_layernorm.weight"] = L["in_norm"]
            self.names[p + "post_attention_layernorm.weight"] = L["post_norm"]
            self._split(p + "self_attn.{}_proj.weight", L["qkv_w"], ("q", "k", "v"),
                        (s.q_size, s.kv_size, s.kv_size))
            self.names[p + "self_attn.o_proj.weight"] = L["o_w"]
            if s.qkv_bias:
                L["qkv_b"] = new(qkv_rows)
                self._split(p + "self_attn.{}_proj.bias", L["qkv_b"], ("q", "k", "v"),
                            (s.q_size, s.kv_size, s.kv_size))
            if s.o_bias:
                L["o_b"] = new(s.hidden_size)
                self.names[p + "self_attn.o_proj.bias"] = L["o_b"]
            if s.qk_norm:
                L["q_norm"], L["k_norm"] = new(s.head_dim), new(s.head_dim)
                self.names[p + "self_attn.q_norm.weight"] = L["q_norm"]
                self.names[p + "self_attn.k_norm.weight"] = L["k_norm"]
            if i in s.moe_layers:
                E, I = s.num_experts, s.moe_intermediate_size
                L["router_w"] = new(E, s.hidden_size)
                L["experts_gate_up"] = new(E, 2 * I, s.hidden_size)
                L["experts_down"] = new(E, s.hidden_size, I)
                self.names[p + "mlp.gate.weight"] = L["router_w"]
                for e in range(E):
                    q = f"{p}mlp.experts.{e}."
                    self.names[q + "gate_proj.weight"] = L["experts_gate_up"][e, :I]
                    self.names[q + "up_proj.weight"] = L["experts_gate_up"][e, I:]
                    self.names[q + "down_proj.weight"] = L["experts_down"][e]
                self.aliases[p + "mlp.experts.gate_up_proj"] = L["experts_gate_up"]
                self.aliases[p + "mlp.experts.down_proj"] = L["experts_down"]
                self.alias_covers[p + "mlp.experts.gate_up_proj"] = [
                    f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]
                self.alias_covers[p + "mlp.experts.down_proj"] = [
                    f"{p}mlp.experts.{e}.down_proj.weight" for e in range(E)]
            else:
                inter = s.intermediate_size
                L["gate_up_w"] = new(2 * inter, s.hidden_size)
                L["down_w"] = new(s.hidden_size, inter)
                self._split(p + "mlp.{}_proj.weight", L["gate_up_w"], ("gate", "up"), (inter, inter))
                self.names[p + "mlp.down_proj.weight"] = L["down_w"]
            self.layers.append(L)

    def _split(self, pattern: str, fused: torch.Tensor, parts, sizes) -> None:
        start = 0
        for part, size in zip(parts, sizes):
            self.names[pattern.format(part)] = fused[start:start + size]
            start += size

    def lookup(self, name: str) -> torch.Tensor:
        """The storage a checkpoint/SGLang/transformers name writes to; KeyError names the field."""
        if name in self.names:
            return self.names[name]
        if name in self.aliases:
            return self.aliases[name]
        raise KeyError(f"weight name {name!r} is not a parameter of this {self.shape.model_type} "
                       f"model (e.g. {next(iter(self.names))!r})")

    def copy_in(self, name: str, tensor: torch.Tensor) -> None:
        dst = self.lookup(name)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected "
                             f"{tuple(dst.shape)}")
        dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype), non_blocking=False)

    def numel(self) -> int:
        return sum(t.numel() for t in self.names.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.names.values())


IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors_dir(weights: Weights, model_path: str | Path) -> list[str]:
    """Copy every tensor of the checkpoint into `weights`; returns the names that were missing."""
    from safetensors import safe_open
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path {str(path)!r}: no *.safetensors files")
    seen: set[str] = set()
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                        continue
                    weights.copy_in(name, st.get_tensor(name))
                    seen.add(name)
                    seen.update(weights.alias_covers.get(name, ()))
    return [n for n in weights.names if n not in seen]


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
    """Device inputs of one prefill over B fresh sequences of T tokens in all, padded to Tmax."""
    input_ids: torch.Tensor    # [T] int64, the sequences concatenated
    positions: torch.Tensor    # [T] int64
    slots: torch.Tensor        # [T] int64: KV slot of each token
    cu_seqlens: torch.Tensor   # [B + 1] int32: where each sequence starts, then T
    pad_index: torch.Tensor    # [B * Tmax] int64: flat token behind each padded position
    valid_index: torch.Tensor  # [T] int64: padded position of each token
    token_rows: torch.Tensor   # [T] int64: req_to_token row of each token's request
    logit_index: torch.Tensor  # [W] int64: the tokens whose logits are wanted
    batch: int
    max_len: int

    @classmethod
    def build(cls, seqs: list[list[int]], slots: list[np.ndarray], rows: list[int],
              logit_starts: list[int], device: torch.device) -> PrefillInputs:
        """Every index computed on the host and moved in one transfer: the forward then runs
        without a device sync."""
        lens = np.asarray([len(q) for q in seqs], dtype=np.int64)
        B, T, Tmax = len(seqs), int(lens.sum()), int(lens.max())
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        ar = np.arange(Tmax)
        valid = ar[None, :] < lens[:, None]
        # A padded position reads token 0: as a key it comes after every real token of its row
        # (hidden by the causal mask), as a query its output is dropped, so any real token will
        # do (and no zero row has to be appended to q/k/v in every layer).
        pad_index = np.where(valid, starts[:, None] + ar[None, :], 0).reshape(-1)
        valid_index = np.flatnonzero(valid.reshape(-1))
        positions = np.concatenate([np.arange(n) for n in lens])
        logit_index = np.concatenate([np.arange(o + first, o + n)
                                      for o, n, first in zip(starts, lens, logit_starts)])
        parts = [np.fromiter((t for q in seqs for t in q), dtype=np.int64, count=T), positions,
                 np.concatenate(slots), np.append(starts, T), pad_index, valid_index,
                 np.repeat(np.asarray(rows, dtype=np.int64), lens), logit_index]
        dev = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)
        split = list(torch.split(dev, [len(p) for p in parts]))
        split[3] = split[3].to(torch.int32)
        return cls(*split, batch=B, max_len=Tmax)


class Model:
    """The forward. `kv` is a kv_cache.KVPool; routing is captured per MoE layer when asked."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype, max_positions: int):
        self.config = config
        self.shape = shape_from_config(config)
        self.device, self.dtype = device, dtype
        self.weights = Weights(self.shape, device, dtype)
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
        qkv = F.linear(h, L["qkv_w"], L.get("qkv_b"))
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
            gate, up = F.linear(h, L["gate_up_w"]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, L["down_w"])
        s = self.shape
        logits = F.linear(h, L["router_w"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, s.num_experts_per_tok, dim=-1)
        if s.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        if routing_out is not None:
            routing_out.append(top_i)
        return self._experts(L, h, top_i, top_w)

    def _experts(self, L, h, top_i, top_w) -> torch.Tensor:
        """Loop over the experts that got tokens (data-dependent shapes: eager only)."""
        out = torch.zeros_like(h)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.shape.num_experts).tolist()
        token_of = order // top_i.shape[1]
        weight_of = top_w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            gate, up = F.linear(h[tok], L["experts_gate_up"][e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, L["experts_down"][e]) * weight_of[start:start + n, None]
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
        gu = torch.einsum("th,eoh->eto", h, L["experts_gate_up"])
        gate, up = gu.chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, L["experts_down"])
        return torch.einsum("eth,te->th", y, dense_w)

    def _layer_end(self, i, L, x, attn, routing_out):
        x = x + F.linear(attn, L["o_w"], L.get("o_b"))
        return x + self._mlp(i, L, self._rms(x, L["post_norm"]), routing_out)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms(x, self.weights.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of (already normed) hidden states; the matmul runs in the model dtype like HF."""
        return F.linear(hidden, self.weights.lm_head).float()

    # ---- prefill: fresh sequences, no cached prefix ----------------------------------------

    def prefill(self, inp: PrefillInputs, kv, capture_routing: bool):
        """Forward over concatenated fresh sequences; writes their K/V into `kv` at `inp.slots`.

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
        x = self.weights.embed[inp.input_ids]
        with _prefill_sdpa_backends(cuda):
            for i, L in enumerate(self.weights.layers):
                h = self._rms(x, L["in_norm"])
                q, k, v = self._qkv(L, h, rope)
                kv.write(i, inp.slots, k, v)
                if use_varlen:
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
        x = self.weights.embed[inp.input_ids]
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
                x = x + F.linear(o, L["o_w"], L.get("o_b"))
                hm = self._rms(x, L["post_norm"])
                logits = F.linear(hm, L["router_w"])
                probs_r = torch.softmax(logits, dim=-1, dtype=torch.float)
                top_w, top_i = torch.topk(probs_r, s.num_experts_per_tok, dim=-1)
                if s.norm_topk_prob:
                    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
                if routing is not None:
                    routing.append(top_i)
                x = x + self._experts_dense(L, hm, top_i, top_w.to(hm.dtype))
            else:
                x = self._layer_end(i, L, x, o, routing)
        hidden = self.final_hidden(x)
        return hidden, (torch.stack(routing, dim=1) if routing else None)


def read_generation_eos(model_path: str | Path) -> list[int]:
    """EOS ids from generation_config.json (HF's generate stops on these too)."""
    p = Path(model_path) / "generation_config.json"
    if not p.exists():
        return []
    eos = json.loads(p.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def kv_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    return 2 * shape.num_layers * shape.kv_size * torch.tensor([], dtype=dtype).element_size()


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))
