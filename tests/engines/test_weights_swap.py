"""`Weights.swap_in`, the embedded engine's double buffer (disk-delta's apply): a whole weight is
replaced by the staged tensor itself, everywhere the forward and `lookup` read it (a tied
embedding stays tied); a slice of a fused tensor, a weight whose storage other views share (the
experts), a staged tensor of another dtype or a non-contiguous one, and everything when swapping
is not allowed, are copied in. Either way the engine then holds the new values."""

from __future__ import annotations

import torch

from miles.engines.embedded_engine.params import Weights
from miles.engines.embedded_engine.shapes import load_hf_config, shape_from_config
from miles.tiny import build_tiny_model


def _weights(arch: str) -> Weights:
    return Weights(shape_from_config(load_hf_config(build_tiny_model(arch=arch))), torch.device("cpu"),
                   torch.float32)


def _staged(w: Weights, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.randn(w.lookup(n).shape, generator=gen)) for n in names]


def test_whole_weights_are_swapped_and_slices_copied():
    w = _weights("qwen3")  # tied embedding
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.mlp.up_proj.weight"]
    staged = _staged(w, names)
    fused_before = w.layers[0]["qkv_w"]
    swapped = w.swap_in(staged)
    assert swapped == names[:4]
    for name, t in staged:
        assert torch.equal(w.lookup(name), t), name
    new = dict(staged)
    # the staged tensors are the weights now, in every place the forward reads them
    assert w.embed is new["model.embed_tokens.weight"] and w.lm_head is w.embed
    assert w.lookup("lm_head.weight") is w.embed
    assert w.final_norm is new["model.norm.weight"]
    assert w.layers[0]["o_w"] is new["model.layers.0.self_attn.o_proj.weight"]
    assert w.layers[0]["down_w"] is new["model.layers.0.mlp.down_proj.weight"]
    # a slice was copied into its fused tensor, which stays the one the forward reads
    assert w.layers[0]["qkv_w"] is fused_before
    assert w.names["model.layers.0.self_attn.q_proj.weight"].untyped_storage().data_ptr() == \
        fused_before.untyped_storage().data_ptr()


def test_shared_storage_other_dtypes_and_no_swap_are_copied():
    w = _weights("qwen3_moe")
    expert = "model.layers.0.mlp.experts.gate_up_proj"  # fused experts: per-expert views share it
    norm = "model.layers.0.input_layernorm.weight"
    staged = _staged(w, [expert, norm])
    assert w.swap_in(staged, allow_swap=False) == []  # e.g. a CUDA graph holds the addresses
    assert torch.equal(w.lookup(norm), staged[1][1]) and w.lookup(norm) is not staged[1][1]
    staged = _staged(w, [expert])
    staged += [(norm, torch.ones(2 * w.lookup(norm).numel(), dtype=torch.float64)[::2])]  # strided
    staged += [("model.norm.weight", torch.full(w.final_norm.shape, 3.0, dtype=torch.bfloat16))]
    assert w.swap_in(staged) == []
    assert torch.equal(w.lookup(expert), staged[0][1])
    assert torch.equal(w.names["model.layers.0.mlp.experts.1.up_proj.weight"],
                       staged[0][1][1, w.shape.moe_intermediate_size:])
    assert torch.all(w.lookup(norm) == 1.0) and w.lookup(norm).dtype == torch.float32
    assert torch.all(w.final_norm == 3.0) and w.final_norm.dtype == torch.float32
