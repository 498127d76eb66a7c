"""Packing: the planner keeps groups whole and balances ranks; packed log-probs equal unpacked ones."""

import numpy as np
import pytest
import torch
from backend_helpers import make_samples

from miles.backends import attention
from miles.backends.batch_plan import pack_first_fit, plan_batch
from miles.backends.packing import pack_samples
from miles.backends.policy import PackedPolicy
from miles.tiny import build_tiny_model

torch.set_num_threads(1)


def test_plan_keeps_groups_whole_and_ranks_in_step():
    rng = np.random.default_rng(0)
    group_index = np.repeat(np.arange(7), 4)
    lengths = rng.integers(5, 60, group_index.size).tolist()
    plan = plan_batch(group_index, lengths, world_size=3, steps=2, max_tokens=64)
    seen = []
    for step in plan:
        assert len({len(rank) for rank in step}) == 1, "ranks must run equal micro-batch counts"
        for rank in step:
            groups_here = {int(group_index[i]) for mb in rank if mb for i in mb}
            for other in step:
                if other is not rank:
                    assert not groups_here & {int(group_index[i]) for mb in other if mb for i in mb}
            for mb in rank:
                if mb:
                    assert sum(lengths[i] for i in mb) <= 64 or len(mb) == 1
                    seen.extend(mb)
    assert sorted(seen) == list(range(group_index.size))
    with pytest.raises(ValueError, match="steps_per_train=9 but the batch has only 7"):
        plan_batch(group_index, lengths, world_size=1, steps=9, max_tokens=64)


def test_first_fit_long_sample_alone():
    assert pack_first_fit([0, 1, 2], [100, 10, 20], max_tokens=50) == [[0], [1, 2]]


def unpacked_logprobs(lm, samples):
    out = []
    for s in samples:
        n, r = len(s.tokens), s.response_length
        ids = torch.as_tensor(s.tokens, dtype=torch.int64)[None]
        logits = lm(input_ids=ids).logits[0, n - r - 1:n - 1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None]).squeeze(1))
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize("attn", ["packed", "sdpa"])
def test_packed_equals_unpacked(arch, attn):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(arch=arch)
    impl = attention.register() if attn == "packed" else "sdpa"
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    samples = make_samples(groups=1, per_group=5, seed=4)
    mb = pack_samples([s.tokens for s in samples], [s.response_length for s in samples],
                      [np.ones(s.response_length, np.uint8) for s in samples], [None] * 5,
                      list(range(5)), torch.device("cpu"))
    policy = PackedPolicy(lm, packed_attention=attn == "packed")
    with torch.no_grad():
        packed, _ = policy.run(mb.inputs)
        alone = unpacked_logprobs(reference, samples)
    assert packed.shape == alone.shape
    assert float((packed - alone).abs().max()) <= 1e-5
