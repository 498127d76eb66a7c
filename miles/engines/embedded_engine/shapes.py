"""A model's shape as the embedded engine runs it (`ModelShape`, from an HF config), its tensor-
parallel split, and the few numbers derived from it (KV bytes per token, generation EOS ids)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
