"""LossConfig: every knob of the RL objective, as one small msgspec Struct.

Design decisions:
- Defaults follow slime/Miles (eps_clip 0.2, tis_clip 2.0, low_var_kl, gamma = lambd = 1.0, ...), so a
  recipe that only names the estimator behaves like the reference.
- Two KL knobs, as in slime: `kl_coef` shapes the *reward* before advantages (REINFORCE++, PPO),
  `kl_loss_coef` adds a KL *loss* term against the reference policy. They are independent.
- `loss_reduction = "auto"` (the default) lets the estimator pick its reduction (`LossConfig.reduction`),
  so naming an estimator is enough to get the paper's objective; an explicit reduction the paper
  contradicts is refused here, at recipe load, naming the paper:
    grpo, reinforce_plus_plus(_baseline), ppo -> "rollout": with one sample per rollout (no
      `rollout_ids`) exactly slime's per-sample mean (DeepSeekMath's GRPO, arXiv:2402.03300); with
      black-box trajectory trees one rollout = one vote. Any reduction may be chosen ("token" is DAPO's).
    dr_grpo -> "constant", and only that: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
      Training: A Critical Perspective", arXiv:2503.20783) removes the group-std
      AND the 1/|o_i| length normalisation, summing token losses over a constant, the generation
      budget times the number of responses (TRL's loss_type="dr_grpo", verl's
      "seq-mean-token-sum-norm"). Any per-sample or per-token mean brings a length bias back.
    gspo -> "rollout" (or "sample"): GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
      arXiv:2507.18071) averages one clipped sequence-level term per response, 1/G sum_i;
      "token" (and "constant") would weight each response by its length.
- The reductions (reduce.py has the formulas and the proof): "token" (1/|T|) sum_t l_t over all
  trained tokens of the step; "sample" (1/S) sum_s (1/|T_s|) sum_{t in T_s} l_t; "rollout"
  (1/R) sum_r (1/|T_r|) sum_{t in T_r} l_t, where T_r is every trained token of rollout r over all
  the samples sharing its `rollout_id`: a harness that forks, retries, spawns subagents or compacts
  its context (a trajectory tree) produces the same gradient scale however many samples its rollout
  became, and a rollout with 5 samples weighs like one with 1; "constant" (1/(B R)) sum_t l_t with B
  the generation budget (Dr. GRPO).
- `max_response_tokens` is Dr. GRPO's constant (the paper's MAX_TOKENS). 0 means "the generation
  budget": the trainer fills in `rollout.max_new_tokens`, which this Struct cannot see.
- `opd_only` (pure on-policy distillation) drops the estimator's advantages and keeps only the
  reverse-KL term of `opd_kl_coef`; it needs `opd_kl_coef > 0`.
- Messages name the recipe key (`algo.eps_clip = -0.1: must be > 0.0`).
- msgspec only type-checks on decode, so `__post_init__` re-checks choices and ranges; a config built
  in Python (`LossConfig(eps_clip=-1)`) fails as clearly as one decoded from TOML.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

AdvantageEstimator = Literal["grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossReduction = Literal["auto", "token", "sample", "rollout", "constant"]
LossType = Literal["policy", "sft"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = AdvantageEstimator.__args__  # type: ignore[attr-defined]
KL_TYPES: tuple[str, ...] = KlType.__args__  # type: ignore[attr-defined]
LOSS_REDUCTION_CHOICES: tuple[str, ...] = LossReduction.__args__  # type: ignore[attr-defined]
LOSS_REDUCTIONS: tuple[str, ...] = tuple(r for r in LOSS_REDUCTION_CHOICES if r != "auto")  # resolved ones

# The reductions each estimator's paper allows (first = what "auto" picks); absent: any.
ESTIMATOR_REDUCTIONS: dict[str, tuple[str, ...]] = {
    "dr_grpo": ("constant",),
    "gspo": ("rollout", "sample"),
}
ESTIMATOR_PAPERS = {
    "dr_grpo": "Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) sums token losses over a constant "
               "(generation budget x responses); a per-sample or per-token mean reintroduces the length bias "
               "it removes",
    "gspo": "GSPO (Zheng et al. 2025, arXiv:2507.18071) averages one sequence-level term per response; "
            "'token' or 'constant' would weight each response by its length",
}
LOSS_TYPES: tuple[str, ...] = LossType.__args__  # type: ignore[attr-defined]


class LossConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of advantages, policy/value loss, mismatch corrections and loss reduction."""

    # --- advantages ---
    # grpo, gspo, dr_grpo, reinforce_plus_plus(_baseline), ppo (critic + GAE)
    advantage_estimator: AdvantageEstimator = "grpo"
    normalize_std: bool = True  # GRPO/GSPO: divide by the group std (dr_grpo always turns it off)
    normalize_advantages: bool = False  # whiten final advantages over the batch (REINFORCE++ always does)
    gamma: float = 1.0  # discount per model token (REINFORCE++, PPO)
    lambd: float = 1.0  # GAE lambda (PPO)
    kl_coef: float = 0.0  # reward shaping r_t -= kl_coef * kl_t (REINFORCE++(-baseline), PPO; not GRPO)

    # --- policy loss ---
    # policy: the clipped policy-gradient loss; sft: token cross-entropy
    loss_type: LossType = "policy"
    # PPO ratio clip: 1 - eps_clip (and 1 + eps_clip unless eps_clip_high)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: same as eps_clip (symmetric)
    eps_clip_c: float | None = None  # dual clip lower bound for negative advantages; must be > 1
    kl_loss_coef: float = 0.0  # KL(current || reference) loss term
    # the KL estimator of the KL loss term: k1, k2, k3, or low_var_kl (k3 clamped)
    kl_loss_type: KlType = "low_var_kl"
    use_unbiased_kl: bool = False  # multiply the KL term by the current/old ratio (DeepSeek-V3.2)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy

    # --- train/rollout mismatch corrections (pick at most one) ---
    use_tis: bool = False  # truncated IS: weight = clamp(ratio, tis_clip_low, tis_clip)
    # truncated IS upper clamp of the train/rollout ratio
    tis_clip: float = 2.0
    # truncated IS lower clamp
    tis_clip_low: float = 0.0
    use_mis: bool = False  # masked IS (icepop): weight = ratio inside [mis_low, mis_high], else 0
    # masked IS: tokens whose ratio is below this get weight 0
    mis_low: float = 0.5
    # masked IS: tokens whose ratio is above this get weight 0
    mis_high: float = 2.0

    # --- reduction ---
    # auto: the estimator's own (see `reduction`); "rollout": (1/R) sum_r (1/|T_r|) sum_{t in T_r} l_t,
    # one vote per rollout whatever number of samples (siblings sharing rollout_id) it produced
    loss_reduction: LossReduction = "auto"
    max_response_tokens: int = 0  # "constant"'s budget per response; 0: the trainer uses rollout.max_new_tokens

    # --- critic (PPO) ---
    # PPO value clipping: the new value stays within this of the old one
    value_clip: float = 0.2

    # --- on-policy distillation (optional): advantage_t -= opd_kl_coef * (student_t - teacher_t) ---
    # on-policy distillation: advantage_t -= opd_kl_coef * (student_t - teacher_t); 0: off
    opd_kl_coef: float = 0.0
    # pure distillation: ignore the reward, advantage_t = -opd_kl_coef * (student_t - teacher_t)
    opd_only: bool = False

    def __post_init__(self) -> None:
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _choice("loss_reduction", self.loss_reduction, LOSS_REDUCTION_CHOICES)
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        _in_range("eps_clip", self.eps_clip, low=0.0, low_open=True)
        if self.eps_clip_high is not None:
            _in_range("eps_clip_high", self.eps_clip_high, low=0.0, low_open=True)
        if self.eps_clip_c is not None:
            _in_range("eps_clip_c", self.eps_clip_c, low=1.0, low_open=True)
        _in_range("gamma", self.gamma, low=0.0, high=1.0)
        _in_range("lambd", self.lambd, low=0.0, high=1.0)
        _in_range("kl_coef", self.kl_coef, low=0.0)
        _in_range("kl_loss_coef", self.kl_loss_coef, low=0.0)
        _in_range("entropy_coef", self.entropy_coef)
        _in_range("tis_clip_low", self.tis_clip_low, low=0.0)
        _in_range("tis_clip", self.tis_clip, low=self.tis_clip_low, low_open=True)
        _in_range("mis_low", self.mis_low, low=0.0)
        _in_range("mis_high", self.mis_high, low=self.mis_low, low_open=True)
        _in_range("value_clip", self.value_clip, low=0.0, low_open=True)
        _in_range("opd_kl_coef", self.opd_kl_coef, low=0.0)
        if self.opd_only and self.opd_kl_coef <= 0:
            raise ValueError("algo.opd_only = true: pure distillation needs algo.opd_kl_coef > 0 "
                             f"(got {self.opd_kl_coef})")
        if self.use_tis and self.use_mis:
            raise ValueError("algo.use_tis = true and algo.use_mis = true: pick one mismatch correction")
        if isinstance(self.max_response_tokens, bool) or not isinstance(self.max_response_tokens, int) \
                or self.max_response_tokens < 0:
            raise ValueError(f"algo.max_response_tokens = {self.max_response_tokens!r}: must be an integer >= 0")
        allowed = ESTIMATOR_REDUCTIONS.get(self.advantage_estimator)
        if self.loss_type == "policy" and allowed and self.loss_reduction not in ("auto", *allowed):
            raise ValueError(
                f"algo.loss_reduction = {self.loss_reduction!r}: advantage_estimator = "
                f"{self.advantage_estimator!r} needs {' or '.join(map(repr, allowed))} (or 'auto'): "
                f"{ESTIMATOR_PAPERS[self.advantage_estimator]}")

    @property
    def clip_high(self) -> float:
        """Upper clip width: eps_clip_high, or eps_clip when unset."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def reduction(self) -> str:
        """The loss reduction in force: `loss_reduction`, or for "auto" the estimator's own (the SFT
        loss, which has no estimator, keeps the per-sample mean)."""
        if self.loss_reduction != "auto":
            return self.loss_reduction
        if self.loss_type == "sft":
            return "rollout"
        return ESTIMATOR_REDUCTIONS.get(self.advantage_estimator, ("rollout",))[0]

    @property
    def std_normalized(self) -> bool:
        """Whether group advantages are divided by the group std (never for Dr.GRPO)."""
        return self.normalize_std and self.advantage_estimator != "dr_grpo"


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"algo.{name} = {value!r}: not one of {', '.join(allowed)}")


def _in_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"algo.{name} = {value!r}: must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"algo.{name} = {value!r}: must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"algo.{name} = {value!r}: must be <= {high}")
