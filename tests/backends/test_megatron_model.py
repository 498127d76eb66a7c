"""The megatron-core GPTModel built from an HF config: config mapping, refusals, the packed core
attention, and logits equal to transformers' (TP=1 and TP=2, dense and MoE with EP=2).

Logits are compared in fp32 with tolerance 1e-4 (absolute; the tiny models' logits are O(1)):
the only differences are summation orders. Multi-rank cases run real gloo processes
(megatron_bridge_worker.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_bridge_worker import SAMPLE_LENS, run_ranks  # noqa: E402

from miles.backends.config import MegatronConfig, TrainConfig  # noqa: E402
from miles.backends.megatron_model import (  # noqa: E402
    load_hf_config, make_packed_seq_params, padded_vocab_size, transformer_config_from_hf)
from miles.tiny import build_tiny_model  # noqa: E402

TOL = 1e-4


def _cfg(**megatron) -> TrainConfig:
    return TrainConfig(backend="megatron", param_dtype="float32", megatron=MegatronConfig(**megatron))


def test_config_mapping_per_architecture():
    q3 = transformer_config_from_hf(build_tiny_model(arch="qwen3"), _cfg(tp=2))
    assert q3.qk_layernorm and not q3.add_qkv_bias
    assert (q3.num_attention_heads, q3.num_query_groups, q3.kv_channels) == (4, 2, 32)
    assert q3.tensor_model_parallel_size == 2 and q3.sequence_parallel  # None: on with tp > 1
    assert q3.hidden_dropout == 0 and q3.attention_dropout == 0
    q2 = transformer_config_from_hf(build_tiny_model(arch="qwen2"), _cfg())
    assert q2.add_qkv_bias and not q2.qk_layernorm and not q2.sequence_parallel
    moe_hf = load_hf_config(build_tiny_model(arch="qwen3_moe"))
    moe = transformer_config_from_hf(moe_hf, _cfg(ep=2, recompute="selective"))
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 2, 64)
    assert moe.moe_router_pre_softmax is False          # norm_topk_prob=True: top-k then softmax
    assert moe.moe_router_load_balancing_type == "none" and moe.moe_aux_loss_coeff == 0
    assert moe.moe_router_dtype == "fp32"
    # alltoall creates a CUDA stream; allgather is the dispatcher that runs on gloo
    assert moe.moe_token_dispatcher_type == ("alltoall" if torch.cuda.is_available() else "allgather")
    assert moe.expert_model_parallel_size == 2 and moe.recompute_granularity == "selective"
    assert moe.params_dtype == torch.float32 and not moe.bf16
    bf16 = transformer_config_from_hf(moe_hf, TrainConfig(backend="megatron",
                                                          megatron=MegatronConfig(recompute="full")))
    assert bf16.bf16 and bf16.params_dtype == torch.bfloat16
    assert (bf16.recompute_granularity, bf16.recompute_method) == ("full", "uniform")
    assert padded_vocab_size(512, 2) == 512 and padded_vocab_size(513, 1) == 640


def test_refusals_name_the_field():
    hf = load_hf_config(build_tiny_model(arch="qwen3"))
    hf.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        transformer_config_from_hf(hf, _cfg())
    hf = load_hf_config(build_tiny_model(arch="qwen3"))
    # context parallelism is Miles' own attention in the local spec (megatron_cp.py): not with TE
    with pytest.raises(ValueError, match="cp=2 with use_te=true.*set use_te = false"):
        transformer_config_from_hf(hf, _cfg(cp=2, use_te=True))
    assert transformer_config_from_hf(hf, _cfg(cp=2, use_te=False)).context_parallel_size == 2
    hf.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    from miles.backends.megatron_model import _rope_scaling
    with pytest.raises(ValueError, match="rope scaling"):
        _rope_scaling(hf)
    with pytest.raises(ValueError, match="positive"):
        make_packed_seq_params([3, 0])


def test_norms_are_built_where_megatron_builds_its_layers(monkeypatch):
    """Our RMSNorm is not one of megatron's layers, so it must pick their device itself: on a CUDA
    host without use_cpu_initialization that is the current GPU (torch's default, the CPU, left the
    norms behind while every linear was on cuda:0)."""
    from types import SimpleNamespace

    from miles.backends import megatron_model

    cfg = SimpleNamespace(use_cpu_initialization=False, params_dtype=torch.float32, sequence_parallel=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert megatron_model.param_device(cfg) == torch.device("cuda", 3)
    assert megatron_model.param_device(SimpleNamespace(use_cpu_initialization=True)) == torch.device("cpu")
    monkeypatch.setattr(megatron_model, "param_device", lambda config: torch.device("meta"))
    norm = megatron_model._RMSNorm(cfg, 16, eps=1e-6)
    assert norm.weight.device.type == "meta" and norm.weight.sequence_parallel


def test_packed_core_attention_is_per_sample_causal():
    from miles.backends.megatron_model import packed_core_attention_class
    config = transformer_config_from_hf(build_tiny_model(arch="qwen3"), _cfg())
    attn = packed_core_attention_class()(config, layer_number=1)
    gen = torch.Generator().manual_seed(0)
    lens = [5, 8, 3]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 32, generator=gen) for h in (4, 2, 2))
    packed = attn(q, k, v, None, packed_seq_params=make_packed_seq_params(lens))
    assert packed.shape == (t, 4 * 32)
    start, outs = 0, []
    for n in lens:   # each sample alone, sbhd layout [s, b=1, h, d]
        sl = slice(start, start + n)
        outs.append(attn(q[sl, None], k[sl, None], v[sl, None], None)[:, 0])
        start += n
    assert torch.allclose(packed, torch.cat(outs), atol=1e-6)
    # and it is not the unpacked (cross-sample) attention
    whole = attn(q[:, None], k[:, None], v[:, None], None)[:, 0]
    assert (whole[5:] - packed[5:]).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe", "llama"])
def test_logits_equal_transformers_tp1(arch, tmp_path):
    (r,) = run_ranks(f"logits:{arch}:1,1,1", tmp_path, world_size=1, timeout_s=240)
    assert r["params_loaded"] > 0
    assert r["packed_vs_hf"] < TOL, r          # a packed row of 3 samples vs transformers per sample
    assert r["alone_vs_hf"] < TOL, r
    assert r["packed_vs_alone"] < 1e-5, r      # packing changes nothing but summation order
    assert r["logit_scale"] > 100 * TOL        # the comparison is not between near-zero logits
    assert r["inv_freq_vs_hf"] < 1e-9, r       # the same rotary table (llama: llama3 scaling)
    assert len(SAMPLE_LENS) == 3


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("qwen3", "2,1,1"), ("qwen3_moe", "1,1,2")])
def test_logits_equal_transformers_two_ranks(arch, layout, tmp_path):
    # TP=2 with sequence parallel (QKV split by query group, gate/up halves, vocab-parallel head);
    # EP=2 (each rank holds 4 of the 8 experts, tokens exchanged by the allgather dispatcher).
    ranks = run_ranks(f"logits:{arch}:{layout}", tmp_path, world_size=2, timeout_s=300)
    for r in ranks:
        assert r["packed_vs_hf"] < TOL, r
        split = r["tp_split"]
        for part in ("embedding.word_embeddings.weight", "layers.0.self_attention.linear_qkv.",
                     "layers.0.self_attention.linear_proj.", "layers.0.mlp."):
            assert any(part in n for n in split), (part, split)
        assert not any("layernorm" in n or "router" in n for n in split), split


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")
def test_cpu_shims_are_idempotent_and_reversible():
    from miles.backends import megatron_cpu
    megatron_cpu._restore()
    with pytest.raises((AssertionError, RuntimeError)):   # what megatron hits on a CPU-only host
        torch.cuda.current_device()
    try:
        assert megatron_cpu.apply_cpu_shims()
        patched = len(megatron_cpu._originals)
        assert megatron_cpu.apply_cpu_shims() and len(megatron_cpu._originals) == patched
        assert torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.tensor_parallel import random as tp_random
        with tp_random.get_cuda_rng_tracker().fork():   # megatron's own no-op tracker
            pass
    finally:
        megatron_cpu._restore()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@pytest.mark.slow
def test_activation_recompute_gives_the_same_gradients(tmp_path):
    # selective (core attention) and full (every layer) recompute run megatron's CheckpointFunction,
    # which on CPU only works with the shim's RNG-state stand-ins; recomputing changes nothing.
    (r,) = run_ranks("recompute:qwen3:1,1,1", tmp_path, world_size=1, timeout_s=240)
    assert r["none_grads"] == r["selective_grads"] == r["full_grads"] > 0
    assert r["grad_scale"] > 1e-3
    assert r["selective_max_diff"] < 1e-6 and r["full_max_diff"] < 1e-6, r


@pytest.mark.parametrize("freqs_len", ["longest", "total"])
def test_packed_rope_equals_megatrons_and_never_syncs(freqs_len):
    """Our thd rotary (no host sync) gives megatron's own thd result bit for bit, in both of
    megatron's cases: freqs for the longest sample (positions restart per sample) and freqs for
    every packed position; and it never reads cu_seqlens to the host (a tensor that refuses
    .tolist() / .item() passes through it)."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from miles.backends.megatron_model import _thd_rope

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    lens = [5, 17, 1, 9]
    total, dim = sum(lens), 16
    t = torch.randn(total, 3, dim, dtype=torch.float32)
    n = total if freqs_len == "total" else max(lens)
    freqs = torch.randn(n, 1, 1, dim)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False,
                             multi_latent_attention=False)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=OneRank())
    ours = _thd_rope(rope_utils.apply_rotary_pos_emb)

    class NoSync(torch.Tensor):
        def tolist(self):
            raise AssertionError("cu_seqlens read on the host")

        def item(self):
            raise AssertionError("cu_seqlens read on the host")

    got = ours(t, freqs, config, cu_seqlens=cu.as_subclass(NoSync), cp_group=OneRank())
    assert torch.equal(got.as_subclass(torch.Tensor), want)
    sbhd = t[:min(lens)].unsqueeze(1)  # no cu_seqlens (sbhd rows): megatron's own path
    plain = ours(sbhd, freqs[:len(sbhd)], config, cu_seqlens=None, cp_group=OneRank())
    assert torch.equal(plain, rope_utils.apply_rotary_pos_emb(sbhd, freqs[:len(sbhd)], config,
                                                              cp_group=OneRank()))
