"""The HF <-> Megatron weight bridge: registry resolution, atomic-group buckets, and the HF ->
Megatron -> HF round trip, bit-exact (torch.equal) for TP=2, PP=2 and EP=2 (qwen3_moe) on real
gloo ranks, including `save_hf`'s directory. The round trips run in megatron_bridge_worker.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_bridge_worker import run_ranks  # noqa: E402

from miles.backends import megatron_weights as mw  # noqa: E402


def test_registry_resolves_megatron_names_to_hf_names():
    m, nums = mw.resolve("decoder.layers.3.self_attention.linear_qkv.weight")
    assert m.kind == "qkv" and nums == (3,)
    assert mw.hf_names(m, nums) == [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    m, nums = mw.resolve("decoder.layers.1.mlp.experts.local_experts.6.linear_fc1.weight")
    assert m.kind == "gated" and nums == (1, 6)
    assert mw.hf_names(m, nums) == ["model.layers.1.mlp.experts.6.gate_proj.weight",
                                    "model.layers.1.mlp.experts.6.up_proj.weight"]
    assert mw.resolve("decoder.layers.0.self_attention.linear_proj.weight")[0].tp_dim() == 1
    assert mw.resolve("output_layer.weight")[0].kind == "vocab"
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        mw.resolve("decoder.layers.0.mystery.weight")


def _t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32)


def test_buckets_keep_atomic_groups_whole_and_respect_the_budget():
    p = "model.layers.0."
    stream = [("model.embed_tokens.weight", _t(400)),
              (p + "self_attn.q_proj.weight", _t(200)), (p + "self_attn.k_proj.weight", _t(100)),
              (p + "self_attn.v_proj.weight", _t(100)), (p + "self_attn.o_proj.weight", _t(200)),
              (p + "mlp.experts.0.gate_proj.weight", _t(120)),
              (p + "mlp.experts.0.up_proj.weight", _t(120)),
              (p + "mlp.experts.0.down_proj.weight", _t(120)),
              (p + "mlp.experts.1.gate_proj.weight", _t(120)),
              (p + "mlp.experts.1.up_proj.weight", _t(120)),
              (p + "mlp.experts.1.down_proj.weight", _t(120)),
              ("model.norm.weight", _t(4))]
    buckets = list(mw.bucket_atomic(iter(stream), 500))
    names = [[n for n, _ in b] for b in buckets]
    assert [n for b in names for n in b] == [n for n, _ in stream]   # nothing lost or reordered
    for b in names:
        groups = {mw.atomic_group(n) for n in b}
        for g in groups:  # every member of a group in this bucket is here
            members = [n for n, _ in stream if mw.atomic_group(n) == g]
            assert members == [n for n in b if mw.atomic_group(n) == g]
    sizes = [sum(t.numel() * 4 for _, t in b) for b in buckets]
    assert all(s <= 500 for s in sizes), sizes
    assert names[1] == [p + f"self_attn.{x}_proj.weight" for x in "qkv"]  # 400 q/k/v, not split
    # fused_experts: a layer's experts (720 bytes) stay together although that passes the budget.
    fused = list(mw.bucket_atomic(iter(stream), 500, lambda n: mw.atomic_group(n, fused_experts=True)))
    assert [n for n, _ in fused[-2]] == [n for n, _ in stream[5:11]]
    # A group that reappears later would have to be split: refused.
    bad = [(p + "mlp.gate_proj.weight", _t(4)), ("model.norm.weight", _t(4)),
           (p + "mlp.up_proj.weight", _t(4))]
    with pytest.raises(ValueError, match="not contiguous"):
        list(mw.bucket_atomic(iter(bad), 100))
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(mw.bucket_atomic(iter(stream), 0))


def _check_buckets(r: dict) -> None:
    budget = r["bucket_budget"]
    flat = [n for b in r["buckets"] for n, _ in b]
    assert flat == r["names"]    # buckets are the export stream, in order
    where = {}
    for i, b in enumerate(r["buckets"]):
        size = sum(nbytes for _, nbytes in b)
        groups = {mw.atomic_group(n) for n, _ in b}
        assert size <= budget or len(groups) == 1, (i, size, groups)
        for g in groups:
            assert where.setdefault(g, i) == i, f"group {g} split over buckets {where[g]} and {i}"


@pytest.mark.slow
# ep2-qwen3_moe is inside tp2-ep2-qwen3_moe: `extended` (MILES_TEST_EXTENDED=1)
@pytest.mark.parametrize("arch,layout,world", [("qwen2", "2,1,1", 2), ("qwen3", "1,2,1", 2),
                                               pytest.param("qwen3_moe", "1,1,2", 2,
                                                            marks=pytest.mark.extended),
                                               ("qwen3_moe", "2,1,2", 4)],
                         ids=["tp2-qwen2", "pp2-qwen3-tied", "ep2-qwen3_moe", "tp2-ep2-qwen3_moe"])
def test_round_trip_is_bit_exact(arch, layout, world, tmp_path):
    # tp2-ep2: 4 ranks, DP=2; experts split over EP and, inside each, over the expert TP group
    ranks = run_ranks(f"roundtrip:{arch}:{layout}", tmp_path, world_size=world, timeout_s=500)
    for r in ranks:
        assert r["params_loaded"] > 0
        assert r["missing"] == [] and r["extra"] == [] and r["duplicates"] == 0, r
        assert r["not_equal"] == [], r["not_equal"]
        _check_buckets(r)
        assert len(r["buckets"]) > 1
    assert all(r["names"] == ranks[0]["names"] for r in ranks)   # one global order everywhere
    zero = ranks[0]
    assert zero["saved_not_equal"] == [] and zero["saved_has_tokenizer"]
    assert len(zero["saved_files"]) > 1 and zero["saved_files"][0].endswith("-of-%05d.safetensors"
                                                                            % len(zero["saved_files"]))
    if arch == "qwen3_moe":  # each rank holds 4 experts; both export all 8
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in zero["names"]
    if arch == "qwen3":      # tied: the head is exported once, as the embedding
        assert "lm_head.weight" not in zero["names"]
