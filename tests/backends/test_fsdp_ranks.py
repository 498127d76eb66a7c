"""FSDP2 with two real processes on gloo: per-rollout normalization across micro-batches and ranks,
bad-batch refusal, training, full state dict, save/resume, HF export, update_weights, sleep/wake,
and the objective/execution options (KL, TIS, several steps per batch, checkpointing, bf16).

Each architecture runs the whole list in one process pair (fsdp_worker.py asserts as it goes);
here the figures it reports are checked again so a failure names what broke.
"""

import pytest
from backend_helpers import run_ranks


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fsdp_two_ranks(arch, tmp_path):
    # qwen3 also runs the option checks (fsdp_worker.options) in the same process pair
    scenario = "suite+options" if arch == "qwen3" else "suite"
    ranks = run_ranks(f"{scenario}:{arch}", tmp_path, world_size=2, timeout_s=240)
    zero = ranks[0]
    # The same gradient whether siblings share a micro-batch or not, and as one unsharded step.
    assert zero["grad_rel_err_split"] < 1e-5
    assert zero["grad_rel_err_reference"] < 1e-5
    assert "sample 5" in zero["error_nan_reward"] and "reward" in zero["error_nan_reward"]
    assert "loss_mask" in zero["error_mask"]
    assert "differs between trainer ranks" in ranks[1]["error_ranks"]
    losses = zero["sft_losses"]
    assert losses[0] > losses[1] > losses[2]
    assert zero["export_logprob_max_diff"] <= 1e-5
    assert zero["export_entropy_max_diff"] <= 1e-5
    names = zero["update_names"]
    if arch == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
        assert not any(n.endswith("gate_up_proj") for n in names)
    assert zero["update_buckets"] > 1
    if arch == "qwen3":
        # KL to a frozen reference, entropy, TIS, 2 optimizer steps per batch, REINFORCE++ with KL
        # shaping while one rank has no samples, rollout log-probs as the old policy, activation
        # checkpointing (same gradient), bf16 parameters without an fp32 master
        options = zero["options"]
        assert options["kl"][1] > 0
        assert options["rollout_old_clipfrac"] > 0
        assert options["bf16_losses"][2] < options["bf16_losses"][0]

