"""Megatron model + weight bridge on one CUDA device (TP=1, nccl, megatron-core as shipped: no CPU
shims): logits equal to transformers' for qwen3, qwen2 and qwen3_moe (alltoall MoE dispatcher),
a packed row of 3 samples through the varlen kernel equal to each sample alone, and the
HF -> Megatron -> HF round trip bit-exact in fp32 and equal to the checkpoint cast to bf16.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_megatron_bridge_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.backends.base import RankInfo  # noqa: E402
from miles.backends.config import TrainConfig  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

LENS = (37, 64, 23)


@pytest.fixture(scope="module")
def parallel():
    from miles.backends.megatron_model import destroy_parallel, init_parallel
    init_parallel(TrainConfig(backend="megatron", param_dtype="float32"), RankInfo())
    yield
    destroy_parallel()


def _model(path, dtype: str):
    from miles.backends.megatron_model import build_gpt_model
    from miles.backends.megatron_weights import load_hf_into
    model = build_gpt_model(path, TrainConfig(backend="megatron", param_dtype=dtype))
    # every parameter, not just the first: a module built on torch's default device (the CPU)
    # next to megatron's CUDA ones only fails later, inside forward
    assert [n for n, p in model.named_parameters() if not p.is_cuda] == []
    load_hf_into(model, path)
    return model.eval()


def _logits(model, ids, lens=None):
    from miles.backends.megatron_model import make_packed_seq_params
    params = make_packed_seq_params(lens, device="cuda") if lens else None
    with torch.no_grad():
        out = model(ids[None], torch.arange(ids.numel(), device="cuda")[None], None,
                    packed_seq_params=params)
    return out[0, :, :model.miles_vocab_size].float()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_logits_and_packing_match_transformers(arch, parallel):
    from transformers import AutoModelForCausalLM

    from miles.backends.megatron_model import transformer_config_from_hf
    torch.backends.cuda.matmul.allow_tf32 = False
    path = build_tiny_model(arch=arch)
    if arch == "qwen3_moe":
        cfg = transformer_config_from_hf(path, TrainConfig(backend="megatron"))
        assert cfg.moe_token_dispatcher_type == "alltoall"
    model = _model(path, "float32")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.miles_vocab_size, (n,), generator=gen).cuda() for n in LENS]
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0].float() for s in samples])
    packed = _logits(model, torch.cat(samples), list(LENS))
    alone = torch.cat([_logits(model, s) for s in samples])
    print(arch, "packed-hf", float((packed - ref).abs().max()), "alone-hf",
          float((alone - ref).abs().max()))
    assert (packed - ref).abs().max() < 1e-3
    assert (alone - ref).abs().max() < 1e-3
    bf16 = _model(path, "bfloat16")
    diff = (_logits(bf16, torch.cat(samples), list(LENS)) - ref).abs().max()
    print(arch, "bf16 packed-hf", float(diff))
    assert diff < 0.1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_round_trip_on_cuda(arch, parallel):
    from safetensors.torch import load_file

    from miles.backends.megatron_weights import iter_hf_weight_buckets, iter_hf_weights
    path = build_tiny_model(arch=arch)
    expected = load_file(str(path / "model.safetensors"))
    model = _model(path, "float32")
    got = dict(iter_hf_weights(model))
    assert set(got) == set(expected)
    assert all(torch.equal(got[n].cpu(), expected[n]) for n in expected)
    bf16 = dict(t for b in iter_hf_weight_buckets(_model(path, "bfloat16"), 1 << 20) for t in b)
    assert all(torch.equal(bf16[n].cpu(), expected[n].to(torch.bfloat16)) for n in expected)
