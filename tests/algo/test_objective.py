"""compute_policy_loss / compute_value_loss: layouts, masking, on-policy default, metrics."""

from __future__ import annotations

import torch

from miles.algo import (
    LossConfig,
    compute_policy_loss,
    compute_value_loss,
    cu_seqlens_from_lengths,
    loss_denominators,
    loss_mask_counts,
    padded_cu_seqlens,
)

torch.set_num_threads(1)


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 0, 0]])
    return {
        "logprobs": -torch.rand(3, 6, generator=g),
        "old_logprobs": -torch.rand(3, 6, generator=g),
        "ref_logprobs": -torch.rand(3, 6, generator=g),
        "advantages": torch.randn(3, 6, generator=g),
        "loss_mask": mask,
    }


def test_padded_batch_equals_packed_stream() -> None:
    batch = padded_batch()
    cfg = LossConfig(loss_reduction="sample", kl_loss_coef=0.1)
    counts = loss_mask_counts(batch["loss_mask"].reshape(-1), padded_cu_seqlens(3, 6))
    denominators = loss_denominators(counts, reduction="sample")

    padded_logp = batch["logprobs"].clone().requires_grad_()
    loss_padded, metrics_padded = compute_policy_loss(
        padded_logp,
        loss_mask=batch["loss_mask"],
        sample_denominators=denominators,
        cfg=cfg,
        advantages=batch["advantages"],
        old_logprobs=batch["old_logprobs"],
        ref_logprobs=batch["ref_logprobs"],
    )
    loss_padded.backward()

    # Pack: drop the trailing padding of each row (positions 4-5 of rows 0 and 2).
    lengths = [4, 6, 4]
    keep = torch.zeros(3, 6, dtype=torch.bool)
    for row, length in enumerate(lengths):
        keep[row, :length] = True
    packed_logp = batch["logprobs"][keep].clone().requires_grad_()
    loss_packed, metrics_packed = compute_policy_loss(
        packed_logp,
        loss_mask=batch["loss_mask"][keep],
        sample_denominators=denominators,
        cfg=cfg,
        cu_seqlens=cu_seqlens_from_lengths(lengths),
        advantages=batch["advantages"][keep],
        old_logprobs=batch["old_logprobs"][keep],
        ref_logprobs=batch["ref_logprobs"][keep],
    )
    loss_packed.backward()
    assert torch.allclose(loss_padded, loss_packed, atol=1e-7)
    assert torch.allclose(padded_logp.grad[keep], packed_logp.grad, atol=1e-7)
    assert torch.equal(padded_logp.grad[~keep], torch.zeros(int((~keep).sum())))
    for name in metrics_padded:
        assert torch.allclose(metrics_padded[name], metrics_packed[name], atol=1e-7), name


