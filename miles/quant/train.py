"""`quant.train`: the model transform a training backend applies before sharding.

    transform = training_transform(recipe.quant)   # None for "bf16"
    transform(lm, device, compute_dtype)           # FSDPBackend._build, before fully_shard

Design decisions:
- One hook, called on the HF model before `fully_shard`: torchao's float8 conversion swaps
  nn.Linear modules, which FSDP2 must see before it records its parameters; QAT only patches
  forwards and would work either way.
- "fp8" is torchao float8 training (tensorwise or rowwise scaling), CUDA only: on a CPU trainer it
  is refused at start with the reason, never silently run in high precision. It trains in FP8
  but exports the high-precision weights; the rollout format is chosen separately
  (`quant.rollout`, e.g. "fp8" 128x128 blocks, which torchao's recipes are not).
- FP8 linears pad their GEMMs' inner dimension to a multiple of 16 (torchao's `pad_inner_dim`):
  the weight-gradient GEMM contracts over the tokens, and a packed micro-batch holds any number
  of them, while `_scaled_mm` needs that dimension divisible by 16 (a shape error in eager mode,
  a failed compile under torch.compile's dynamic shapes). Zeros padded onto a contracted
  dimension add nothing to the product, so results are unchanged; the cost is a copy of the FP8
  operands of each GEMM.
- Megatron has no hook yet: `quant.train` other than "bf16" is refused there (trainer.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles.quant.config import QuantConfig
from miles.quant.keep import KeepList


def training_transform(cfg: QuantConfig) -> Callable | None:
    if cfg.train == "bf16":
        return None
    if cfg.train == "int4_qat":
        def qat(lm, device, compute_dtype):
            from miles.quant.qat import apply_int4_qat
            apply_int4_qat(lm, keep=KeepList(cfg.keep_bf16), fmt=cfg.format or "int4",
                           group_size=cfg.int4_group_size, export_dtype=compute_dtype)
        return qat

    def fp8(lm, device, compute_dtype):
        apply_fp8_training(lm, device, recipe=cfg.fp8_recipe, keep=KeepList(cfg.keep_bf16))
    return fp8


def apply_fp8_training(lm, device: torch.device, *, recipe: str, keep: KeepList) -> int:
    """torchao float8 on the Linears the keep list quantizes (dims divisible by 16); their count."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"quant.train = 'fp8' needs a CUDA trainer (torchao float8 GEMMs run on "
                           f"H100/H200-class GPUs); this trainer runs on {device}. Use quant.train = "
                           "'bf16' here, or keep FP8 to the rollout with quant.rollout = 'fp8'")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("quant.train = 'fp8' needs torchao (pip install torchao)") from e
    names = []

    def wanted(mod, fqn: str) -> bool:
        ok = isinstance(mod, torch.nn.Linear) and keep.quantizes(f"{fqn}.weight", mod.weight) \
            and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        if ok:
            names.append(fqn)
        return ok

    convert_to_float8_training(lm, config=fp8_linear_config(recipe), module_filter_fn=wanted)
    if not names:
        raise RuntimeError("quant.train = 'fp8': no Linear qualified (keep list, dims % 16)")
    return len(names)


def fp8_linear_config(recipe: str):
    """torchao's Float8LinearConfig for `recipe`, with the inner dimension padded to 16 (any
    token count trains, compiled or not)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
