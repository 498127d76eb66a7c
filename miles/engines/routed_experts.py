"""Routed experts (MoE routing replay, R3): a model's routing layout from its HF config, and the
engines' `meta_info.routed_experts` payload decoded to [tokens, layers, top_k]."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np


def routed_experts_layout_from_config(model_path: str | Path) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) from an HF config.json, or None for dense models."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    k = cfg.get("num_experts_per_tok")
    return (int(cfg["num_hidden_layers"]), int(k)) if k else None


def num_routed_experts(model_path: str | Path) -> int | None:
    """The routed expert count of an HF config.json (Qwen3-MoE `num_experts`, DeepSeek
    `n_routed_experts`, Mixtral `num_local_experts`), or None for a dense model."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return None


def decode_routed_experts(b64: str, layout: tuple[int, int]) -> np.ndarray:
    layers, top_k = layout
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    if flat.size % (layers * top_k):
        raise ValueError(f"meta_info.routed_experts: {flat.size} int32 values are not a multiple of "
                         f"layers*top_k = {layers}*{top_k}")
    return flat.astype(np.int32, copy=False).reshape(-1, layers, top_k)
