"""--fp8-gemm storage on CPU: the FP8 rows + block scales the engine keeps dequantize to exactly what
the emulated engine holds, the expected linears are chosen, and every update path lands there.

The FP8 GEMM itself needs an H200 (tests/gpu/test_fp8_engine_gpu.py). Here the GEMM is
fp8_gemm.emulated_linear (dequantize, then F.linear): a stand-in that checks layout and
bookkeeping only, which is why the forward must then equal the emulated engine bit for bit.
"""

from __future__ import annotations

import base64

import pytest
import torch

from miles.engines.embedded_engine import quantized, weights as W
from miles.engines.embedded_engine.fp8_gemm import emulated_linear
from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
from miles.quant.formats import quantize
from miles.quant.keep import KeepList
from miles.tiny import build_tiny_model

# Every dim a multiple of 128 (head_dim 64: q 256, k and v 128 each; gate and up 512 each).
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2)


def runner(path, monkeypatch, fp8: bool) -> ModelRunner:
    if fp8:  # the CPU stand-in for fp8_block_linear (the real one runs on CUDA only)
        monkeypatch.setattr(quantized, "fp8_gemm_for", lambda *a: emulated_linear)
    else:
        monkeypatch.setattr(quantized, "fp8_gemm_for", lambda *a: None)
    cfg = RunnerConfig(device="cpu", dtype="bfloat16", max_running_requests=8, max_total_tokens=512,
                       context_length=128, quantization="fp8")
    return ModelRunner(str(path), cfg)


