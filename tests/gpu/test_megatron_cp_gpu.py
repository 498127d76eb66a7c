"""Context parallelism's attention on CUDA (megatron_cp.py): torch's FlashAttention varlen kernel,
when it is in use, must be causal aligned bottom-right for queries shorter than their keys (the
start-up probe says so), and one rank's segments through it must equal the whole row's per-sample
causal attention at that rank's tokens, in value and gradient. The multi-rank CP steps run on gloo
in tests/backends/test_megatron_backend.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cp_segments_through_the_varlen_kernel_equal_the_whole_row():
    from miles.backends import attention
    from miles.backends.megatron_cp import cp_layout

    device = torch.device("cuda")
    if not attention.enable_varlen_kernel(device, torch.bfloat16):
        pytest.fail("torch's varlen_attn is not in use on this CUDA host (see the packed attention log)")
    assert attention.varlen_qk_ready(), "varlen_attn failed the bottom-right causal probe"
    torch.manual_seed(0)
    lens, cp = [700, 37, 1300, 11, 8], 4          # sums to 2056: 8 chunks of 257
    length, hq, hkv, d = sum(lens), 8, 2, 128
    q, k, v = (torch.randn(length, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hkv, hkv))
    bounds = torch.tensor([0] + lens).cumsum(0).tolist()
    whole = attention.segment_attention(*(x.permute(1, 0, 2)[None] for x in (q, k, v)), bounds, None)
    whole = whole[0].permute(1, 0, 2)
    layouts = [cp_layout(lens, cp, r, device) for r in range(cp)]
    k_all = torch.cat([k[lay.local_index] for lay in layouts])
    v_all = torch.cat([v[lay.local_index] for lay in layouts])
    for lay in layouts:
        ks, vs = k_all[lay.kv_index], v_all[lay.kv_index]
        got = attention.varlen_causal_qk(q[lay.local_index], ks, vs, lay.cu_q, lay.cu_k, lay.max_q,
                                         lay.max_k, None)
        want = whole[lay.local_index]
        g = torch.randn_like(got)
        grads_got = torch.autograd.grad(got, (q, k, v), g, retain_graph=True)
        grads_want = torch.autograd.grad(want, (q, k, v), g, retain_graph=True)
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))  # noqa: E731
        assert rel(got, want) < 1e-2, lay.rank
        assert all(rel(a, b) < 2e-2 for a, b in zip(grads_got, grads_want)), lay.rank
