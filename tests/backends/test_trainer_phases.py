"""The trainer actor hands each TrainStep's phase (and index) to the backend with the call (no
config swapped on the backend outside its lock), builds the phases from the recipe, and with
`train.sleep_between_steps` really calls the Offloadable protocol around each publish."""

import asyncio
import time
from types import SimpleNamespace

import numpy as np

from miles.actors.trainer import Trainer, phases_for
from miles.algo import LossConfig
from miles.backends import TrainConfig
from miles.backends.base import Offloadable, RankInfo
from miles.wire.messages import BatchIndex, PublishWeights, SaveCheckpoint, TrainStep


def recipe(**algo):
    return SimpleNamespace(algo=LossConfig(**algo), train=TrainConfig(lr=1e-4, warmup_steps=10),
                           sft=SimpleNamespace(lr=1e-3), rollout=SimpleNamespace(max_new_tokens=16))


class SlowBackend:
    """Reads its config half-way through the step, as a real backend does at each optimizer step."""

    def __init__(self):
        self.cfg, self.seen = TrainConfig(lr=0.5), []

    def train(self, samples, phase=None, index=None):
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


class OffloadBackend:
    """Records the trainer's calls; refuses any but wake_up while asleep, as FSDP and Megatron do."""

    def __init__(self):
        self.calls, self.asleep = [], False

    def _call(self, what):
        assert not self.asleep or what == "wake_up", f"{what} while asleep"
        self.calls.append(what)

    def train(self, samples, phase, index):
        self._call(f"train index={index is not None}")
        return {"loss": 0.0}

    def update_weights(self, transport, version):
        self._call(f"publish {version}")

    def save_model(self, path, hf=False, extra_state=None):
        self._call("save")

    def sleep(self):
        self._call("sleep")
        self.asleep = True

    def wake_up(self):
        self._call("wake_up")
        self.asleep = False


def test_a_sleeping_rank_lends_its_memory_between_publish_and_next_call():
    assert isinstance(OffloadBackend(), Offloadable)
    trainer = Trainer()
    trainer.backend, trainer.rank, trainer.transport = OffloadBackend(), RankInfo(), None
    trainer.recipe = SimpleNamespace(train=TrainConfig(sleep_between_steps=True))
    trainer.phases = phases_for(recipe())
    trainer.engine_urls = ["http://127.0.0.1:1"]   # connected: the publisher is not needed here
    one = np.zeros(1, np.int32)
    index = BatchIndex(lengths=one + 3, group_index=one, rollout_index=one, trained_tokens=one + 1,
                       positions=one)

    async def steps():
        await trainer.on_train_step(TrainStep(samples=[], phase="rl", index=index))
        await trainer.on_publish_weights(PublishWeights(version=1))
        await trainer.on_train_step(TrainStep(samples=[], phase="rl"))
        await trainer.on_publish_weights(PublishWeights(version=2))
        await trainer.on_save_checkpoint(SaveCheckpoint(path="ckpt"))

    asyncio.run(steps())
    assert trainer.backend.calls == ["train index=True", "publish 1", "sleep", "wake_up",
                                     "train index=False", "publish 2", "sleep", "wake_up", "save"]
    trainer.recipe.train = TrainConfig()   # the default: nothing is lent out
    trainer.backend.calls.clear()
    asyncio.run(trainer.on_publish_weights(PublishWeights(version=3)))
    assert trainer.backend.calls == ["publish 3"] and not trainer.asleep


def test_both_builtin_backends_are_offloadable():
    from miles.backends.fsdp import FSDPBackend
    from miles.backends.megatron import MegatronBackend
    assert isinstance(FSDPBackend(), Offloadable) and issubclass(MegatronBackend, Offloadable)
