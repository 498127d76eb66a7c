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
    """Fused weight storage plus a name -> view map in checkpoint naming.

    With `tp_size` > 1 it holds rank `tp_rank`'s slices only, cut as miles.weights.p2p.TP_RULES
    says (q/k/v and gate/up rows, o_proj and down_proj columns, vocab rows of the embeddings and
    lm_head; norms and the router whole) and its experts (EP: experts in equal contiguous ranges).
    `names` then maps the names it holds to those slices; `full_names` / `full_shapes` describe the
    whole model (what checksums cover and what a full tensor from disk must look like), and
    `copy_in` takes a full tensor and keeps its part.
    """

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1):
        s = shape
        self.shape, self.device, self.dtype = s, device, dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if tp_size > 1:
            check_tp_split(s, tp_size)
            full = Weights(s, torch.device("meta"), dtype)
            self.full_names = list(full.names)
            self.full_shapes = {n: tuple(t.shape) for n, t in {**full.names, **full.aliases}.items()}
        tp = tp_size
        vocab, q_size, kv_size = s.vocab_size // tp, s.q_size // tp, s.kv_size // tp
        new = lambda *dims: torch.zeros(*dims, device=device, dtype=dtype)  # noqa: E731
        self.vocab_start = tp_rank * vocab
        self.embed = new(vocab, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else new(vocab, s.hidden_size)
        self.final_norm = new(s.hidden_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        self.names: dict[str, torch.Tensor] = {}   # checkpoint name -> view (what checksums cover)
        self.aliases: dict[str, torch.Tensor] = {}  # other accepted names (fused HF, tied lm_head)
        self.alias_covers: dict[str, list[str]] = {}  # alias -> the checkpoint names it writes
        self.not_held: set[str] = set()  # tp > 1: experts other ranks hold (skipped on load)
        self.quant = None  # a quantized.QuantLoader with --quantization: takes quantized parts
        # --fp8-gemm: checkpoint name -> quantized.FP8Rows, for the dense weights held in FP8 (their
        # `names` entry is then a meta tensor: shape and dtype, no storage)
        self.fp8: dict = {}
        self.names["model.embed_tokens.weight"] = self.embed
        self.names["model.norm.weight"] = self.final_norm
        if s.tie_word_embeddings:
            self.aliases["lm_head.weight"] = self.embed
            self.alias_covers["lm_head.weight"] = ["model.embed_tokens.weight"]
        else:
            self.names["lm_head.weight"] = self.lm_head
        qkv_rows = q_size + 2 * kv_size
        n_local = s.num_experts // tp
        self.expert_start = tp_rank * n_local
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            L: dict[str, torch.Tensor] = {
                "in_norm": new(s.hidden_size), "post_norm": new(s.hidden_size),
                "qkv_w": new(qkv_rows, s.hidden_size), "o_w": new(s.hidden_size, q_size)}
            self.names[p + "input_layernorm.weight"] = L["in_norm"]
            self.names[p + "post_attention_layernorm.weight"] = L["post_norm"]
            self._split(p + "self_attn.{}_proj.weight", L["qkv_w"], ("q", "k", "v"),
                        (q_size, kv_size, kv_size))
            self.names[p + "self_attn.o_proj.weight"] = L["o_w"]
            if s.qkv_bias:
                L["qkv_b"] = new(qkv_rows)
                self._split(p + "self_attn.{}_proj.bias", L["qkv_b"], ("q", "k", "v"),
                            (q_size, kv_size, kv_size))
            if s.o_bias:  # replicated: added once, after the all-reduce
                L["o_b"] = new(s.hidden_size)
                self.names[p + "self_attn.o_proj.bias"] = L["o_b"]
            if s.qk_norm:
                L["q_norm"], L["k_norm"] = new(s.head_dim), new(s.head_dim)
                self.names[p + "self_attn.q_norm.weight"] = L["q_norm"]
                self.names[p + "self_attn.k_norm.weight"] = L["k_norm"]
            if i in s.moe_layers:
                E, I = s.num_experts, s.moe_intermediate_size
                L["router_w"] = new(E, s.hidden_size)
                L["experts_gate_up"] = new(n_local, 2 * I, s.hidden_size)
                L["experts_down"] = new(n_local, s.hidden_size, I)
                self.names[p + "mlp.gate.weight"] = L["router_w"]
                for e in range(E):
                    q = f"{p}mlp.experts.{e}."
                    local = e - self.expert_start
                    if not 0 <= local < n_local:
                        self.not_held.update(q + w for w in ("gate_proj.weight", "up_proj.weight",
                                                             "down_proj.weight"))
                        continue
                    self.names[q + "gate_proj.weight"] = L["experts_gate_up"][local, :I]
                    self.names[q + "up_proj.weight"] = L["experts_gate_up"][local, I:]
                    self.names[q + "down_proj.weight"] = L["experts_down"][local]
                self.aliases[p + "mlp.experts.gate_up_proj"] = L["experts_gate_up"]
                self.aliases[p + "mlp.experts.down_proj"] = L["experts_down"]
                self.alias_covers[p + "mlp.experts.gate_up_proj"] = [
                    f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]
                self.alias_covers[p + "mlp.experts.down_proj"] = [
                    f"{p}mlp.experts.{e}.down_proj.weight" for e in range(E)]
            else:
                inter = s.intermediate_size // tp
                L["gate_up_w"] = new(2 * inter, s.hidden_size)
                L["down_w"] = new(s.hidden_size, inter)
                self._split(p + "mlp.{}_proj.weight", L["gate_up_w"], ("gate", "up"), (inter, inter))
                self.names[p + "mlp.down_proj.weight"] = L["down_w"]
            self.layers.append(L)
        if tp_size == 1:
            self.full_names = list(self.names)
            self.full_shapes = {n: tuple(t.shape) for n, t in {**self.names, **self.aliases}.items()}

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The whole model's shape of `name` (what a checkpoint holds); KeyError names the field."""
        if name in self.full_shapes:
            return self.full_shapes[name]
        self.lookup(name)  # raises the KeyError that names the weight
        return tuple(self.lookup(name).shape)

    def box(self, name: str, rank: int | None = None):
        """Where rank `rank`'s part of `name` lies in the full tensor (p2p.engine_box), or None."""
        from miles.weights.p2p import EngineLayout, TensorSpec, engine_box
        rank = self.tp_rank if rank is None else rank
        shape = list(self.full_shapes[name])
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # fused experts
            n = shape[0] // self.tp_size
            return [(rank * n, n)] + [(0, d) for d in shape[1:]]
        return engine_box(TensorSpec(name, shape), EngineLayout(tp=self.tp_size), rank,
                          self.shape.num_experts if self.shape.is_moe else 0)

    def local_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (tp > 1); any other tensor as it is."""
        if self.tp_size == 1 or tuple(tensor.shape) != self.full_shapes.get(name):
            return tensor
        from miles.weights.p2p import region
        return region(tensor, self.box(name))

    def _split(self, pattern: str, fused: torch.Tensor, parts, sizes) -> None:
        start = 0
        for part, size in zip(parts, sizes):
            self.names[pattern.format(part)] = fused[start:start + size]
            start += size

    def lookup(self, name: str) -> torch.Tensor:
        """The storage a checkpoint/SGLang/transformers name writes to; KeyError names the field."""
        if name in self.fp8:  # held in FP8: the dequantized value, computed on demand
            return self.fp8[name].dequantized(self.dtype)
        if name in self.names:
            return self.names[name]
        if name in self.aliases:
            return self.aliases[name]
        hint = ""
        if name.endswith(("_scale", "_scale_inv", "_scale_2", "_packed", "_zero_point", "_shape")):
            hint = (" (a quantized weight's part: start the engine with --quantization FMT, the "
                    "trainer's quant.rollout)" if self.quant is None else
                    f" (not a part of --quantization {self.quant.fmt})")
        raise KeyError(f"weight name {name!r} is not a parameter of this {self.shape.model_type} "
                       f"model (e.g. {next(iter(self.names))!r}){hint}")

    def copy_in(self, name: str, tensor: torch.Tensor) -> None:
        if self.quant is not None and self.quant.copy_in(name, tensor):
            return
        if name in self.not_held:
            return
        tensor = self.local_part(name, tensor)
        dst = self.lookup(name)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected "
                             f"{tuple(dst.shape)}")
        dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype), non_blocking=False)

    def swap_in(self, named: list[tuple[str, torch.Tensor]], *, allow_swap: bool = True) -> list[str]:
        """Update each weight of `named` by making the given tensor the live one where it can
        (double buffering: the new tensor becomes the weight, the old one is freed once nothing
        holds it), else by `copy_in`. Returns the names that were swapped.

        A swap needs the live weight to be a whole tensor of its own: not a slice of a fused one
        (q/k/v, gate/up, per-expert views), nothing else viewing its storage, not quantized or
        held in FP8, not a TP slice; and the new tensor to match it in shape, dtype and device
        and be contiguous. `allow_swap=False` (a CUDA graph captured the weights' addresses, or a
        colocated trainer writes into them) copies everything. Every reference the forward and
        `lookup` read (`names`, `aliases`, each layer's dict, `embed` / `lm_head` / `final_norm`)
        is redirected, so a tied embedding stays tied."""
        slots: dict[int, list[tuple[dict, str]]] = {}  # id(tensor) -> where it is referenced
        users: dict[int, set[int]] = {}               # storage address -> ids of tensors over it
        containers = [self.names, self.aliases, *self.layers, self.__dict__]
        for box in containers:
            for key, t in list(box.items()):
                if box is self.__dict__ and key not in ("embed", "lm_head", "final_norm"):
                    continue
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                slots.setdefault(id(t), []).append((box, key))
                users.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
        swapped = []
        for name, new in named:
            live = self.lookup(name) if allow_swap and self.quant is None and self.tp_size == 1 \
                and name not in self.fp8 and name not in self.not_held else None
            if live is not None and _whole(live) and _whole(new) and new.shape == live.shape \
                    and new.dtype == live.dtype and new.device == live.device \
                    and users.get(live.untyped_storage().data_ptr()) == {id(live)} \
                    and new.untyped_storage().data_ptr() not in users:
                held = slots.pop(id(live))
                for box, key in held:
                    box[key] = new
                slots[id(new)] = held
                del users[live.untyped_storage().data_ptr()]
                users[new.untyped_storage().data_ptr()] = {id(new)}
                swapped.append(name)
            else:
                self.copy_in(name, new)
        return swapped

    def scatter_target(self, name: str) -> torch.Tensor | None:
        """The live weight `name` as one flat view its new elements can be written into in place
        (a contiguous tensor, or a contiguous slice of a fused one), or None: quantized, held in
        FP8, a TP slice, or not held here."""
        if self.quant is not None or self.tp_size != 1 or name in self.fp8 or name in self.not_held:
            return None
        live = self.lookup(name)
        return live.view(-1) if live.is_contiguous() else None

    def scatter_in(self, name: str, index: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` at the flat positions `index` of weight `name`, in place (a sparse
        delta: the rest of the weight is unchanged, its address too)."""
        flat = self.scatter_target(name)
        if flat is None:
            raise ValueError(f"weight {name!r}: cannot be updated in place element by element "
                             "(quantized, FP8, a TP slice or not contiguous)")
        flat[index.to(flat.device)] = values.to(device=flat.device, dtype=flat.dtype)

    def numel(self) -> int:
        return sum(t.numel() for t in self.names.values())

    def nbytes(self) -> int:
        plain = sum(t.numel() * t.element_size() for n, t in self.names.items() if n not in self.fp8)
        return plain + sum(r.weight.numel() + 4 * r.scale_inv.numel() for r in self.fp8.values())


def _whole(t: torch.Tensor) -> bool:
    """`t` is all of its storage, contiguous: replacing the tensor replaces the storage."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def check_tp_split(shape: ModelShape, tp: int) -> None:
    """Refuse a model that does not split into `tp` ranks, naming the config field and value."""
    fields = [("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads),
              ("vocab_size", shape.vocab_size)]
    if any(i not in shape.moe_layers for i in range(shape.num_layers)):
        fields.append(("intermediate_size", shape.intermediate_size))
    if shape.is_moe:
        fields.append(("num_experts", shape.num_experts))
    for field_name, value in fields:
        if value % tp:
            raise ValueError(f"--tp-size {tp}: config.{field_name}={value} does not split into "
                             f"{tp} tensor-parallel ranks")


def local_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one TP rank's forward sees: its heads, its MLP rows, its vocabulary rows."""
    import dataclasses
    if tp == 1:
        return shape
    return dataclasses.replace(shape, num_heads=shape.num_heads // tp,
                               num_kv_heads=shape.num_kv_heads // tp,
                               intermediate_size=shape.intermediate_size // tp,
                               vocab_size=shape.vocab_size // tp)


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
