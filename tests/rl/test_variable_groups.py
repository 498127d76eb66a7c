"""Groups of variable size (trajectory trees, issue 16 item 4): a group is every sample of its prompt's
rollouts, and a rollout may have produced 1..k samples sharing its `rollout_id`.

Through the buffer over real sockets (the `nonzero_std` filter looks at one reward per rollout), its
journal (a restarted buffer gives back the same trees), and the trainer's side: batch numbering,
planning (a rollout never split across optimizer steps or ranks), GRPO statistics over rollouts (a
rollout with 5 samples does not weigh 5x in the mean and std), and one real FSDP train step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.runtime import Registry, Runtime
from miles.actors.buffer import Buffer, nonzero_std, rollout_rewards
from miles.algo import LossConfig, compute_advantages
from miles.algo.layout import cu_seqlens_from_lengths
from miles.backends import RankInfo, TrainConfig, make_backend
from miles.backends.batch import check_batch
from miles.backends.batch_plan import plan_batch
from miles.tiny import build_tiny_model
from miles.wire.messages import (BufferMetricsRequest, GetBatch, Group, PutGroup, Reserve, Sample,
                                 VersionSpan)

GRPO = LossConfig(advantage_estimator="grpo", loss_reduction="rollout")


def tree_group(gid: str, rollouts: list[tuple[float, int]], prompt_index: int = 0, seed: int = 0) -> Group:
    """`rollouts`: (reward, number of samples) per rollout; siblings share rollout_id and reward."""
    rng = np.random.default_rng(seed)
    samples = []
    for r, (reward, k) in enumerate(rollouts):
        for _ in range(k):
            n_resp = int(rng.integers(3, 9))
            samples.append(Sample(
                tokens=rng.integers(0, 200, 5 + n_resp).astype(np.int32), response_length=n_resp,
                loss_mask=np.ones(n_resp, np.uint8), rollout_logprobs=np.full(n_resp, -0.5, np.float32),
                reward=reward, status="completed", weight_versions=[VersionSpan(0, 0, n_resp)],
                group_id=gid, rollout_id=f"{gid}/{r}", index=len(samples)))
    return Group(group_id=gid, samples=samples, prompt_index=prompt_index)


@pytest.fixture
async def buf():
    rt = Runtime()
    reg = Registry()
    rt.registry_endpoint = await reg.start(rt, register=False)
    b = Buffer()
    await b.start(rt)
    client = Runtime(registry=rt.registry_endpoint)
    yield b, client.ref("buffer")
    client.close()
    await b.close()
    await reg.close()
    rt.close()


def test_filter_counts_one_reward_per_rollout():
    # rollout 0 compacted into 5 samples, all rewards 1.0: one rollout, a single distinct reward
    assert rollout_rewards(tree_group("a", [(1.0, 5), (1.0, 1)])) == [1.0, 1.0]
    assert not nonzero_std(tree_group("a", [(1.0, 5), (1.0, 1)]))
    assert not nonzero_std(tree_group("one", [(0.5, 4)]))          # one rollout: advantage 0
    assert nonzero_std(tree_group("b", [(1.0, 3), (0.0, 1)]))
    # samples without rollout_id are each a rollout of their own
    loose = tree_group("c", [(1.0, 1), (0.0, 1)])
    for s in loose.samples:
        s.rollout_id = ""
    assert rollout_rewards(loose) == [1.0, 0.0] and nonzero_std(loose)


async def test_buffer_keeps_variable_groups_whole_and_filters_over_rollouts(buf):
    b, ref = buf
    b.configure(groups_per_step=2, max_staleness=1, filter_spec="nonzero_std")
    puts = {"flat-tree": tree_group("flat-tree", [(1.0, 5), (1.0, 1)], 0, seed=1),
            "tree": tree_group("tree", [(1.0, 5), (0.0, 1), (0.5, 2)], 1, seed=2),
            "single": tree_group("single", [(0.0, 1), (1.0, 1)], 2, seed=3)}
    decisions = {}
    for gid, group in puts.items():
        slot = (await ref.call(Reserve(prompt_index=group.prompt_index))).slot
        decisions[gid] = (await ref.call(PutGroup(group=group, slot=slot))).decision
    assert decisions == {"flat-tree": "drop", "tree": "keep", "single": "keep"}
    batch = await ref.call(GetBatch(n_groups=2))
    assert [(g.group_id, len(g.samples)) for g in batch.groups] == [("tree", 8), ("single", 2)]
    got = batch.groups[0].samples
    assert [s.rollout_id for s in got] == [s.rollout_id for s in puts["tree"].samples]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(got, puts["tree"].samples))
    m = (await ref.call(BufferMetricsRequest())).values
    assert (m["buffer/filtered"], m["buffer/kept"]) == (1, 2)


async def test_journal_restores_trees_with_their_sizes(tmp_path):
    path = tmp_path / "buffer" / "journal.bin"
    a = Buffer()
    a.configure(groups_per_step=1, max_staleness=3, filter_spec="nonzero_std")
    a.open_journal(path, restore=False)
    sizes = [[(1.0, 5), (0.0, 1)], [(0.0, 2), (1.0, 3), (0.5, 1)]]
    for i, rollouts in enumerate(sizes):
        await a.on_reserve(Reserve(prompt_index=i, request_id=f"r{i}", timeout_s=5))
        await a.on_put_group(PutGroup(group=tree_group(f"g{i}", rollouts, i, seed=i), slot=i))
    b = Buffer()
    b.configure(groups_per_step=1, max_staleness=3, filter_spec="nonzero_std")
    b.open_journal(path, restore=True)
    batch = await b.on_get_batch(GetBatch(n_groups=2, timeout_s=5))
    assert [len(g.samples) for g in batch.groups] == [6, 6]
    assert [len(set(s.rollout_id for s in g.samples)) for g in batch.groups] == [2, 3]
    a.journal.close()
    b.journal.close()


def _batch_of(groups: list[Group]):
    return check_batch([s for g in groups for s in g.samples], vocab_size=200, loss=GRPO)


def test_grpo_statistics_are_over_rollouts_not_samples():
    # 3 rollouts with rewards 1, 0, 0; rollout 0 produced 5 samples. Over rollouts the mean is 1/3
    # (over samples it would be 5/7), the Bessel std sqrt(1/3).
    batch = _batch_of([tree_group("g", [(1.0, 5), (0.0, 1), (0.0, 1)])])
    assert batch.rollout_index.tolist() == [0, 0, 0, 0, 0, 1, 2]
    lengths = [s.response_length for s in batch.samples]
    mask = torch.ones(sum(lengths))
    cu = cu_seqlens_from_lengths(lengths)
    adv = compute_advantages(GRPO, rewards=torch.as_tensor(batch.rewards, dtype=torch.float32),
                             loss_mask=mask, cu_seqlens=cu, group_ids=torch.as_tensor(batch.group_index),
                             rollout_ids=torch.as_tensor(batch.rollout_index)).advantages
    per_sample = adv[cu[:-1]]  # the first token of each sample carries its sample's advantage
    std = (1 / 3) ** 0.5
    expected = torch.tensor([(2 / 3) / (std + 1e-6)] * 5 + [(-1 / 3) / (std + 1e-6)] * 2)
    torch.testing.assert_close(per_sample, expected, rtol=1e-6, atol=1e-6)
    # the same as one sample per rollout
    single = _batch_of([tree_group("g", [(1.0, 1), (0.0, 1), (0.0, 1)])])
    lengths1 = [s.response_length for s in single.samples]
    cu1 = cu_seqlens_from_lengths(lengths1)
    adv1 = compute_advantages(GRPO, rewards=torch.as_tensor(single.rewards, dtype=torch.float32),
                              loss_mask=torch.ones(sum(lengths1)), cu_seqlens=cu1,
                              group_ids=torch.as_tensor(single.group_index)).advantages
    torch.testing.assert_close(adv1[cu1[:-1]], expected[[0, 5, 6]], rtol=1e-6, atol=1e-6)


def test_plan_keeps_each_rollout_in_one_step_and_one_rank():
    groups = [tree_group("a", [(1.0, 5), (0.0, 1)], seed=1), tree_group("b", [(0.0, 1), (1.0, 1)], seed=2),
              tree_group("c", [(1.0, 2), (0.0, 3), (0.5, 1)], seed=3), tree_group("d", [(0.0, 7), (1.0, 1)], seed=4)]
    batch = _batch_of(groups)
    plan = plan_batch(batch.group_index, batch.lengths, world_size=2, steps=2, max_tokens=24)
    home: dict[int, tuple[int, int]] = {}
    seen = []
    for step, ranks in enumerate(plan):
        for rank, mbs in enumerate(ranks):
            for mb in mbs:
                for i in mb or []:
                    seen.append(i)
                    where = home.setdefault(int(batch.rollout_index[i]), (step, rank))
                    assert where == (step, rank), f"rollout of sample {i} split over {where} and {(step, rank)}"
    assert sorted(seen) == list(range(len(batch.samples)))


def test_fsdp_trains_on_groups_of_variable_size():
    torch.set_num_threads(1)
    cfg = TrainConfig(model_path=str(build_tiny_model(arch="qwen3")), param_dtype="float32", lr=1e-3,
                      steps_per_train=2, max_tokens_per_microbatch=40)
    backend = make_backend("fsdp")
    backend.init(cfg, RankInfo(), GRPO)
    try:
        groups = [tree_group("a", [(1.0, 5), (0.0, 1)], seed=5), tree_group("b", [(0.0, 1), (1.0, 2)], seed=6),
                  tree_group("c", [(1.0, 1), (0.0, 1), (0.5, 4)], seed=7)]
        samples = [s for g in groups for s in g.samples]
        metrics = backend.train(samples)
        assert metrics["samples"] == len(samples) == 15 and metrics["optimizer_steps"] == 2
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert metrics["tokens"] == sum(len(s.tokens) for s in samples)
    finally:
        backend.close()
