"""Snapshot cases for miles.algo: fixed-seed inputs -> outputs, saved bit for bit as safetensors.

Each group writes tests/algo/snapshots/<group>.safetensors holding its inputs ("in.<name>") and its
outputs ("out.<name>"). The test reloads the saved inputs (so a change in torch's RNG cannot break
it), recomputes and compares with torch.equal.

Bit-exactness is a property of one platform: the torch version and its CPU kernel set (AVX2, AVX512,
...) decide the rounding of exp/log and the order of a sum. Measured: torch 2.11 vs 2.13 on the same
AVX512 CPU differ by 1 ulp in a few reduced losses; ATEN_CPU_CAPABILITY=default vs AVX512 differ in
entropy and expm1; two AVX512 hosts of different CPU models (and the same torch) differ by 1 ulp in
the reduced objective losses. So each file records the platform it was written on (`platform()`:
torch version and build, kernel set, CPU vendor/family/model), the test is exact there, and elsewhere
checks to float32 rounding and warns.

Regenerate after an intended numerical change, and say why in the commit:
    .venv/bin/python tests/algo/algo_snapshot_cases.py --update
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from miles.algo import LossConfig, compute_advantages, compute_policy_loss, compute_value_loss, loss_denominators
from miles.algo.corrections import mis_weights, tis_weights
from miles.algo.layout import cu_seqlens_from_lengths, loss_mask_counts
from miles.algo.losses import (
    clipped_value_loss,
    entropy_from_logits,
    gspo_log_ratio,
    kl_penalty,
    ppo_clip_loss,
    sft_loss,
)
from miles.algo.metrics import mismatch_metrics

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"
Tensors = dict[str, torch.Tensor]

SAMPLE_LENGTHS = [5, 3, 7, 4, 6, 2, 5, 4]  # 8 samples, 36 tokens
MAX_RESPONSE_TOKENS = 8  # Dr. GRPO's constant: the generation budget
GROUP_IDS = [0, 0, 0, 0, 1, 1, 1, 1]
ROLLOUT_IDS = [0, 1, 1, 2, 3, 4, 5, 5]  # rollouts 1 and 5 have two siblings each


def stream_inputs(seed: int) -> Tensors:
    """A packed batch: prompt token first in each sample (masked), a masked tool token in a few."""
    g = torch.Generator().manual_seed(seed)
    cu = cu_seqlens_from_lengths(SAMPLE_LENGTHS)
    num_tokens = int(cu[-1])
    mask = torch.ones(num_tokens, dtype=torch.int64)
    mask[cu[:-1]] = 0
    mask[[3, 12, 27]] = 0
    siblings = torch.tensor(ROLLOUT_IDS)
    rewards = (torch.rand(len(SAMPLE_LENGTHS), generator=g) > 0.5).float()
    rewards[2] = rewards[1]  # siblings share one reward
    rewards[7] = rewards[6]
    logprobs = -torch.rand(num_tokens, generator=g) * 3
    return {
        "cu_seqlens": cu,
        "loss_mask": mask,
        "rewards": rewards,
        "group_ids": torch.tensor(GROUP_IDS),
        "rollout_ids": siblings,
        "logprobs": logprobs,
        "old_logprobs": logprobs + 0.3 * torch.randn(num_tokens, generator=g),
        "ref_logprobs": logprobs + 0.2 * torch.randn(num_tokens, generator=g),
        "rollout_logprobs": logprobs + 0.5 * torch.randn(num_tokens, generator=g),
        "values": torch.randn(num_tokens, generator=g),
        "advantages": torch.randn(num_tokens, generator=g),
        "entropy": torch.rand(num_tokens, generator=g) * 2,
        "logits": torch.randn(num_tokens, 11, generator=g),
    }


def value_targets(x: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_values, returns) far enough from `values` that value clipping triggers on some tokens."""
    return x["values"] + 0.5 * x["advantages"], x["values"] + 0.1 * x["entropy"]