def test_garbage_on_masked_tokens_cannot_reach_loss_or_gradient() -> None:
    batch = padded_batch()
    hidden = batch["loss_mask"] == 0
    logp = batch["logprobs"].masked_fill(hidden, float("-inf")).requires_grad_()
    old = batch["old_logprobs"].masked_fill(hidden, float("nan"))
    adv = batch["advantages"].masked_fill(hidden, float("inf"))
    denominators = loss_denominators(torch.tensor([3, 4, 2]), reduction="token")
    loss, metrics = compute_policy_loss(
        logp,
        loss_mask=batch["loss_mask"],
        sample_denominators=denominators,
        cfg=LossConfig(kl_loss_coef=0.1, use_tis=True),
        advantages=adv,
        old_logprobs=old,
        ref_logprobs=old,
        rollout_logprobs=old,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(logp.grad).all() and torch.equal(logp.grad[hidden], torch.zeros(int(hidden.sum())))


def test_on_policy_default_has_ratio_one_and_the_plain_policy_gradient() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    advantages = torch.tensor([0.0, 2.0, -1.0])
    mask = torch.tensor([0, 1, 1])
    loss, metrics = compute_policy_loss(
        logp,
        loss_mask=mask,
        sample_denominators=torch.tensor([2.0]),
        cfg=LossConfig(loss_reduction="token"),
        cu_seqlens=cu_seqlens_from_lengths([3]),
        advantages=advantages,
    )
    loss.backward()
    assert float(loss.detach()) == -0.5  # mean of -1 * A over two tokens
    assert torch.equal(logp.grad, torch.tensor([0.0, -1.0, 0.5]))
    assert float(metrics["pg_clipfrac"]) == 0.0 and float(metrics["ppo_kl"]) == 0.0


def test_entropy_bonus_lowers_the_loss() -> None:
    logp = torch.tensor([-1.0, -1.0])
    common = dict(
        loss_mask=torch.tensor([1, 1]),
        sample_denominators=torch.tensor([2.0]),
        cu_seqlens=cu_seqlens_from_lengths([2]),
        advantages=torch.zeros(2),
        entropy=torch.tensor([1.0, 3.0]),
    )
    loss, metrics = compute_policy_loss(logp, cfg=LossConfig(entropy_coef=0.1), **common)
    assert torch.allclose(loss, torch.tensor(-0.2))
    assert float(metrics["entropy"]) == 2.0


def test_reference_kl_is_logged_whenever_reference_logprobs_come_without_a_kl_term() -> None:
    """train.use_ref_model without a KL term: ref_kl = mean k3 of KL(pi || pi_ref), no gradient."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    loss, metrics = compute_policy_loss(
        logp, loss_mask=torch.tensor([0, 1, 1]), sample_denominators=torch.tensor([2.0]),
        cfg=LossConfig(loss_reduction="token"), cu_seqlens=cu_seqlens_from_lengths([3]),
        advantages=torch.tensor([0.0, 1.0, 1.0]), ref_logprobs=ref)
    d = torch.tensor([1.0, 0.0])                     # log pi_ref - log pi on the two trained tokens
    assert torch.allclose(metrics["ref_kl"], (torch.expm1(d) - d).mean())
    assert "kl_loss" not in metrics and not metrics["ref_kl"].requires_grad
    loss.backward()                                  # the gradient is the plain policy gradient's
    assert torch.equal(logp.grad, torch.tensor([0.0, -0.5, -0.5]))


def test_sft_loss_is_the_reduced_negative_log_likelihood() -> None:
    loss, metrics = compute_policy_loss(
        torch.tensor([-1.0, -2.0, -4.0]),
        loss_mask=torch.tensor([0, 1, 1]),
        sample_denominators=torch.tensor([2.0]),
        cfg=LossConfig(loss_type="sft"),
        cu_seqlens=cu_seqlens_from_lengths([3]),
    )
    assert float(loss) == 3.0 and float(metrics["sft_loss"]) == 3.0


def test_metric_names_follow_the_config() -> None:
    batch = padded_batch()
    common = dict(
        loss_mask=batch["loss_mask"],
        sample_denominators=torch.tensor([3.0, 4.0, 2.0]),
        advantages=batch["advantages"],
        old_logprobs=batch["old_logprobs"],
    )
    _, plain = compute_policy_loss(batch["logprobs"], cfg=LossConfig(), **common)
    assert sorted(plain) == ["loss", "pg_clipfrac", "pg_loss", "ppo_kl"]
    _, full = compute_policy_loss(
        batch["logprobs"],
        cfg=LossConfig(eps_clip_c=3.0, use_mis=True, kl_loss_coef=0.1),
        ref_logprobs=batch["ref_logprobs"],
        rollout_logprobs=batch["old_logprobs"],
        entropy=torch.ones(3, 6),
        **common,
    )
    assert sorted(full) == sorted([
        "loss", "pg_clipfrac", "pg_loss", "ppo_kl", "pg_dual_clipfrac", "mis_ratio", "mis_masked_frac",
        "kl_loss", "ref_kl", "train_rollout_logprob_abs_diff", "train_rollout_kl", "entropy",
    ])
    assert all(not v.requires_grad for v in full.values())


def test_value_loss_reduces_like_the_policy_loss() -> None:
    values = torch.tensor([5.0, 1.0, 1.0], requires_grad=True)
    loss, metrics = compute_value_loss(
        values,
        old_values=torch.tensor([5.0, 0.0, 0.9]),
        returns=torch.tensor([5.0, 0.0, 2.0]),
        loss_mask=torch.tensor([0, 1, 1]),
        sample_denominators=torch.tensor([2.0]),
        cfg=LossConfig(value_clip=0.2),
        cu_seqlens=cu_seqlens_from_lengths([3]),
    )
    loss.backward()
    assert float(loss.detach()) == 0.5  # per-token losses 0.5 and 0.5, token mean
    assert float(metrics["value_clipfrac"]) == 0.0
    assert torch.allclose(values.grad, torch.tensor([0.0, 0.5, -0.5]))


def test_package_docstring_example_flow() -> None:
    """The micro-batch loop of miles/algo/__init__.py: contiguous micro-batches add up to one batch."""
    from miles.algo import compute_advantages, ids_to_index

    g = torch.Generator().manual_seed(7)
    cu = cu_seqlens_from_lengths([3, 5, 2, 4, 6])
    mask = (torch.rand(20, generator=g) > 0.3).long()
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    group = ids_to_index(["a", "a", "a", "b", "b"])
    rid = ids_to_index(["", "t1", "t1", "", ""], empty_is_unique=True)
    r[2] = r[1]  # siblings share a reward
    base = -torch.rand(20, generator=g)
    old = base + 0.1 * torch.randn(20, generator=g)
    cfg = LossConfig(eps_clip=0.1)

    counts = loss_mask_counts(mask, cu)
    adv = compute_advantages(
        cfg, rewards=r, loss_mask=mask, cu_seqlens=cu, group_ids=group, rollout_ids=rid
    ).advantages
    den = loss_denominators(counts, reduction=cfg.reduction, rollout_ids=rid)

    def grad_for(micro_batches: list[list[int]]) -> torch.Tensor:
        logp = base.clone().requires_grad_()
        for samples in micro_batches:
            lo, hi = cu[samples[0]], cu[samples[-1] + 1]
            loss, _ = compute_policy_loss(
                logp[lo:hi],
                loss_mask=mask[lo:hi],
                sample_denominators=den[samples],
                cfg=cfg,
                cu_seqlens=cu[samples[0]:samples[-1] + 2] - lo,
                advantages=adv[lo:hi],
                old_logprobs=old[lo:hi],
            )
            loss.backward()
        return logp.grad

    whole = grad_for([[0, 1, 2, 3, 4]])
    assert torch.allclose(grad_for([[0, 1], [2], [3, 4]]), whole, atol=1e-7)
    assert whole.abs().sum() > 0
