"""R3 routing on the wire: uint8 frames, their size against SGLang's int32, and per-rank sharding
(a rank receives only the samples, and so the routing, that it trains)."""

from __future__ import annotations

import numpy as np
import pytest

import backend_helpers
from miles.algo.routing import pack_routing, unpack_routing
from miles.backends import TrainConfig
from miles.backends.batch import group_numbers
from miles.backends.config import MegatronConfig
from miles.backends.batch_plan import plan_batch, sample_owners
from miles.loop import shard_batch
from miles.tiny import build_tiny_model
from miles.wire.codec import Codec
from miles.wire.messages import Sample, TrainStep

LAYERS, TOP_K, EXPERTS = 2, 2, 8


def routed_batch(vocab: int, groups: int = 6, per_group: int = 2, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        for j in range(per_group):
            n, r = int(rng.integers(12, 30)), int(rng.integers(3, 9))
            routed = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range((n - 1) * LAYERS)])
            out.append(Sample(tokens=rng.integers(0, vocab, n).astype(np.int32), response_length=r,
                              routed_experts=pack_routing(routed.reshape(n - 1, LAYERS, TOP_K).astype(np.int32)),
                              rollout_logprobs=np.full(r, -1.0, np.float32), reward=float(j),
                              group_id=f"g{g}", status="completed"))
    return out


def test_uint8_frames_round_trip_and_are_a_quarter_of_int32():
    codec = Codec()
    s = routed_batch(500, groups=1, per_group=1)[0]
    wide = s.routed_experts.astype(np.int32)                      # what SGLang's int32 would carry
    frames = codec.encode("call", TrainStep(samples=[s]))
    _, back = codec.decode(frames)
    got = back.samples[0].routed_experts
    assert got.dtype == np.uint8 and np.array_equal(got, s.routed_experts)
    assert np.array_equal(unpack_routing(got), wide)
    wide_frames = codec.encode("call", TrainStep(samples=[Sample(tokens=s.tokens, routed_experts=wide)]))
    sizes = sorted(len(memoryview(f)) for f in frames)
    wide_sizes = sorted(len(memoryview(f)) for f in wide_frames)
    assert wide.nbytes in wide_sizes and s.routed_experts.nbytes in sizes   # raw frames, no base64
    assert s.routed_experts.nbytes * 4 == wide.nbytes


def test_each_rank_gets_only_the_samples_and_routing_it_trains():
    cfg = TrainConfig(max_tokens_per_microbatch=64, steps_per_train=2)
    samples = routed_batch(500)
    steps = shard_batch(samples, cfg, 3)
    owners = sample_owners(group_numbers(samples), [len(s.tokens) for s in samples], world_size=3,
                           steps=2, max_tokens=64)
    plan = plan_batch(group_numbers(samples), [len(s.tokens) for s in samples], world_size=3, steps=2, max_tokens=64)
    for rank, step in enumerate(steps):
        trained = {i for st in plan for mb in st[rank] if mb for i in mb}
        assert set(step.index.positions.tolist()) == trained == set(np.flatnonzero(owners == rank).tolist())
        assert all(s.routed_experts is not None for s in step.samples)
        assert [s.tokens.tolist() for s in step.samples] == [samples[i].tokens.tolist()
                                                              for i in step.index.positions.tolist()]
        assert step.index.group_index.tolist() == group_numbers(samples).tolist()
        assert step.index.lengths.tolist() == [len(s.tokens) for s in samples]
    assert sorted(i for st in steps for i in st.index.positions.tolist()) == list(range(len(samples)))
    plain = shard_batch([Sample(tokens=s.tokens) for s in samples], cfg, 3)
    assert all(s.routed_experts is None for st in plain for s in st.samples)


def test_megatron_ranks_of_one_dp_index_share_a_shard():
    cfg = TrainConfig(backend="megatron", megatron=MegatronConfig(tp=2), max_tokens_per_microbatch=64)
    steps = shard_batch(routed_batch(500), cfg, 4)                  # dp = 2: ranks (0, 1) and (2, 3)
    pos = [st.index.positions.tolist() for st in steps]
    assert pos[0] == pos[1] and pos[2] == pos[3] and not set(pos[0]) & set(pos[2])


@pytest.mark.slow
def test_two_ranks_train_their_shards_and_refuse_together(tmp_path):
    path = build_tiny_model(arch="qwen3_moe")
    results = backend_helpers.run_ranks(str(path), tmp_path, world_size=2, timeout_s=240,
                                        worker=backend_helpers.WORKER.with_name("r3_worker.py"))
    mine = [set(r["with_routing"]) for r in results]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    for r in results:
        assert r["metrics"]["routing_agreement"] == 1.0
        assert r["refusal"] is not None
    assert "routed_experts: missing" in results[1]["refusal"] and "trainer rank 1" in results[1]["refusal"]
    assert "refused by another trainer rank" in results[0]["refusal"]
    assert results[0]["metrics"]["loss"] == results[1]["metrics"]["loss"]     # all-reduced: one step
