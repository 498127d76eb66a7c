"""The fused decode kernels (kernels.py, run here in Triton's interpreter) against the torch decode
path: same hidden states, same KV written, at rows of different lengths."""

import numpy as np
import pytest
import torch

from miles.engines.embedded_engine import kernels
from miles.engines.embedded_engine.model import DecodeInputs
from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
from miles.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton does not import")


def _runner(arch: str, dtype: str) -> ModelRunner:
    return ModelRunner(str(build_tiny_model(arch=arch)), RunnerConfig(
        device="cpu", dtype=dtype, max_running_requests=8, max_total_tokens=512, context_length=128))


def _step(runner: ModelRunner, lengths: list[int], seed: int = 0):
    """Rows of `lengths` tokens already in the pool (random K/V), one new token each."""
    torch.manual_seed(seed)
    kv = runner.kv
    for layer in range(len(kv.k)):
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    rows, out_slots, positions = [], [], []
    for n in lengths:
        row = kv.alloc_row()
        slots = kv.alloc(n + 1)
        kv.req_to_token[row, :n + 1] = torch.from_numpy(slots)
        rows.append(row)
        positions.append(n)
        out_slots.append(int(slots[-1]))
    ids = torch.randint(0, runner.shape.vocab_size, (len(lengths),))
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return DecodeInputs(ids, t(positions), t(rows), t(positions) + 1, t(out_slots))


@pytest.mark.parametrize("arch,splits", [("qwen2", 1), ("qwen3", 4)])  # qwen3: q/k head norms
def test_fused_decode_equals_the_torch_path(arch, splits):
    """splits 1: one pass over each row's keys; 4: split-K, merged."""
    runner = _runner(arch, "float32")
    model = runner.model
    assert model.fused_decode_supported()
    inp = _step(runner, [3, 17, 40, 1])
    saved = [(k.clone(), v.clone()) for k, v in zip(runner.kv.k, runner.kv.v)]
    ref, _ = model.decode(inp, 64, runner.kv, runner.kv.req_to_token, capture_routing=False)
    ref_kv = [(k.clone(), v.clone()) for k, v in zip(runner.kv.k, runner.kv.v)]
    for (k, v), (k0, v0) in zip(zip(runner.kv.k, runner.kv.v), saved):
        k.copy_(k0)
        v.copy_(v0)
    out = model.decode_fused(inp, runner.kv, runner.kv.req_to_token, splits=splits)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for (k, v), (rk, rv) in zip(zip(runner.kv.k, runner.kv.v), ref_kv):
        # the new tokens' K/V stored at their slots (the norms' fp32 sums differ in order only)
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=0, atol=1e-5)
    assert not torch.equal(k, saved[-1][0])  # the step did write


def test_attention_reads_only_each_rows_own_keys():
    """Keys past a row's length (another request's, or stale) must not change its output."""
    torch.manual_seed(2)
    B, H, KVH, D, S = 3, 4, 2, 16, 64
    q = torch.randn(B, H, D)
    k, v = torch.randn(S, KVH, D), torch.randn(S, KVH, D)
    table = torch.from_numpy(np.random.default_rng(0).permutation(S)[:3 * 20].reshape(3, 20)).long()
    lens = torch.tensor([1, 7, 20])
    rows = torch.tensor([0, 1, 2])
    out = kernels.decode_attention(q, k, v, table, rows, lens, 0.25, splits=2)
    for b in range(B):
        keys, vals = k[table[b, :lens[b]]], v[table[b, :lens[b]]]  # [n, KVH, D]
        keys, vals = keys.repeat_interleave(H // KVH, 1), vals.repeat_interleave(H // KVH, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], keys) * 0.25, -1)
        torch.testing.assert_close(out[b].view(H, D), torch.einsum("hn,nhd->hd", p, vals),
                                   rtol=1e-5, atol=1e-5)
    k[table[0, 1:]] = 1e4  # garbage beyond row 0's single key
    torch.testing.assert_close(kernels.decode_attention(q, k, v, table, rows, lens, 0.25, splits=2)[0],
                               out[0])
