"""`Weights`: the engine's parameters as plain tensors, stored fused (q|k|v, gate|up, a layer's
experts in one tensor), with every checkpoint name mapped to a view into them, so that loading and
updating by name is a `view.copy_(tensor)`; and the loader of an HF safetensors directory. The
design decisions are in `model.py`."""

from __future__ import annotations

from pathlib import Path

import torch

from miles.engines.embedded_engine.shapes import ModelShape, check_tp_split

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
