"""The trainer actor hands each TrainStep's phase to the backend with the call (no config swapped
on the backend outside its lock), and builds the phases from the recipe."""

import asyncio
import time
from types import SimpleNamespace

from miles.actors.trainer import Trainer, phases_for
from miles.algo import LossConfig
from miles.backends import TrainConfig
from miles.wire.messages import TrainStep


def recipe(**algo):
    return SimpleNamespace(algo=LossConfig(**algo), train=TrainConfig(lr=1e-4, warmup_steps=10),
                           sft=SimpleNamespace(lr=1e-3), rollout=SimpleNamespace(max_new_tokens=16))


class SlowBackend:
    """Reads its config half-way through the step, as a real backend does at each optimizer step."""

    def __init__(self):
        self.cfg, self.seen = TrainConfig(lr=0.5), []

    def train(self, samples, phase=None):
        time.sleep(0.2)
        cfg = phase.config if phase is not None else self.cfg
        self.seen.append((phase.name if phase is not None else None, cfg.lr))
        return {"loss": 0.0}


def test_concurrent_train_steps_each_run_with_their_own_phase():
    trainer = Trainer()
    trainer.backend = SlowBackend()
    trainer.phases = phases_for(recipe())

    async def sft_then_rl():
        return await asyncio.gather(trainer.on_train_step(TrainStep(samples=[], phase="sft")),
                                    trainer.on_train_step(TrainStep(samples=[], phase="rl")))

    results = asyncio.run(sft_then_rl())
    assert [r.metrics for r in results] == [{"loss": 0.0}] * 2
    assert trainer.backend.seen == [("sft", 1e-3), ("rl", 1e-4)]


def test_phases_from_the_recipe():
    phases = phases_for(recipe(advantage_estimator="dr_grpo"))
    rl, sft = phases["rl"], phases["sft"]
    assert (rl.name, sft.name) == ("rl", "sft")
    # Dr. GRPO's constant is the generation budget unless the recipe names one.
    assert rl.loss.reduction == "constant" and rl.loss.max_response_tokens == 16
    assert phases_for(recipe(advantage_estimator="dr_grpo", max_response_tokens=64))["rl"].loss.max_response_tokens == 64
    assert rl.config.lr == 1e-4 and rl.config.warmup_steps == 10
    assert sft.loss.loss_type == "sft" and sft.config.old_logprobs == "auto"
    # The warm-start's schedule is its own: sft.lr from its step 0, no RL warmup or decay.
    assert (sft.config.lr, sft.config.warmup_steps, sft.config.lr_decay_style) == (1e-3, 0, "constant")
