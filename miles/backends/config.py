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
OptimizerOffload = Literal["none", "cpu", "nvme"]
AttentionName = Literal["packed", "sdpa", "eager"]
OldLogprobSource = Literal["auto", "recompute", "rollout"]

BACKENDS: tuple[str, ...] = BackendName.__args__  # type: ignore[attr-defined]
DTYPES: tuple[str, ...] = DTypeName.__args__  # type: ignore[attr-defined]
DECAY_STYLES: tuple[str, ...] = DecayStyle.__args__  # type: ignore[attr-defined]
ATTENTIONS: tuple[str, ...] = AttentionName.__args__  # type: ignore[attr-defined]
OLD_LOGPROB_SOURCES: tuple[str, ...] = OldLogprobSource.__args__  # type: ignore[attr-defined]


RecomputeName = Literal["none", "selective", "full"]
RECOMPUTES: tuple[str, ...] = RecomputeName.__args__  # type: ignore[attr-defined]


class MegatronConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[train.megatron]`: the parallel layout and Megatron-only knobs (`train.backend = "megatron"`).

    The trainer's world is tp x pp x cp x dp ranks (dp is what is left); experts are split over
    `ep` ranks carved out of dp x cp, as megatron-core does. Rank order is megatron's default
    (tp fastest, then cp, then dp, then pp): `trainer_dp_layout` gives each rank's DP index, which
    is what the driver uses to send each rank only its share of the batch's routing (R3)."""

    tp: int = 1                          # tensor parallel
    pp: int = 1                          # pipeline parallel
    cp: int = 1                          # context parallel: each row cut in 2 x cp chunks, K/V all-gathered (local spec)
    ep: int = 1                          # expert parallel
    sequence_parallel: bool | None = None  # None: on exactly when tp > 1 (off beside a PPO critic); MoE with tp > 1 needs it
    distributed_optimizer: bool = True   # shard optimizer state (and fp32 main params) over DP
    recompute: RecomputeName = "none"    # activation recompute: selective (core attention) or full
    use_te: bool | None = None           # Transformer Engine layer spec; None: when importable and cp = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            _count(f"megatron.{name}", getattr(self, name), low=1)
        _choice("megatron.recompute", self.recompute, RECOMPUTES)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel(self, world_size: int) -> int:
        """DP size for `world_size` trainer ranks; a layout that does not divide it is refused."""
        if world_size % self.model_parallel:
            raise ValueError(f"train.megatron: tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = "
                             f"{self.model_parallel} does not divide the {world_size} trainer ranks")
        dp = world_size // self.model_parallel
        if (dp * self.cp) % self.ep:
            raise ValueError(f"train.megatron.ep={self.ep} does not divide dp*cp = {dp}*{self.cp}")
        return dp


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[train.lora]`: LoRA adapters on the policy (miles/backends/lora.py); only they train."""

    # the adapters' rank r
    rank: int = 8
    alpha: float = 16.0                  # the update is scaled by alpha / rank
    # module names that get adapters (peft's target_modules)
    target_modules: list[str] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # dropout on the adapters' input
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _count("lora.rank", self.rank, low=1)
        _number("lora.alpha", self.alpha, low=0.0, low_open=True)
        _number("lora.dropout", self.dropout, low=0.0, high=0.99)
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(f"train.lora.target_modules={self.target_modules!r} must be a non-empty list "
                             "of module names")


class TrainConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the trainer ranks run: model, precision, optimizer, schedule, batching, checkpoints."""

    # fsdp (PyTorch FSDP2) or megatron (megatron-core); nothing above the backend changes
    backend: BackendName = "fsdp"
    model_path: str = ""            # HF safetensors directory (config.json + *.safetensors)
    # frozen reference for the KL loss and the logged ref_kl; "" = model_path, or (FSDP) the warm
    # start's weights once an sft warm start ran in this run
    ref_model_path: str = ""
    # None: on exactly when the loss has a KL term; true also without one, to log ref_kl (the
    # policy's KL to the reference) every RL step, for one no-grad forward of the reference
    use_ref_model: bool | None = None
    # after each weight publish the ranks move parameters, gradients and optimizer state to host
    # memory and take them back before their next call (the backend's sleep / wake_up), so
    # engines colocated on the same GPUs (weights.transport = "colocated") get the memory meanwhile
    sleep_between_steps: bool = False

    # --- PPO critic (algo.advantage_estimator = "ppo"; miles/backends/critic.py): its own AdamW and
    # schedule (the policy's betas, eps, weight decay and clipping) ---
    critic_model_path: str = ""     # the value model's backbone (HF directory); "" = model_path
    # the critic's AdamW learning rate
    critic_lr: float = 1e-5
    # the critic's linear warm-up steps
    critic_warmup_steps: int = 0
    # the critic's schedule after warm-up
    critic_lr_decay_style: DecayStyle = "constant"
    # critic optimizer steps to its min lr; 0 = no decay
    critic_lr_decay_steps: int = 0
    # --- on-policy distillation (algo.opd_kl_coef > 0; miles/backends/teacher.py) ---
    teacher_model_path: str = ""    # frozen teacher scoring every response token (same tokenizer)
    # the teacher is on the rollout side ([teacher], set at launch): no trainer-side teacher is
    # built, and every trained sample must carry Sample.teacher_logprobs
    teacher_from_samples: bool = False
    lora: LoraConfig | None = None  # [train.lora]: train LoRA adapters only; engines get merged weights

    # --- precision ---
    param_dtype: DTypeName = "bfloat16"   # compute dtype: forward/backward, exported weights
    master_weights_fp32: bool = True      # keep fp32 sharded params (the optimizer's copy)
    reduce_dtype: DTypeName = "float32"   # gradient reduce-scatter dtype

    # --- optimizer (AdamW) ---
    # the policy's peak AdamW learning rate
    lr: float = 1e-6
    # where the decay schedule ends
    min_lr: float = 0.0
    # AdamW weight decay (not on 1-D parameters)
    weight_decay: float = 0.0
    # AdamW beta1
    adam_beta1: float = 0.9
    # AdamW beta2
    adam_beta2: float = 0.98
    # AdamW epsilon
    adam_eps: float = 1e-8
    grad_clip: float = 1.0                # max global grad norm; 0 = no clipping
    # Adam moments streamed per bucket through the device from host memory ("cpu") or files
    # under offload_dir ("nvme", node-local), FSDP and Megatron (there without the distributed
    # optimizer: each DP rank holds all moments); miles/backends/optim_offload.py
    optimizer_offload: OptimizerOffload = "none"
    # node-local directory of optimizer_offload = nvme's files
    offload_dir: str = ""
    # linear warm-up optimizer steps from 0 to lr
    warmup_steps: int = 0
    # schedule after warm-up: constant, linear or cosine down to min_lr
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
    # recompute activations in backward (less memory, ~1/3 more compute)
    gradient_checkpointing: bool = False
    router_replay: bool = False            # R3: replay the rollout's MoE routing (set from rollout.r3)
    compile: bool | None = None            # torch.compile norms, dense MLPs, rotary; None: on CUDA
    reshard_after_forward: bool | None = None  # None: only with several ranks (FSDP2's knob)
    # the trainer's seed (initialization of new heads, dropout)
    seed: int = 1234

    # --- weights out ---
    update_bucket_bytes: int = 512 << 20   # bytes of full tensors per send_bucket call

    # --- megatron (train.backend = "megatron"); FSDP ignores it ---
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _choice("param_dtype", self.param_dtype, DTYPES)
        _choice("reduce_dtype", self.reduce_dtype, DTYPES)
        _choice("lr_decay_style", self.lr_decay_style, DECAY_STYLES)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("old_logprobs", self.old_logprobs, OLD_LOGPROB_SOURCES)
        _choice("optimizer_offload", self.optimizer_offload, OptimizerOffload.__args__)  # type: ignore[attr-defined]
        if self.optimizer_offload == "nvme" and not self.offload_dir:
            raise ValueError("train.optimizer_offload='nvme' needs train.offload_dir (a directory on "
                             "node-local NVMe); it is empty")
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
        _number("critic_lr", self.critic_lr, low=0.0)
        _count("critic_warmup_steps", self.critic_warmup_steps, low=0)
        _choice("critic_lr_decay_style", self.critic_lr_decay_style, DECAY_STYLES)
        _count("critic_lr_decay_steps", self.critic_lr_decay_steps, low=0)
        if self.critic_lr_decay_style != "constant" and self.critic_lr_decay_steps <= self.critic_warmup_steps:
            raise ValueError(f"critic_lr_decay_steps={self.critic_lr_decay_steps} must exceed "
                             f"critic_warmup_steps={self.critic_warmup_steps} when "
                             f"critic_lr_decay_style={self.critic_lr_decay_style!r}")
        if self.lr_decay_style != "constant" and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps} must exceed warmup_steps="
                             f"{self.warmup_steps} when lr_decay_style={self.lr_decay_style!r}")
        if self.old_logprobs == "rollout" and self.steps_per_train > 1:
            # With several steps per batch the rollout log-probs no longer describe the policy
            # that the later steps start from; recompute is the only correct choice.
            raise ValueError("old_logprobs='rollout' needs steps_per_train=1, got "
                             f"steps_per_train={self.steps_per_train}")


def trainer_dp_layout(config: TrainConfig, world_size: int) -> tuple[int, list[int]]:
    """(DP size, each trainer rank's DP index). Ranks with the same DP index train the same
    samples (they split one model by TP/PP/CP); FSDP has one DP index per rank."""
    if config.backend != "megatron":
        return world_size, list(range(world_size))
    m = config.megatron
    dp = m.data_parallel(world_size)
    return dp, [(r // (m.tp * m.cp)) % dp for r in range(world_size)]


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
