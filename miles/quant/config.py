"""QuantConfig: the `[quant]` section of a recipe (rollout format, training precision, BF16 list).

Design decisions:
- `rollout` names what the engines hold ("bf16" = unquantized, in `engine.dtype`); the trainer's
  exporter quantizes with the same functions the engine dequantizes with (miles/quant/formats.py).
- `keep_bf16` adds to the default keep list (embeddings, lm_head, router, norms; keep.py); entries
  match exactly, as a module prefix at a dot, or as an fnmatch glob, never as a substring.
- `train = "int4_qat"` needs `rollout = "int4"`: QAT exists so the INT4 rollout runs exactly the
  trained values. `train = "fp8"` is torchao float8 on CUDA, refused on a CPU trainer at start.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

RolloutFormat = Literal["bf16", "fp8", "mxfp8", "mxfp4", "nvfp4", "int4"]
TrainPrecision = Literal["bf16", "fp8", "int4_qat"]


class QuantConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # the format engines hold: bf16, fp8 (128x128 blocks), mxfp8, mxfp4, nvfp4, int4
    rollout: RolloutFormat = "bf16"
    # bf16; fp8: torchao float8 training (CUDA); int4_qat: fake-quant for an int4 rollout
    train: TrainPrecision = "bf16"
    keep_bf16: list[str] = []          # extra names / module prefixes / globs kept unquantized
    # elements per int4 group (one scale, and a zero point if asymmetric)
    int4_group_size: Annotated[int, Meta(ge=8, multiple_of=8)] = 128
    int4_symmetric: bool = True        # false: asymmetric groups with a zero point
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"  # torchao float8 (train = "fp8")

    def __post_init__(self) -> None:
        if self.train == "int4_qat" and self.rollout != "int4":
            raise ValueError(f"quant.train: 'int4_qat' needs quant.rollout = 'int4' (got "
                             f"{self.rollout!r}): QAT trains the values the INT4 rollout serves")
        for p in self.keep_bf16:
            if not p or p != p.strip():
                raise ValueError(f"quant.keep_bf16: {p!r} is not a name or glob (empty or padded)")

    @property
    def format(self) -> str | None:
        """The miles.quant format of the rollout, or None for unquantized."""
        if self.rollout == "bf16":
            return None
        if self.rollout == "int4":
            return "int4" if self.int4_symmetric else "int4_asym"
        return self.rollout
