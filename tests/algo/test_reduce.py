"""Loss reduction: denominators, the four reductions by hand, and micro-batch split invariance.

The split tests run a tiny linear softmax "policy" with autograd: one micro-batch holding the whole
step must give the same loss and gradient as any split of the samples across micro-batches, in
particular one that puts a rollout's siblings into different micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from miles.algo import LossConfig, compute_policy_loss, loss_denominators
from miles.algo.config import ESTIMATOR_REDUCTIONS
from miles.algo.layout import cu_seqlens_from_lengths, loss_mask_counts
from miles.algo.losses import entropy_from_logits
from miles.algo.reduce import reduce_tokens, token_weights

torch.set_num_threads(1)


def test_denominators_by_hand() -> None:
    counts = torch.tensor([2, 3, 0, 5])
    rollout_ids = torch.tensor([7, 7, 8, 9])
    token = loss_denominators(counts, reduction="token", rollout_ids=rollout_ids)
    sample = loss_denominators(counts, reduction="sample", rollout_ids=rollout_ids)
    rollout = loss_denominators(counts, reduction="rollout", rollout_ids=rollout_ids)
    assert token.dtype == torch.float64
    assert torch.equal(token, torch.tensor([10.0, 10.0, 10.0, 10.0], dtype=torch.float64))
    assert torch.equal(sample, torch.tensor([8.0, 12.0, 4.0, 20.0], dtype=torch.float64))
    # rollout 7 has 5 tokens, 8 has none (clamped to 1), 9 has 5; three rollouts in the step
    assert torch.equal(rollout, torch.tensor([15.0, 15.0, 3.0, 15.0], dtype=torch.float64))
    without_ids = loss_denominators(counts, reduction="rollout")
    assert torch.equal(without_ids, sample)
    # Dr. GRPO: budget 6 x three rollouts, whatever the lengths; x four samples without rollout ids
    constant = loss_denominators(counts, reduction="constant", rollout_ids=rollout_ids, max_response_tokens=6)
    assert torch.equal(constant, torch.full((4,), 18.0, dtype=torch.float64))
    assert torch.equal(loss_denominators(counts, reduction="constant", max_response_tokens=6),
                       torch.full((4,), 24.0, dtype=torch.float64))


LENGTHS = [4, 6, 3, 5, 2, 7]
ROLLOUT_IDS = [0, 0, 0, 1, 2, 2]  # rollout 0 has three siblings, rollout 2 two


def toy_values() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    cu = cu_seqlens_from_lengths(LENGTHS)
    mask = (torch.rand(int(cu[-1]), generator=g) > 0.25).long()
    mask[0] = 0
    return torch.randn(int(cu[-1]), generator=g), mask, cu


@pytest.mark.parametrize("reduction", ["token", "sample", "rollout"])
def test_reductions_match_their_definitions(reduction: str) -> None:
    values, mask, cu = toy_values()
    rollout_ids = torch.tensor(ROLLOUT_IDS)
    denominators = loss_denominators(loss_mask_counts(mask, cu), reduction=reduction, rollout_ids=rollout_ids)
    reduced = reduce_tokens(values, token_weights(mask, cu, denominators))
    per_sample = [(values[a:b] * mask[a:b]).sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    tokens = [mask[a:b].sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    if reduction == "token":
        expected = sum(per_sample) / sum(tokens)
    elif reduction == "sample":
        expected = sum(s / t for s, t in zip(per_sample, tokens)) / len(LENGTHS)
    else:
        means = []
        for rid in sorted(set(ROLLOUT_IDS)):
            members = [i for i, r in enumerate(ROLLOUT_IDS) if r == rid]
            means.append(sum(per_sample[i] for i in members) / sum(tokens[i] for i in members))
        expected = sum(means) / len(means)
    assert torch.allclose(reduced, expected.float(), atol=1e-6)


def test_masked_tokens_holding_inf_do_not_leak_into_the_loss() -> None:
    values = torch.tensor([float("inf"), 1.0, 3.0])
    weights = token_weights(torch.tensor([0, 1, 1]), cu_seqlens_from_lengths([3]), torch.tensor([2.0]))
    assert float(reduce_tokens(values, weights)) == 2.0


# ---- split invariance on a tiny linear policy ----

HIDDEN, VOCAB = 6, 5


class ToyStep:
    """A whole training step: per-sample token slices of a linear softmax policy's inputs."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(HIDDEN, VOCAB, generator=g, requires_grad=True)
        self.samples = []
        for length in LENGTHS:
            mask = (torch.rand(length, generator=g) > 0.2).long()
            mask[0] = 0  # prompt token
            self.samples.append({
                "features": torch.randn(length, HIDDEN, generator=g),
                "tokens": torch.randint(0, VOCAB, (length,), generator=g),
                "loss_mask": mask,
                "advantages": torch.randn(length, generator=g) * mask,
                "old_shift": 0.2 * torch.randn(length, generator=g),
                "ref_shift": 0.2 * torch.randn(length, generator=g),
                "rollout_shift": 0.4 * torch.randn(length, generator=g),
            })
        self.rollout_ids = torch.tensor(ROLLOUT_IDS)
        self.counts = torch.tensor([int(s["loss_mask"].sum()) for s in self.samples])

    def run(self, cfg: LossConfig, micro_batches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Accumulate gradients over micro-batches; return (grad, summed loss, summed metrics)."""
        self.weight.grad = None
        denominators = loss_denominators(self.counts, reduction=cfg.reduction, rollout_ids=self.rollout_ids,
                                         max_response_tokens=cfg.max_response_tokens)
        total = torch.zeros(())
        metrics_sum: dict[str, torch.Tensor] = {}
        for members in micro_batches:
            cat = {k: torch.cat([self.samples[i][k] for i in members]) for k in self.samples[0]}
            cu = cu_seqlens_from_lengths([LENGTHS[i] for i in members])
            logits = cat["features"] @ self.weight
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, cat["tokens"][:, None])[:, 0]
            frozen = logprobs.detach()
            loss, metrics = compute_policy_loss(
                logprobs,
                loss_mask=cat["loss_mask"],
                sample_denominators=denominators[members],
                cfg=cfg,
                cu_seqlens=cu,
                advantages=cat["advantages"],
                old_logprobs=frozen + cat["old_shift"],
                ref_logprobs=frozen + cat["ref_shift"],
                rollout_logprobs=frozen + cat["rollout_shift"],
                entropy=entropy_from_logits(logits),
            )
            loss.backward()
            total = total + loss.detach()
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, torch.zeros(())) + v
        return self.weight.grad.clone(), total, metrics_sum


SPLITS = [
    [[0, 1, 2, 3, 4, 5]],
    [[0, 3], [1, 4], [2, 5]],  # every multi-sample rollout is split
    [[5], [2, 0], [4, 1, 3]],  # different order and sizes
    [[i] for i in range(6)],
]

CONFIGS = {
    "grpo": LossConfig(),
    "gspo_tis_kl_entropy": LossConfig(
        advantage_estimator="gspo", eps_clip=0.05, use_tis=True, kl_loss_coef=0.1, entropy_coef=0.01
    ),
    "dual_clip_mis_unbiased_kl": LossConfig(
        eps_clip_c=2.0, eps_clip_high=0.3, use_mis=True, kl_loss_coef=0.05, use_unbiased_kl=True
    ),
    "dr_grpo_kl": LossConfig(advantage_estimator="dr_grpo", kl_loss_coef=0.1, max_response_tokens=8),
    "sft": LossConfig(loss_type="sft"),
}
# Every reduction each config's estimator accepts (LossConfig refuses the others, see
# test_estimator_reductions.py), so no combination is skipped quietly.
SPLIT_CASES = [(name, reduction) for name, cfg in sorted(CONFIGS.items())
               for reduction in ("token", "sample", "rollout", "constant")
               if cfg.loss_type == "sft" or reduction in ESTIMATOR_REDUCTIONS.get(cfg.advantage_estimator, (reduction,))]


def test_split_cases_cover_every_estimator_reduction() -> None:
    assert len(SPLIT_CASES) == 4 + 4 + 2 + 1 + 4  # dual_clip, grpo, gspo, dr_grpo, sft


@pytest.mark.parametrize(("config", "reduction"), SPLIT_CASES)
def test_splitting_samples_across_micro_batches_gives_the_same_gradient(config: str, reduction: str) -> None:
    step = ToyStep(seed=11)
    cfg = msgspec_replace(CONFIGS[config], loss_reduction=reduction, max_response_tokens=8)
    grad_whole, loss_whole, metrics_whole = step.run(cfg, SPLITS[0])
    assert grad_whole.abs().sum() > 0
    for split in SPLITS[1:]:
        grad, loss, metrics = step.run(cfg, split)
        assert torch.allclose(grad, grad_whole, rtol=0, atol=1e-6), split
        assert torch.allclose(loss, loss_whole, rtol=0, atol=1e-6), split
        assert sorted(metrics) == sorted(metrics_whole)
        for name in metrics:
            assert torch.allclose(metrics[name], metrics_whole[name], rtol=0, atol=1e-6), (split, name)


def test_rollout_reduction_weighs_each_rollout_equally() -> None:
    # Same per-token loss everywhere except rollout 0 (three siblings): with per-rollout reduction its
    # share is exactly 1/3 of the step however many samples and tokens it has.
    values, mask, cu = toy_values()
    rollout_ids = torch.tensor(ROLLOUT_IDS)
    denominators = loss_denominators(loss_mask_counts(mask, cu), reduction="rollout", rollout_ids=rollout_ids)
    in_rollout_0 = torch.repeat_interleave(torch.tensor([1.0, 1, 1, 0, 0, 0]), torch.tensor(LENGTHS))
    share = reduce_tokens(in_rollout_0, token_weights(mask, cu, denominators))
    assert torch.allclose(share, torch.tensor(1 / 3))


def msgspec_replace(cfg: LossConfig, **changes: object) -> LossConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)
