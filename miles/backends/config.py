"""TrainConfig: every knob of a training backend, as one msgspec Struct with its defaults here.

Design decisions:
- One Struct for both backends: `backend` picks the implementation, the optimizer/schedule/
  micro-batching knobs mean the same thing in each. Backend-only knobs are named for their backend.
- The RL objective lives in `miles.algo.LossConfig`; this Struct holds only how the trainer runs
  (model, precision, optimizer, batching, checkpoints). The lead mounts both into the recipe.
- msgspec only type-checks on decode, so `__post_init__` re-checks choices and ranges: a config built
  in Python fails as clearly as one decoded from TOML, naming the key and the bad value.
- `temperature` is here, not in the rollout section, because the trainer must divide its logits by
  the same temperature the engines sampled with or every importance ratio is off; a recipe whose
  `train.temperature` differs from `rollout.temperature` is refused at load (`miles.config`).
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

BackendName = Literal["fsdp", "megatron"]
DTypeName = Literal["bfloat16", "float16", "float32"]
DecayStyle = Literal["constant", "linear", "cosine"]
AttentionName = Literal["packed", "sdpa", "eager"]
OldLogprobSource = Literal["auto", "recompute", "rollout"]

BACKENDS: tuple[str, ...] = BackendName.__args__  # type: ignore[attr-defined]
DTYPES: tuple[str, ...] = DTypeName.__args__  # type: ignore[attr-defined]
DECAY_STYLES: tuple[str, ...] = DecayStyle.__args__  # type: ignore[attr-defined]
ATTENTIONS: tuple[str, ...] = AttentionName.__args__  # type: ignore[attr-defined]
OLD_LOGPROB_SOURCES: tuple[str, ...] = OldLogprobSource.__args__  # type: ignore[attr-defined]


class TrainConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the trainer ranks run: model, precision, optimizer, schedule, batching, checkpoints."""

    backend: BackendName = "fsdp"
    model_path: str = ""            # HF safetensors directory (config.json + *.safetensors)
    ref_model_path: str = ""        # frozen reference for the KL loss; "" = model_path
    use_ref_model: bool | None = None  # None: on exactly when the loss has a KL term

    # --- precision ---
    param_dtype: DTypeName = "bfloat16"   # compute dtype: forward/backward, exported weights
    master_weights_fp32: bool = True      # keep fp32 sharded params (the optimizer's copy)
    reduce_dtype: DTypeName = "float32"   # gradient reduce-scatter dtype

    # --- optimizer (AdamW) ---
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    grad_clip: float = 1.0                # max global grad norm; 0 = no clipping
    warmup_steps: int = 0
    lr_decay_style: DecayStyle = "constant"
    lr_decay_steps: int = 0               # optimizer steps from the start to min_lr; 0 = no decay

    # --- batching ---
    max_tokens_per_microbatch: int = 8192  # packing budget per rank per forward
    steps_per_train: int = 1               # optimizer steps per train() call (batch split by rollout)
    # The old policy of PPO's ratio. auto: recompute when steps_per_train > 1, else none (ratio 1,
    # right only on-policy); a recipe whose loop trains stale samples resolves auto to "rollout"
    # at load (miles.config), so an async run is clipped against the policy that sampled.
    old_logprobs: OldLogprobSource = "auto"
    temperature: float = 1.0               # the rollout sampling temperature
    reward_key: str = ""                   # which entry of a dict reward to train on
    logprob_chunk_bytes: int = 1 << 30     # fp32 logits materialized at once when computing log-probs

    # --- model execution ---
    attention: AttentionName = "packed"    # packed: per-sample kernels; sdpa/eager: HF with a mask
    gradient_checkpointing: bool = False
    compile: bool | None = None            # torch.compile norms, dense MLPs, rotary; None: on CUDA
    reshard_after_forward: bool | None = None  # None: only with several ranks (FSDP2's knob)
    seed: int = 1234

    # --- weights out ---
    update_bucket_bytes: int = 512 << 20   # bytes of full tensors per send_bucket call

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _choice("param_dtype", self.param_dtype, DTYPES)
        _choice("reduce_dtype", self.reduce_dtype, DTYPES)
        _choice("lr_decay_style", self.lr_decay_style, DECAY_STYLES)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("old_logprobs", self.old_logprobs, OLD_LOGPROB_SOURCES)
        _number("lr", self.lr, low=0.0)
        _number("min_lr", self.min_lr, low=0.0, high=self.lr)
        _number("weight_decay", self.weight_decay, low=0.0)
        _number("adam_beta1", self.adam_beta1, low=0.0, high=1.0)
        _number("adam_beta2", self.adam_beta2, low=0.0, high=1.0)
        _number("adam_eps", self.adam_eps, low=0.0, low_open=True)
        _number("grad_clip", self.grad_clip, low=0.0)
        _number("temperature", self.temperature, low=0.0, low_open=True)
        _count("warmup_steps", self.warmup_steps, low=0)
        _count("lr_decay_steps", self.lr_decay_steps, low=0)
        _count("max_tokens_per_microbatch", self.max_tokens_per_microbatch, low=2)
        _count("steps_per_train", self.steps_per_train, low=1)
        _count("logprob_chunk_bytes", self.logprob_chunk_bytes, low=1)
        _count("update_bucket_bytes", self.update_bucket_bytes, low=1)
        _count("seed", self.seed, low=0)
        if self.lr_decay_style != "constant" and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps} must exceed warmup_steps="
                             f"{self.warmup_steps} when lr_decay_style={self.lr_decay_style!r}")
        if self.old_logprobs == "rollout" and self.steps_per_train > 1:
            # With several steps per batch the rollout log-probs no longer describe the policy
            # that the later steps start from; recompute is the only correct choice.
            raise ValueError("old_logprobs='rollout' needs steps_per_train=1, got "
                             f"steps_per_train={self.steps_per_train}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"train.{name}={value!r} is not one of {', '.join(allowed)}")


def _number(name: str, value: float, *, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"train.{name}={value!r} must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"train.{name}={value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"train.{name}={value!r} must be <= {high}")


def _count(name: str, value: int, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"train.{name}={value!r} must be an integer >= {low}")