def advantages_outputs(x: Tensors) -> Tensors:
    kl = kl_penalty(x["old_logprobs"], x["ref_logprobs"], "k1")
    out: Tensors = {}
    for estimator in ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        for tag, cfg in (
            ("default", LossConfig(advantage_estimator=estimator)),
            ("shaped", LossConfig(advantage_estimator=estimator, gamma=0.9, lambd=0.95, kl_coef=0.05)),
        ):
            result = compute_advantages(
                cfg,
                rewards=x["rewards"],
                loss_mask=x["loss_mask"],
                cu_seqlens=x["cu_seqlens"],
                group_ids=x["group_ids"],
                rollout_ids=x["rollout_ids"],
                kl=kl,
                values=x["values"],
            )
            out[f"{estimator}.{tag}.advantages"] = result.advantages
            out[f"{estimator}.{tag}.returns"] = result.returns
    return out


def losses_outputs(x: Tensors) -> Tensors:
    log_ratio = x["logprobs"] - x["old_logprobs"]
    out: Tensors = {}
    for tag, eps_high, eps_c in (("sym", 0.2, None), ("asym", 0.28, None), ("dual", 0.2, 3.0)):
        clip = ppo_clip_loss(log_ratio, x["advantages"], eps_clip=0.2, eps_clip_high=eps_high, eps_clip_c=eps_c)
        out[f"ppo_clip.{tag}.loss"] = clip.loss
        out[f"ppo_clip.{tag}.clipped"] = clip.clipped
        out[f"ppo_clip.{tag}.dual_clipped"] = clip.dual_clipped
    out["gspo_log_ratio"] = gspo_log_ratio(x["logprobs"], x["old_logprobs"], x["loss_mask"], x["cu_seqlens"])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        out[f"kl.{kind}"] = kl_penalty(x["logprobs"], x["ref_logprobs"], kind)
    out["kl.low_var_kl.unbiased"] = kl_penalty(
        x["logprobs"], x["ref_logprobs"], "low_var_kl", importance_ratio=torch.exp(log_ratio)
    )
    out["entropy_from_logits"] = entropy_from_logits(x["logits"])
    out["sft"] = sft_loss(x["logprobs"])
    old_values, returns = value_targets(x)
    value = clipped_value_loss(x["values"], old_values, returns, value_clip=0.2)
    out["value.loss"] = value.loss
    out["value.clipped"] = value.clipped
    return out


def corrections_outputs(x: Tensors) -> Tensors:
    out: Tensors = {}
    tis = tis_weights(x["old_logprobs"], x["rollout_logprobs"], clip=2.0, clip_low=0.5)
    mis = mis_weights(x["old_logprobs"], x["rollout_logprobs"], low=0.5, high=2.0)
    for name, result in (("tis", tis), ("mis", mis)):
        out[f"{name}.weights"] = result.weights
        out[f"{name}.ratio"] = result.ratio
        out[f"{name}.corrected"] = result.corrected
    out.update({f"mismatch.{k}": v for k, v in mismatch_metrics(x["old_logprobs"], x["rollout_logprobs"]).items()})
    return out


def reduce_outputs(x: Tensors) -> Tensors:
    counts = loss_mask_counts(x["loss_mask"], x["cu_seqlens"])
    return {
        f"denominators.{reduction}": loss_denominators(
            counts, reduction=reduction, rollout_ids=x["rollout_ids"], max_response_tokens=MAX_RESPONSE_TOKENS
        )
        for reduction in ("token", "sample", "rollout", "constant")
    }


