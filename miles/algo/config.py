"""LossConfig: every knob of the RL objective, as one small msgspec Struct.

Design decisions:
- Defaults follow slime/Miles (eps_clip 0.2, tis_clip 2.0, low_var_kl, gamma = lambd = 1.0, ...), so a
  recipe that only names the estimator behaves like the reference.
- Two KL knobs, as in slime: `kl_coef` shapes the *reward* before advantages (REINFORCE++, PPO),
  `kl_loss_coef` adds a KL *loss* term against the reference policy. They are independent.
- `loss_reduction` defaults to "rollout": with one sample per rollout (no `rollout_ids`) it is exactly
  slime's default per-sample mean, and with black-box trajectory trees it keeps one rollout = one vote.
- msgspec only type-checks on decode, so `__post_init__` re-checks choices and ranges; a config built
  in Python (`LossConfig(eps_clip=-1)`) fails as clearly as one decoded from TOML.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

AdvantageEstimator = Literal["grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossReduction = Literal["token", "sample", "rollout"]
LossType = Literal["policy", "sft"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = AdvantageEstimator.__args__  # type: ignore[attr-defined]
KL_TYPES: tuple[str, ...] = KlType.__args__  # type: ignore[attr-defined]
LOSS_REDUCTIONS: tuple[str, ...] = LossReduction.__args__  # type: ignore[attr-defined]
LOSS_TYPES: tuple[str, ...] = LossType.__args__  # type: ignore[attr-defined]


class LossConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of advantages, policy/value loss, mismatch corrections and loss reduction."""

    # --- advantages ---
    advantage_estimator: AdvantageEstimator = "grpo"
    normalize_std: bool = True  # GRPO/GSPO: divide by the group std (dr_grpo always turns it off)
    normalize_advantages: bool = False  # whiten final advantages over the batch (REINFORCE++ always does)
    gamma: float = 1.0  # discount per model token (REINFORCE++, PPO)
    lambd: float = 1.0  # GAE lambda (PPO)
    kl_coef: float = 0.0  # reward shaping r_t -= kl_coef * kl_t (REINFORCE++(-baseline), PPO; not GRPO)

    # --- policy loss ---
    loss_type: LossType = "policy"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: same as eps_clip (symmetric)
    eps_clip_c: float | None = None  # dual clip lower bound for negative advantages; must be > 1
    kl_loss_coef: float = 0.0  # KL(current || reference) loss term
    kl_loss_type: KlType = "low_var_kl"
    use_unbiased_kl: bool = False  # multiply the KL term by the current/old ratio (DeepSeek-V3.2)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy

    # --- train/rollout mismatch corrections (pick at most one) ---
    use_tis: bool = False  # truncated IS: weight = clamp(ratio, tis_clip_low, tis_clip)
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_mis: bool = False  # masked IS (icepop): weight = ratio inside [mis_low, mis_high], else 0
    mis_low: float = 0.5
    mis_high: float = 2.0

    # --- reduction ---
    loss_reduction: LossReduction = "rollout"

    # --- critic (PPO) ---
    value_clip: float = 0.2

    # --- on-policy distillation (optional): advantage_t -= opd_kl_coef * (student_t - teacher_t) ---
    opd_kl_coef: float = 0.0

    def __post_init__(self) -> None:
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
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
        if self.use_tis and self.use_mis:
            raise ValueError("use_tis and use_mis are both true; pick one mismatch correction")

    @property
    def clip_high(self) -> float:
        """Upper clip width: eps_clip_high, or eps_clip when unset."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def std_normalized(self) -> bool:
        """Whether group advantages are divided by the group std (never for Dr.GRPO)."""
        return self.normalize_std and self.advantage_estimator != "dr_grpo"


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def _in_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name}={value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value!r} must be <= {high}")
