"""`train.old_logprobs` on the FSDP backend (one gloo rank): "rollout" makes the engine's
log-probs pi_old (the PPO ratio is against the policy that sampled, whatever the loop mode) and
refuses a sample without them; "auto" with one step per batch is on-policy (ratio exactly 1)."""

import copy

import pytest
import torch
from backend_helpers import make_samples

from miles.algo import LossConfig
from miles.backends import TrainConfig
from miles.tiny import build_tiny_model


def test_rollout_logprobs_are_the_old_policy_and_are_required(backends):
    torch.set_num_threads(1)
    path = str(build_tiny_model(arch="qwen3"))
    samples = make_samples(groups=2, per_group=3, seed=4)  # rollout log-probs far from this policy
    rollout = backends(TrainConfig(model_path=path, param_dtype="float32", lr=0.0, old_logprobs="rollout"),
                       LossConfig())
    metrics = rollout.train(samples)
    assert metrics["ppo_kl"] != 0 and metrics["pg_clipfrac"] > 0  # stale samples get clipped
    # The mismatch metrics compare the trained policy with the rollout's (pi_old = rollout would read 0).
    assert metrics["train_rollout_logprob_abs_diff"] > 0.5 and metrics["train_rollout_kl"] > 0

    auto = backends(TrainConfig(model_path=path, param_dtype="float32", lr=0.0, old_logprobs="auto"),
                    LossConfig())
    metrics = auto.train(samples)
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0  # ratio 1: right only on-policy

    bad = copy.deepcopy(samples)
    bad[4].rollout_logprobs = None
    with pytest.raises(ValueError, match=r"sample 4 \(group_id='g1'.*rollout_logprobs: missing \(None\), "
                                         r"required by train.old_logprobs = 'rollout'"):
        rollout.train(bad)
    assert rollout.step == 1, "a refused batch must not step the optimizer"
