"""The trainer's door: rewards through the one accessor, rollout log-probs required where used."""

import copy

import numpy as np
import pytest
from backend_helpers import make_samples

from miles.algo import LossConfig
from miles.backends.batch import check_batch, find_batch_error

TIS, MIS, GRPO = LossConfig(use_tis=True), LossConfig(use_mis=True), LossConfig()


def _without_logprobs(index: int):
    batch = make_samples(groups=2, per_group=2, siblings=2)
    batch[index].rollout_logprobs = None
    return batch


@pytest.mark.parametrize(("loss", "need", "setting"), [
    (TIS, False, "algo.use_tis = true"),
    (MIS, False, "algo.use_mis = true"),
    (GRPO, True, "train.old_logprobs = 'rollout'"),
])
def test_missing_rollout_logprobs_are_refused_naming_sample_and_setting(loss, need, setting):
    error = find_batch_error(_without_logprobs(3), vocab_size=500, loss=loss, need_rollout_logprobs=need)
    assert error is not None
    assert "sample 3" in error and "rollout_id='g1-r0'" in error
    assert f"rollout_logprobs: missing (None), required by {setting}" in error
    with pytest.raises(ValueError, match="rollout_logprobs: missing"):
        check_batch(_without_logprobs(3), vocab_size=500, loss=loss, need_rollout_logprobs=need)


def test_rollout_logprobs_are_optional_where_nothing_uses_them():
    assert find_batch_error(_without_logprobs(0), vocab_size=500, loss=GRPO) is None
    # The SFT warm-start of a TIS recipe has no rollout: nothing in the SFT loss reads them.
    sft = LossConfig(loss_type="sft", use_tis=True)
    assert find_batch_error(_without_logprobs(0), vocab_size=500, loss=sft, need_rollout_logprobs=True) is None


def test_all_zero_rollout_logprobs_are_accepted():
    # log p == 0.0 is a float32 fact for a confident policy, not proof of a zero-filled array
    # (see batch.py); the refusal is for None only.
    batch = make_samples(groups=1, per_group=2)
    for s in batch:
        s.rollout_logprobs = np.zeros(s.response_length, np.float32)
    assert find_batch_error(batch, vocab_size=500, loss=TIS, need_rollout_logprobs=True) is None


def test_dict_rewards_go_through_the_one_accessor():
    batch = make_samples(groups=2, per_group=2)
    for i, s in enumerate(batch):
        s.reward = {"acc": float(i % 2), "len": -float(i)}
    checked = check_batch(batch, vocab_size=500, loss=GRPO, reward_key="len")
    assert checked.rewards.tolist() == [s.scalar_reward("len") for s in batch] == [0.0, -1.0, -2.0, -3.0]
    no_key = find_batch_error(batch, vocab_size=500, loss=GRPO)
    assert "sample 0" in no_key and "set train.reward_key" in no_key and "['acc', 'len']" in no_key
    wrong = find_batch_error(batch, vocab_size=500, loss=GRPO, reward_key="score")
    assert "train.reward_key = 'score': the reward dict has no such key" in wrong
    bad = copy.deepcopy(batch)
    bad[2].reward = {"len": "long"}
    assert "sample 2" in find_batch_error(bad, vocab_size=500, loss=GRPO, reward_key="len")