def fp8_update(path, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """What a quant.rollout = "fp8" publish sends: the checkpoint perturbed, every 2-D weight the
    default keep list does not keep as FP8 + weight_scale_inv, the rest in bf16."""
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(seed)
    keep, out = KeepList(), []
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            t = (t + torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
            if keep.quantizes(name, t):
                out += quantize(t, "fp8").named(name.removesuffix(".weight"))
            else:
                out.append((name, t))
    return out


def prefill_logits(r: ModelRunner, seqs):
    rows = [r.kv.alloc_row() for _ in seqs]
    slots = [r.kv.alloc(len(s)) for s in seqs]
    logits, _ = r.prefill(seqs, rows, slots, [0] * len(seqs), capture_routing=False)
    for row, s in zip(rows, slots):
        r.kv.free_row(row)
        r.kv.free(s)
    return torch.cat(logits)


def test_aligned_model_holds_every_dense_linear_in_fp8(monkeypatch):
    path = build_tiny_model(arch="qwen2", **ALIGNED)
    r = runner(path, monkeypatch, fp8=True)
    w = r.model.weights
    for i, L in enumerate(w.layers):
        for key in quantized.FP8_LINEARS:
            assert isinstance(L[key], quantized.FP8Linear), (i, key)
    expected = {f"model.layers.{i}.{m}.weight" for i in range(2)
                for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(w.fp8) == expected
    assert w.quant.fp8_held and set(w.quant.fp8_held) == expected
    # fused along N: q | k | v rows and their scale rows, in that order
    q, k, v = (w.fp8[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert (q.start, k.start, v.start) == (0, 256, 384) and q.linear is k.linear is v.linear
    assert q.linear.weight.dtype == torch.float8_e4m3fn and q.linear.scale_inv.shape == (4, 2)
    # embeddings, lm_head (tied), norms, biases stay in the engine dtype
    assert "model.embed_tokens.weight" not in w.fp8 and w.embed.dtype == torch.bfloat16
    assert w.layers[0]["qkv_b"].dtype == torch.bfloat16
    # half the bytes: one byte per weight plus 4 per 128x128 block
    dense = sum(r_.weight.numel() for r_ in w.fp8.values())
    assert w.nbytes() < sum(t.numel() * 2 for t in w.names.values()) - dense + 0.01 * dense


def test_unaligned_linears_stay_emulated(monkeypatch):
    # the default tiny qwen2: head_dim 32, so k and v have 64 rows; o, gate|up, down are aligned
    path = build_tiny_model(arch="qwen2")
    r = runner(path, monkeypatch, fp8=True)
    L = r.model.weights.layers[0]
    assert isinstance(L["qkv_w"], torch.Tensor) and L["qkv_w"].dtype == torch.bfloat16
    for key in ("o_w", "gate_up_w", "down_w"):
        assert isinstance(L[key], quantized.FP8Linear), key
    assert "model.layers.0.self_attn.q_proj.weight" not in r.model.weights.fp8


def test_fp8_storage_dequantizes_to_the_emulated_weights_on_every_update_path(monkeypatch, tmp_path):
    # qwen3: no q/k/v bias, so the stand-in's linears are the emulated engine's op for op (an
    # FP8Linear adds a bias after the GEMM, one more bf16 rounding than F.linear's fused add)
    from safetensors.torch import save, save_file
    path = build_tiny_model(arch="qwen3", head_dim=64, **ALIGNED)
    emu, fp8 = runner(path, monkeypatch, fp8=False), runner(path, monkeypatch, fp8=True)
    names = list(emu.model.weights.names)
    seqs = [[3, 17, 42, 9, 100], [5, 6, 7]]

    def same():
        a = W.checksums(emu.model.weights, names)
        assert a == W.checksums(fp8.model.weights, names)
        for n in fp8.model.weights.fp8:
            assert torch.equal(emu.model.weights.lookup(n), fp8.model.weights.lookup(n)), n
        # the stand-in GEMM multiplies the same bf16 values: logits equal bit for bit
        assert torch.equal(prefill_logits(emu, seqs), prefill_logits(fp8, seqs))

    # the start-up checkpoint (bf16) was quantized on arrival: fake_quantize of the bf16 weights
    from safetensors.torch import load_file
    ckpt = load_file(str(next(path.glob("*.safetensors"))))
    name = "model.layers.1.mlp.down_proj.weight"
    want = quantize(ckpt[name].to(torch.bfloat16), "fp8")
    assert torch.equal(fp8.model.weights.fp8[name].weight.view(torch.uint8),
                       want.parts[".weight"].view(torch.uint8))

    # tensor payload (/update_weights_from_tensor: base64 safetensors), float8 parts as raw bytes
    upd = fp8_update(path, seed=1)
    raw = {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in upd}
    payload = base64.b64encode(save(raw)).decode()
    for r in (emu, fp8):
        W.apply_named_tensors(r.model.weights, list(W.decode_tensor_payload(payload, "t").items()))
    same()
    parts = dict(upd)
    rows = fp8.model.weights.fp8["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(rows.weight.view(torch.uint8),
                       parts["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8))
    assert torch.equal(rows.scale_inv, parts["model.layers.0.self_attn.k_proj.weight_scale_inv"])

    # disk (/update_weights_from_disk)
    disk = tmp_path / "v2"
    disk.mkdir()
    (disk / "config.json").write_text((path / "config.json").read_text())
    save_file(dict(fp8_update(path, seed=2)), str(disk / "model.safetensors"))
    for r in (emu, fp8):
        W.load_from_disk(r.model.weights, str(disk))
    same()

    # distributed: the flat bucket's copy-out and the scratch tensors go through copy_in, like the
    # tensor path; an FP8-held weight has no storage to receive into directly, so it is owned
    assert all(fp8.model.weights.quant.owns(n) for n in fp8.model.weights.fp8)
    assert not fp8.model.weights.quant.owns("model.layers.0.self_attn.q_proj.bias")
    for r in (emu, fp8):
        W.apply_named_tensors(r.model.weights, fp8_update(path, seed=3))
    same()


def test_a_bad_part_shape_is_refused_before_anything_is_copied(monkeypatch):
    path = build_tiny_model(arch="qwen2", **ALIGNED)
    r = runner(path, monkeypatch, fp8=True)
    before = W.checksums(r.model.weights)
    bad = [("model.layers.0.mlp.up_proj.weight", torch.zeros(512, 256, dtype=torch.float8_e4m3fn)),
           ("model.layers.0.mlp.up_proj.weight_scale_inv", torch.ones(4, 3))]
    with pytest.raises(ValueError, match="weight_scale_inv"):
        W.apply_named_tensors(r.model.weights, bad)
    assert W.checksums(r.model.weights) == before


def test_fp8_gemm_choice():
    cpu = torch.device("cpu")
    assert quantized.fp8_gemm_for("off", "fp8", cpu, torch.bfloat16) is None
    assert quantized.fp8_gemm_for("auto", "fp8", cpu, torch.bfloat16) is None  # CPU: emulated
    assert quantized.fp8_gemm_for("auto", "int4", cpu, torch.bfloat16) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        quantized.fp8_gemm_for("on", "fp8", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="needs --quantization fp8"):
        quantized.fp8_gemm_for("on", None, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="not one of"):
        quantized.fp8_gemm_for("yes", "fp8", cpu, torch.bfloat16)
