"""Training phases on the FSDP backend (one gloo rank, in this process): an SFT warm-start has its
own optimizer state and schedule, so RL starts at step 0 of its schedule with empty Adam moments,
and checkpoints keep saving and restoring the RL optimizer and step."""

import msgspec
import pytest
import torch
from backend_helpers import make_samples

from miles.algo import LossConfig
from miles.backends import TrainConfig, TrainPhase
from miles.backends.optim import lr_at
from miles.tiny import build_tiny_model

SFT_STEPS = 3


def test_sft_warm_start_has_its_own_optimizer_and_schedule(backends, tmp_path):
    torch.set_num_threads(1)
    path = str(build_tiny_model(arch="qwen3"))
    rl_cfg = TrainConfig(model_path=path, param_dtype="float32", lr=1e-3, min_lr=1e-5, warmup_steps=4,
                         lr_decay_style="cosine", lr_decay_steps=40)
    sft_cfg = msgspec.structs.replace(rl_cfg, lr=3e-3, warmup_steps=0, lr_decay_style="constant",
                                      lr_decay_steps=0)
    rl = TrainPhase("rl", LossConfig(), rl_cfg)
    sft = TrainPhase("sft", LossConfig(loss_type="sft"), sft_cfg)
    sft_batch = make_samples(groups=1, per_group=4, seed=2)
    rl_batch = make_samples(groups=2, per_group=3, seed=3)

    backend = backends(rl_cfg, rl.loss)
    sft_lrs = [backend.train(sft_batch, sft)["lr"] for _ in range(SFT_STEPS)]
    assert sft_lrs == [3e-3] * SFT_STEPS
    assert backend.step == 0, "SFT steps must not advance the RL schedule"
    assert len(backend.optimizer.state) == 0, "the RL optimizer has state before its first step"

    first = backend.train(rl_batch, rl)
    assert first["lr"] == lr_at(0, rl_cfg) == 2.5e-4  # warmup step 0, not step SFT_STEPS
    assert backend.step == 1
    adam_steps = {float(state["step"]) for state in backend.optimizer.state.values()}
    assert adam_steps == {1.0}, f"RL Adam moments are not fresh: {adam_steps}"
    assert set(backend._optimizers) == {"rl"}, "the SFT optimizer state outlived the warm-start"

    ckpt = tmp_path / "ckpt"
    backend.save_model(ckpt, extra_state={"step": 1})
    second = backend.train(rl_batch)  # phase=None is the main (RL) phase
    assert second["lr"] == lr_at(1, rl_cfg) and backend.step == 2

    resumed = backends(rl_cfg, rl.loss)
    assert resumed.load_model(ckpt) == {"step": 1} and resumed.step == 1
    assert {float(s["step"]) for s in resumed.optimizer.state.values()} == {1.0}
    again = resumed.train(rl_batch, rl)
    assert again["lr"] == second["lr"] and again["loss"] == second["loss"]
    # The next loss depends on the update made with the restored Adam moments.
    assert resumed.train(rl_batch)["loss"] == backend.train(rl_batch)["loss"]


def test_a_phase_cannot_change_the_model(backends):
    path = str(build_tiny_model(arch="qwen3"))
    cfg = TrainConfig(model_path=path, param_dtype="float32")
    backend = backends(cfg, LossConfig())
    other = TrainPhase("sft", LossConfig(loss_type="sft"), TrainConfig(model_path=path + "-other"))
    with pytest.raises(ValueError, match=r"phase 'sft': train.model_path = .*cannot change the model"):
        backend.train(make_samples(groups=1, per_group=2), other)
    kl = TrainPhase("kl", LossConfig(kl_loss_coef=0.1), cfg)
    with pytest.raises(ValueError, match=r"phase 'kl': the loss has a KL term .* no reference model"):
        backend.train(make_samples(groups=1, per_group=2), kl)
