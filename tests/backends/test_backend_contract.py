"""The contract around the backends: config errors, the factory, rank info, batch refusal messages,
LR schedule, HF names of fused MoE experts, and the host offload used by sleep/wake."""

import copy

import msgspec
import numpy as np
import pytest
import torch
from backend_helpers import make_samples

from miles.algo import LossConfig
from miles.backends import RankInfo, TrainConfig, TrainingBackend, make_backend
from miles.backends.batch import find_batch_error
from miles.backends.hf_weights import iter_hf_weight_buckets
from miles.backends.offload import HostOffload
from miles.backends.optim import lr_at
from miles.tiny import build_tiny_model


def test_config_defaults_and_errors():
    cfg = msgspec.toml.decode(b'backend = "fsdp"\nlr = 2e-6\n', type=TrainConfig)
    assert cfg.lr == 2e-6 and cfg.master_weights_fp32 and cfg.param_dtype == "bfloat16"
    with pytest.raises(msgspec.ValidationError, match="lrr"):
        msgspec.toml.decode(b"lrr = 1.0\n", type=TrainConfig)
    with pytest.raises(ValueError, match=r"train.backend='jax' is not one of fsdp, megatron"):
        TrainConfig(backend="jax")
    with pytest.raises(ValueError, match=r"train.max_tokens_per_microbatch=0"):
        TrainConfig(max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match="lr_decay_steps=0 must exceed warmup_steps"):
        TrainConfig(lr_decay_style="cosine")
    with pytest.raises(ValueError, match="old_logprobs='rollout' needs steps_per_train=1"):
        TrainConfig(old_logprobs="rollout", steps_per_train=2)


def test_factory_and_megatron_stub():
    backend = make_backend("fsdp")
    assert isinstance(backend, TrainingBackend) and backend.name == "fsdp"
    megatron = make_backend("megatron")  # constructing imports no megatron-core; init does
    assert isinstance(megatron, TrainingBackend) and megatron.name == "megatron"
    with pytest.raises(ValueError, match="train.backend = 'tpu': expected one of fsdp, megatron"):
        make_backend("tpu")


def test_backends_never_import_actors():
    import pathlib
    import re

    import miles.backends
    for path in pathlib.Path(miles.backends.__file__).parent.glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+miles\.actors", path.read_text(), re.M), path


def test_rank_info_from_env():
    info = RankInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (info.rank, info.world_size, info.master_port) == (1, 2, 29500)
    assert RankInfo.from_env({}) == RankInfo()
    with pytest.raises(ValueError, match="MASTER_PORT=0 must be set"):
        RankInfo.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="rank=2 world_size=2"):
        RankInfo.from_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_bad_batches_name_sample_and_field():
    loss = LossConfig()
    good = make_samples(groups=2, per_group=2)
    assert find_batch_error(good, vocab_size=500, loss=loss) is None
    assert "empty" in find_batch_error([], vocab_size=500, loss=loss)

    def error(mutate, **kw):
        batch = copy.deepcopy(good)
        mutate(batch[1])
        return find_batch_error(batch, vocab_size=500, loss=kw.pop("loss", loss), **kw)

    assert "sample 1 (group_id='g0'" in error(lambda s: setattr(s, "reward", float("nan")))
    assert "reward: missing" in error(lambda s: setattr(s, "reward", None))
    assert "set train.reward_key" in error(lambda s: setattr(s, "reward", {"acc": 1.0}))
    assert error(lambda s: setattr(s, "reward", {"acc": 1.0}), reward_key="acc") is None
    assert "loss_mask: length" in error(lambda s: setattr(s, "loss_mask", s.loss_mask[1:]))
    assert "loss_mask: value 2" in error(lambda s: s.loss_mask.__setitem__(0, 2))
    assert "rollout_logprobs: non-finite" in error(lambda s: s.rollout_logprobs.__setitem__(0, np.nan))
    assert "id 900 outside the vocabulary" in error(lambda s: s.tokens.__setitem__(0, 900))
    assert "prompt must keep at least one token" in error(
        lambda s: setattr(s, "response_length", len(s.tokens)))
    assert "group_id: empty" in error(lambda s: setattr(s, "group_id", ""))
    assert error(lambda s: setattr(s, "group_id", ""), loss=LossConfig(loss_type="sft")) is None
    assert "required by algo.use_tis = true" in error(lambda s: setattr(s, "rollout_logprobs", None),
                                          loss=LossConfig(use_tis=True))
    siblings = make_samples(groups=1, per_group=4, siblings=2)
    siblings[1].reward = 5.0
    assert "siblings of rollout_id 'g0-r0' disagree" in find_batch_error(siblings, vocab_size=500, loss=loss)


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, lr_decay_style="linear", lr_decay_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.55) and lr_at(14, cfg) == lr_at(100, cfg) == pytest.approx(0.1)
    cos = TrainConfig(lr=1.0, min_lr=0.0, lr_decay_style="cosine", lr_decay_steps=10)
    assert lr_at(5, cos) == pytest.approx(0.5)
    assert lr_at(7, TrainConfig(lr=0.3)) == 0.3


def test_moe_weights_get_checkpoint_names():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(arch="qwen3_moe")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    on_disk = {}
    for f in path.glob("*.safetensors"):
        on_disk.update(load_file(str(f)))
    buckets = list(iter_hf_weight_buckets(lm, bucket_bytes=100_000))
    sent = dict(kv for bucket in buckets for kv in bucket)
    assert len(buckets) > 1 and len(sent) == sum(len(b) for b in buckets)
    assert set(sent) == set(on_disk), sorted(set(sent) ^ set(on_disk))
    for name, tensor in on_disk.items():
        assert torch.equal(sent[name], tensor), name


def test_host_offload_round_trip():
    base = torch.randn(100)
    view, other = base[10:20], torch.randn(4, 4)
    before = (base.clone(), other.clone())
    offload = HostOffload()
    assert offload.sleep([base, view, other]) == (100 + 16) * 4  # the view shares base's storage
    assert base.untyped_storage().nbytes() == 0 and offload.asleep
    offload.wake_up()
    assert torch.equal(base, before[0]) and torch.equal(other, before[1])
    assert torch.equal(view, before[0][10:20])
