"""Per-token diagnostic quantities; reduced like the loss (reduce.py), so they add up across micro-batches.

Design decisions:
- Functions here return per-token, detached float32 tensors; `compute_policy_loss` reduces each one
  with the step's token weights, so a metric is a partial sum exactly like the loss: add the values
  over micro-batches (and ranks) to get the step value. Grad-norm belongs to the backend.
- The mismatch KL is KL(pi_rollout || pi_train) estimated with k3 on tokens sampled by the rollout
  engine: exp(d) - 1 - d with d = log pi_train - log pi_rollout (non-negative, low variance).
- `approx_kl` is slime's ppo_kl: mean of log pi_old - log pi over trained tokens.
- `reference_kl` is KL(pi || pi_ref) by k3 on the sampled tokens (they come from pi_old ~ pi):
  how far RL has moved the policy from its reference (the warm start, where one ran).
"""

from __future__ import annotations

import torch


def approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log pi_old - log pi per token (the k1 estimate of KL(pi_old || pi))."""
    return (old_logprobs.detach().float() - logprobs.detach().float())


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token: exp(d) - 1 - d with d = log pi_ref - log pi."""
    d = ref_logprobs.detach().float() - logprobs.detach().float()
    return torch.expm1(d) - d


def logprob_abs_diff(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """|log pi_train - log pi_rollout| per token; 0 everywhere in true on-policy mode."""
    return (train_logprobs.detach().float() - rollout_logprobs.detach().float()).abs()


def mismatch_kl(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_rollout || pi_train) per token."""
    d = train_logprobs.detach().float() - rollout_logprobs.detach().float()
    return torch.expm1(d) - d


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token train-vs-rollout mismatch metrics, keyed by their logged names."""
    return {
        "train_rollout_logprob_abs_diff": logprob_abs_diff(train_logprobs, rollout_logprobs),
        "train_rollout_kl": mismatch_kl(train_logprobs, rollout_logprobs),
    }