OBJECTIVE_CONFIGS = {
    "grpo_token": LossConfig(loss_reduction="token"),
    "grpo_rollout_kl_entropy": LossConfig(kl_loss_coef=0.01, entropy_coef=0.001),
    "dual_clip_sample_tis": LossConfig(eps_clip_c=3.0, eps_clip_high=0.28, loss_reduction="sample", use_tis=True),
    "gspo_mis": LossConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, use_mis=True),
    "unbiased_k2": LossConfig(kl_loss_coef=0.1, kl_loss_type="k2", use_unbiased_kl=True),
    "sft": LossConfig(loss_type="sft"),
    "dr_grpo": LossConfig(advantage_estimator="dr_grpo", max_response_tokens=MAX_RESPONSE_TOKENS),
}


def objective_outputs(x: Tensors) -> Tensors:
    counts = loss_mask_counts(x["loss_mask"], x["cu_seqlens"])
    out: Tensors = {}
    for name, cfg in OBJECTIVE_CONFIGS.items():
        denominators = loss_denominators(
            counts, reduction=cfg.reduction, rollout_ids=x["rollout_ids"], max_response_tokens=cfg.max_response_tokens
        )
        logprobs = x["logprobs"].clone().requires_grad_()
        loss, metrics = compute_policy_loss(
            logprobs,
            loss_mask=x["loss_mask"],
            sample_denominators=denominators,
            cfg=cfg,
            cu_seqlens=x["cu_seqlens"],
            advantages=x["advantages"],
            old_logprobs=x["old_logprobs"],
            ref_logprobs=x["ref_logprobs"],
            rollout_logprobs=x["rollout_logprobs"],
            entropy=x["entropy"],
        )
        loss.backward()
        out[f"{name}.loss"] = loss.detach()
        out[f"{name}.grad"] = logprobs.grad
        out.update({f"{name}.metric.{k}": v for k, v in metrics.items()})
    values = x["values"].clone().requires_grad_()
    denominators = loss_denominators(counts, reduction="rollout", rollout_ids=x["rollout_ids"])
    loss, metrics = compute_value_loss(
        values,
        old_values=value_targets(x)[0],
        returns=value_targets(x)[1],
        loss_mask=x["loss_mask"],
        sample_denominators=denominators,
        cfg=LossConfig(),
        cu_seqlens=x["cu_seqlens"],
    )
    loss.backward()
    out["value.loss"] = loss.detach()
    out["value.grad"] = values.grad
    out.update({f"value.metric.{k}": v for k, v in metrics.items()})
    return out


GROUPS: dict[str, tuple[int, Callable[[Tensors], Tensors]]] = {
    "advantages": (1, advantages_outputs),
    "losses": (2, losses_outputs),
    "corrections": (3, corrections_outputs),
    "reduce": (4, reduce_outputs),
    "objective": (5, objective_outputs),
}


def platform() -> str:
    """What decides the float rounding of these cases: torch version and build, CPU kernels and model."""
    build = (torch.version.git_version or "")[:12]
    return f"torch {torch.__version__} ({build}), cpu {torch.backends.cpu.get_cpu_capability()}, {cpu_model()}"


def cpu_model() -> str:
    """vendor/family/model from /proc/cpuinfo (Linux); the machine name elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform as host

        return host.processor() or host.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return "/".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model"))


def snapshot_path(group: str) -> Path:
    return SNAPSHOT_DIR / f"{group}.safetensors"


def split_saved(saved: Tensors) -> tuple[Tensors, Tensors]:
    inputs = {k.removeprefix("in."): v for k, v in saved.items() if k.startswith("in.")}
    outputs = {k.removeprefix("out."): v for k, v in saved.items() if k.startswith("out.")}
    return inputs, outputs


def update_snapshots() -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
    for group, (seed, compute) in GROUPS.items():
        inputs = stream_inputs(seed)
        outputs = compute(inputs)
        tensors = {f"in.{k}": v.clone() for k, v in inputs.items()}
        tensors.update({f"out.{k}": v.detach().clone() for k, v in outputs.items()})
        save_file(tensors, str(snapshot_path(group)), metadata={"platform": platform()})
        print(f"wrote {snapshot_path(group)} ({len(outputs)} outputs)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/algo/algo_snapshot_cases.py --update")
    update_snapshots()
