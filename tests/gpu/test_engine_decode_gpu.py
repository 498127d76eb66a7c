"""Embedded engine on CUDA: decode with the sampling inside the CUDA graph gives the tokens of the
eager engine (the lm_head and `sample` after an eager forward), greedy and seeded, driven through
the real scheduler.

Skipped without CUDA. Run on the GPU machine:
    python -m pytest tests/gpu/test_engine_decode_gpu.py -q
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.tiny import build_tiny_model  # noqa: E402

# Qwen2-0.5B's widths, 4 layers (the bench's model, shorter): random weights, 152k vocabulary.
MODEL = dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
             max_position_embeddings=1024, tie_word_embeddings=True)
PROMPTS, NEW = 24, 40


def generate(graphs: bool, temperature: float,
             kernels: str = "auto") -> tuple[list[list[int]], list[list[float]]]:
    from miles.engines.embedded import build_parser, build_server
    from miles.engines.embedded_engine.protocol import SamplingParams
    from miles.engines.embedded_engine.request import Request
    path = build_tiny_model(**MODEL)
    ns = build_parser().parse_args(["--model-path", str(path), "--skip-tokenizer-init", "--device", "cuda",
                                    "--dtype", "bfloat16", "--max-running-requests", "32",
                                    "--max-total-tokens", "8192", "--context-length", "256",
                                    "--cuda-graph-precapture-kv", "0", "--random-seed", "0",
                                    "--decode-kernels", kernels,
                                    *([] if graphs else ["--disable-cuda-graph"])])
    server = build_server(ns)
    g = torch.Generator().manual_seed(3)
    reqs = [Request(rid=f"r{i}", input_ids=torch.randint(0, 151936, (8 + 5 * i,), generator=g).tolist(),
                    params=SamplingParams(max_new_tokens=NEW, temperature=temperature, ignore_eos=True),
                    seed=1000 + i, max_new_tokens=NEW) for i in range(PROMPTS)]

    async def main():
        server.scheduler.start()
        try:
            for r in reqs:
                server.scheduler.submit(r)
            await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in reqs)), 120)
        finally:
            await server.scheduler.close()
    asyncio.run(main())
    assert server.runner.use_graphs == graphs
    assert server.runner.fused_decode == (kernels != "torch")
    if graphs:
        assert server.runner.graphs.captured > 0
    return [r.output_ids for r in reqs], [r.output_logprobs for r in reqs]


def assert_same_until_rounding(eager_ids, graph_ids, eager_lps, graph_lps, temperature):
    # bf16 forwards in two shapes (the graph's padded batch and longest kv bucket, the eager
    # per-bucket attention) round differently: a sequence may part only where its two candidates
    # are within rounding (greedy: the two tokens' logprobs, i.e. the top-2 logits, agree to bf16
    # resolution there), and from there on its tokens differ. Before that, logprobs agree.
    parted = []
    for a, b, la, lb in zip(eager_ids, graph_ids, eager_lps, graph_lps):
        n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for x, y in zip(la[:n], lb[:n]):
            assert abs(x - y) < 0.05, (x, y)
        if n < len(a):
            parted.append((n, la[n], lb[n]))
            if temperature == 0.0:
                assert abs(la[n] - lb[n]) < 0.02, (n, la[n], lb[n])
    assert len(parted) <= 3, parted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_sampling_gives_the_eager_tokens(temperature):
    eager_ids, eager_lps = generate(False, temperature)
    graph_ids, graph_lps = generate(True, temperature)
    assert_same_until_rounding(eager_ids, graph_ids, eager_lps, graph_lps, temperature)


def test_fused_kernels_give_the_torch_paths_tokens():
    """The fused decode (kernels.py, graphs on) against the op-by-op torch decode, greedy: the same
    tokens until two candidates are within bf16 rounding (the engine's token contract)."""
    torch_ids, torch_lps = generate(True, 0.0, kernels="torch")
    fused_ids, fused_lps = generate(True, 0.0, kernels="triton")
    assert_same_until_rounding(torch_ids, fused_ids, torch_lps, fused_lps, 0.0)


def test_fused_kernels_round_like_torch_in_bf16():
    """On the card (Triton's interpreter rounds bf16 differently): the residual sum exact, the norm
    and SiLU*up within one bf16 step and almost always equal."""
    from miles.engines.embedded_engine import kernels
    torch.manual_seed(1)
    x = torch.randn(5, 96, dtype=torch.bfloat16, device="cuda")
    delta = torch.randn(5, 96, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(96, dtype=torch.bfloat16, device="cuda")
    expect_x = x + delta
    expect_h = w * torch.nn.functional.rms_norm(expect_x.float(), (96,), eps=1e-6).to(torch.bfloat16)
    got_x = x.clone()
    h = kernels.rms_norm(got_x, delta, w, 1e-6)
    assert torch.equal(got_x, expect_x)
    # fp32 reductions may differ in order: at most one bf16 step apart, and almost all equal
    diff = (h.float() - expect_h.float()).abs() / expect_h.float().abs().clamp_min(1e-3)
    assert diff.max() <= 2 ** -7 and (h != expect_h).float().mean() < 0.02
    gu = torch.randn(3, 2 * 40, dtype=torch.bfloat16, device="cuda")
    gate, up = gu.chunk(2, dim=-1)
    expect = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gu)
    assert (got.float() - expect.float()).abs().max() <= expect.float().abs().max() * 2 ** -7
    assert (got != expect).float().mean() < 0.05
