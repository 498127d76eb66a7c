"""Bad inputs are refused with one ValueError naming the argument and the value; so are bad configs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from miles.algo import (
    LossConfig,
    compute_advantages,
    compute_policy_loss,
    cu_seqlens_from_lengths,
    group_advantages,
    loss_denominators,
)
from miles.algo.layout import ids_to_index

torch.set_num_threads(1)

CU = cu_seqlens_from_lengths([2, 2])
MASK = torch.tensor([1, 1, 1, 1])
GROUPS = torch.tensor([0, 0])


def advantages(**overrides: object):
    kwargs = dict(rewards=torch.tensor([1.0, 0.0]), loss_mask=MASK, cu_seqlens=CU, group_ids=GROUPS)
    cfg = overrides.pop("cfg", LossConfig())
    kwargs.update(overrides)
    return compute_advantages(cfg, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rewards": torch.tensor([1.0, float("nan")])}, r"rewards has a non-finite value nan at index 1"),
        ({"rewards": torch.tensor([1.0, 0.0, 1.0])}, r"rewards has length 3, expected 2"),
        ({"rewards": torch.tensor([1, 0])}, r"rewards must be a floating point tensor"),
        ({"group_ids": None}, r"group_ids is required for grpo"),
        ({"group_ids": torch.tensor([0, 0, 1])}, r"group_ids has length 3, expected 2"),
        ({"group_ids": torch.tensor([0.0, 1.0])}, r"group_ids must be an integer tensor"),
        ({"loss_mask": torch.tensor([1, 2, 1, 1])}, r"loss_mask must hold only 0 and 1, got 2 at index 1"),
        ({"loss_mask": torch.ones(2, 2)}, r"loss_mask must be 1-D, got shape \(2, 2\)"),
        ({"cu_seqlens": torch.tensor([0, 2, 5])}, r"cu_seqlens\[-1\]=5 does not match the number of tokens 4"),
        ({"cu_seqlens": torch.tensor([1, 2, 4])}, r"cu_seqlens\[0\] must be 0, got 1"),
        ({"cu_seqlens": torch.tensor([0, 3, 2, 4])}, r"cu_seqlens must be non-decreasing, got 3 then 2"),
        ({"cfg": LossConfig(advantage_estimator="ppo")}, r"values is required for ppo"),
        (
            {"cfg": LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1)},
            r"kl is required: kl_coef=0.1 shapes the reward for reinforce_plus_plus",
        ),
        (
            {"cfg": LossConfig(advantage_estimator="ppo"), "values": torch.tensor([0.0, math.inf, 0.0, 0.0])},
            r"values has a non-finite value inf at index 1",
        ),
        ({"cfg": LossConfig(opd_kl_coef=1.0)}, r"student_logprobs is required for opd_kl_coef > 0"),
    ],
)
def test_compute_advantages_refuses_bad_input(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        advantages(**overrides)


def test_empty_batch_and_disagreeing_siblings_are_refused() -> None:
    with pytest.raises(ValueError, match="rewards is empty"):
        group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64), normalize_std=True)
    with pytest.raises(ValueError, match=r"share rollout_id 4 but have rewards 1.0 and 0.0"):
        group_advantages(
            torch.tensor([1.0, 0.0]), GROUPS, normalize_std=True, rollout_ids=torch.tensor([4, 4])
        )
    with pytest.raises(ValueError, match=r"share rollout_id 4 but are in groups 0 and 1"):
        group_advantages(
            torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), normalize_std=True, rollout_ids=torch.tensor([4, 4])
        )


def policy_loss(**overrides: object):
    kwargs = dict(
        loss_mask=MASK,
        sample_denominators=torch.tensor([2.0, 2.0]),
        cfg=LossConfig(),
        cu_seqlens=CU,
        advantages=torch.zeros(4),
    )
    logprobs = overrides.pop("logprobs", -torch.ones(4))
    kwargs.update(overrides)
    return compute_policy_loss(logprobs, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"advantages": torch.zeros(5)}, r"advantages has shape \(5,\), expected \(4,\) like logprobs"),
        ({"advantages": torch.tensor([0.0, math.nan, 0, 0])}, r"advantages has a non-finite value nan at trained"),
        ({"advantages": None}, r"advantages is required for loss_type='policy'"),
        ({"logprobs": -torch.ones(2, 2), "loss_mask": torch.ones(2, 2), "advantages": torch.zeros(2, 2)},
         r"logprobs must be 1-D \[num_tokens\] when cu_seqlens is given .* got shape \(2, 2\)"),
        ({"cu_seqlens": None}, r"without cu_seqlens the tensors must be a padded \[B, T\] batch, got shape \(4,\)"),
        ({"sample_denominators": torch.tensor([2.0])}, r"sample_denominators has length 1, expected 2"),
        ({"sample_denominators": torch.tensor([2.0, 0.0])}, r"sample_denominators must be > 0, got 0.0 at index 1"),
        ({"cfg": LossConfig(use_tis=True)}, r"rollout_logprobs is required for use_tis"),
        ({"cfg": LossConfig(kl_loss_coef=0.1)}, r"ref_logprobs is required for kl_loss_coef=0.1"),
        ({"cfg": LossConfig(entropy_coef=0.01)}, r"entropy is required for entropy_coef=0.01"),
        ({"old_logprobs": [0.0, 0.0, 0.0, 0.0]}, r"old_logprobs must be a torch.Tensor, got list"),
        ({"old_logprobs": torch.zeros(4, dtype=torch.int64)}, r"old_logprobs must be a floating point tensor"),
    ],
)
def test_compute_policy_loss_refuses_bad_input(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy_loss(**overrides)


def test_loss_denominators_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="loss_mask_counts is empty"):
        loss_denominators(torch.zeros(0, dtype=torch.int64), reduction="token")
    with pytest.raises(ValueError, match=r"loss_mask_counts must be >= 0, got -1 at index 1"):
        loss_denominators(torch.tensor([3, -1]), reduction="token")
    with pytest.raises(ValueError, match=r"reduction='mean' is not one of token, sample, rollout, constant"):
        loss_denominators(torch.tensor([3, 1]), reduction="mean")
    with pytest.raises(ValueError, match=r"rollout_ids has length 1, expected 2"):
        loss_denominators(torch.tensor([3, 1]), reduction="rollout", rollout_ids=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"reduction='auto' is not one of .*resolve 'auto' with LossConfig.reduction"):
        loss_denominators(torch.tensor([3, 1]), reduction="auto")
    with pytest.raises(ValueError, match=r"max_response_tokens=0: reduction='constant' \(Dr. GRPO\)"):
        loss_denominators(torch.tensor([3, 1]), reduction="constant")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eps_clip": -0.1}, r"algo.eps_clip = -0.1: must be > 0.0"),
        ({"eps_clip_c": 0.9}, r"algo.eps_clip_c = 0.9: must be > 1.0"),
        ({"gamma": 1.5}, r"algo.gamma = 1.5: must be <= 1.0"),
        ({"tis_clip": 0.5, "tis_clip_low": 1.0}, r"algo.tis_clip = 0.5: must be > 1.0"),
        ({"mis_low": 2.0, "mis_high": 1.0}, r"algo.mis_high = 1.0: must be > 2.0"),
        ({"use_tis": True, "use_mis": True}, r"algo.use_tis = true and algo.use_mis = true: pick one"),
        ({"advantage_estimator": "grpoo"}, r"algo.advantage_estimator = 'grpoo': not one of grpo, dr_grpo"),
        ({"kl_loss_type": "k4"}, r"algo.kl_loss_type = 'k4': not one of k1, k2, k3, low_var_kl"),
        ({"entropy_coef": math.nan}, r"algo.entropy_coef = nan: must be a finite number"),
        ({"loss_reduction": "mean"}, r"algo.loss_reduction = 'mean': not one of auto, token, sample, rollout"),
        ({"max_response_tokens": -1}, r"algo.max_response_tokens = -1: must be an integer >= 0"),
    ],
)
def test_config_refuses_bad_values(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(fields, LossConfig)


def test_config_defaults_and_decoding() -> None:
    cfg = LossConfig()
    assert (cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c, cfg.kl_coef, cfg.kl_loss_type) == (0.2, 0.2, None, 0.0,
                                                                                          "low_var_kl")
    assert (cfg.tis_clip, cfg.tis_clip_low, cfg.gamma, cfg.lambd, cfg.value_clip) == (2.0, 0.0, 1.0, 1.0, 0.2)
    assert cfg.advantage_estimator == "grpo" and cfg.std_normalized and cfg.loss_reduction == "auto"
    assert cfg.reduction == "rollout" and cfg.max_response_tokens == 0
    decoded = msgspec.toml.decode(b'eps_clip_high = 0.28\nadvantage_estimator = "gspo"\n', type=LossConfig)
    assert decoded.clip_high == 0.28 and decoded.advantage_estimator == "gspo"
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `eps_clp`"):
        msgspec.convert({"eps_clp": 0.3}, LossConfig)


def test_ids_to_index() -> None:
    assert ids_to_index(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    assert ids_to_index(["r1", "", "r1", ""], empty_is_unique=True).tolist() == [0, 1, 0, 2]
