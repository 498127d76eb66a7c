"""--fp8-gemm on CUDA: the embedded engine keeps the published FP8 weights and runs FP8 block-wise
GEMMs for its dense linears, close to the emulated engine, with the same checksums.

Skipped without CUDA. Run on the GPU machine:
    python -m pytest tests/gpu/test_fp8_engine_gpu.py -q

Both engines (in-process ModelRunners, CUDA graphs on, bf16, --quantization fp8) get the same FP8
publish through the tensor update path; one with --fp8-gemm off (dequantized, bf16 matmuls), one
with --fp8-gemm on. The published weights are scaled per 128x128 block by factors 0.5..4, so a
block scale applied to the wrong block (a layout bug) moves outputs by O(1), far past the bounds.

Tolerances (what the FP8 GEMM changes is the activations: quantized to e4m3 per 1x128 group,
3 mantissa bits, a relative rounding error of at most 2^-4 per element, ~3.6% RMS; the weights
multiply the same FP8 values on both paths):
- logits: relative L2 error (centred) <= 0.15: ~4% per GEMM, eight GEMMs in two layers partly
  in series, and the residual stream and lm_head are not quantized; a scale-layout bug or a
  transposed weight gives ~1.
- log-probs of the emulated engine's tokens, teacher forced: mean |diff| <= 0.15 x the emulated
  logits' std (a log-prob moves by the token's logit error minus its softmax average, each ~4%
  of that std).
- greedy tokens: argmax agreement >= 0.4 of teacher-forced positions, and the first greedy
  token of >= 4 of 8 prompts. A random model's top-2 logits are close (the gap between the two
  largest of 512 Gaussian logits averages ~0.28 std, so a relative logit error e flips ~4e of
  the argmaxes: ~20% at the expected 5%, 60% at the 15% bound); a broken GEMM agrees on ~1/512.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.tiny import build_tiny_model  # noqa: E402

# A qwen2 whose every dim is a multiple of 128 (head_dim 64: q 256, k and v 128; gate, up 512).
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2)


def make_runner(fp8_gemm: str):
    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    path = build_tiny_model(arch="qwen2", **ALIGNED)
    cfg = RunnerConfig(device="cuda", dtype="bfloat16", max_running_requests=32,
                       max_total_tokens=8192, context_length=512, cuda_graph_precapture_kv=0,
                       quantization="fp8", fp8_gemm=fp8_gemm)
    return path, ModelRunner(str(path), cfg)


def fp8_publish(path) -> list[tuple[str, torch.Tensor]]:
    """A quant.rollout = "fp8" publish: the checkpoint perturbed and scaled per 128x128 block;
    every weight the default keep list quantizes as FP8 + weight_scale_inv, the rest bf16."""
    from safetensors.torch import load_file
    from miles.quant.formats import quantize
    from miles.quant.keep import KeepList
    g = torch.Generator().manual_seed(1)
    keep, out = KeepList(), []
    factors = torch.tensor([0.5, 1.0, 2.0, 4.0])
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            t = t + torch.randn(t.shape, generator=g) * 0.02
            if keep.quantizes(name, t):
                n, k = t.shape
                rows = factors[torch.arange(n) // 128 % 4]
                cols = factors[(torch.arange(k) // 128 + 1) % 4]
                t = (t * rows[:, None] * cols[None, :]).to(torch.bfloat16)
                out += quantize(t, "fp8").named(name.removesuffix(".weight"))
            else:
                out.append((name, t.to(torch.bfloat16)))
    return out


def prefill(r, seqs):
    rows = [r.kv.alloc_row() for _ in seqs]
    slots = [r.kv.alloc(len(s)) for s in seqs]
    logits, _ = r.prefill(seqs, rows, slots, [0] * len(seqs), capture_routing=False)
    return rows, logits


def seqs_of(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    from miles.engines.embedded_engine import quantized, weights as W
    path, emu = make_runner("off")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    qlog = logging.getLogger(quantized.__name__)
    qlog.addHandler(handler)
    old = qlog.level
    qlog.setLevel(logging.INFO)
    try:
        _, fast = make_runner("on")
    finally:
        qlog.removeHandler(handler)
        qlog.setLevel(old)
    update = fp8_publish(path)
    for r in (emu, fast):
        W.apply_named_tensors(r.model.weights, update)
    return emu, fast, [rec.getMessage() for rec in records]


def test_fp8_gemm_is_in_use_and_logged(engines):
    from miles.engines.embedded_engine.quantized import FP8_LINEARS, FP8Linear
    emu, fast, messages = engines
    assert any(m.startswith("FP8 GEMM in use") for m in messages), messages
    for L in fast.model.weights.layers:
        assert all(isinstance(L[k], FP8Linear) for k in FP8_LINEARS)
    for L in emu.model.weights.layers:
        assert all(isinstance(L[k], torch.Tensor) for k in FP8_LINEARS)
    assert fast.use_graphs
    # the dense linears in 1 byte (+ block scales) instead of 2
    assert fast.model.weights.nbytes() < emu.model.weights.nbytes()


def test_checksums_are_the_emulated_engines(engines):
    """The bit-exact contract: /weights_checksum of the FP8 storage is dequantize(FP8 + scales),
    what the emulated engine holds."""
    from miles.engines.embedded_engine import weights as W
    emu, fast, _ = engines
    assert W.checksums(fast.model.weights) == W.checksums(emu.model.weights)


def test_logits_and_logprobs_close_to_the_emulated_engine(engines):
    emu, fast, _ = engines
    seqs = seqs_of(8, 48, emu.shape.vocab_size, seed=2)
    _, z_emu = prefill(emu, seqs)
    _, z_fast = prefill(fast, seqs)
    z_emu, z_fast = torch.cat(z_emu).float(), torch.cat(z_fast).float()
    assert not torch.equal(z_emu, z_fast)  # the FP8 GEMM ran (activations quantized)
    centred = z_emu - z_emu.mean(-1, keepdim=True)
    rel = ((z_fast - z_emu).norm() / centred.norm()).item()
    assert rel <= 0.15, rel
    lp_emu, lp_fast = z_emu.log_softmax(-1), z_fast.log_softmax(-1)
    tok = z_emu.argmax(-1, keepdim=True)
    dlp = (lp_emu.gather(1, tok) - lp_fast.gather(1, tok)).abs().mean().item()
    assert dlp <= 0.15 * z_emu.std().item(), (dlp, z_emu.std().item())
    agree = (z_fast.argmax(-1) == z_emu.argmax(-1)).float().mean().item()
    assert agree >= 0.4, agree
    print(f"fp8 gemm vs emulated: logits rel {rel:.4f}, mean |dlogp| {dlp:.4f}, argmax agree {agree:.3f}")


def test_greedy_decode_with_graphs_close_to_emulated_and_graph_equals_eager(engines):
    emu, fast, _ = engines
    seqs = seqs_of(8, 20, emu.shape.vocab_size, seed=3)
    out = {}
    for name, r in (("emu", emu), ("fast", fast)):
        rows, logits = prefill(r, seqs)
        ids = [int(lg[-1].argmax()) for lg in logits]
        pos = [len(s) for s in seqs]
        tokens = [ids]
        for step in range(12):
            slots = r.kv.alloc(len(seqs))
            graph, _ = r.decode(ids, pos, rows, slots, False)
            if name == "fast":  # the FP8 GEMM under CUDA-graph capture == eager, to rounding
                eager, _ = r.decode(ids, pos, rows, slots, False, force_eager=True)
                spread = eager.std().item()
                assert (eager - graph).abs().max().item() <= 0.02 * spread + 0.1, step
            ids = graph.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
            tokens.append(ids)
        out[name] = torch.tensor(tokens).T  # [prompt, step]
    first = (out["emu"][:, 0] == out["fast"][:, 0]).sum().item()
    assert first >= 4, (out["emu"], out["fast"])
    print("greedy tokens, emulated:", out["emu"].tolist(), "fp8 gemm:", out["fast"].tolist())
