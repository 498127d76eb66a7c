"""Context parallelism's row layout and attention (megatron_cp.py), checked against the whole row.

Each CP rank's queries, attending through its layout to the keys every rank holds (gathered in
rank order, as the all-gather delivers them), must give exactly the whole row's per-sample causal
attention at the rows that rank holds. The end-to-end steps (gradients equal to the unsharded HF
step at CP = 2, with MoE, EP and TP + SP) are in test_megatron_backend.py, and R3 replay under CP
in test_r3_megatron.py.
"""

from __future__ import annotations

import pytest
import torch

from miles.backends.attention import segment_attention
from miles.backends.megatron_cp import cp_chunk_multiple, cp_layout, local_rows

# samples of a packed row (the last one is the padding segment megatron_step.padded_row adds)
ROWS = {2: [5, 17, 1, 9], 4: [31, 2, 7, 6, 2]}


@pytest.mark.parametrize("cp", [2, 4])
def test_each_token_is_held_once_and_the_chunks_balance(cp):
    lens = ROWS[cp]
    length = sum(lens)
    assert length % cp_chunk_multiple(cp) == 0
    layouts = [cp_layout(lens, cp, r, "cpu") for r in range(cp)]
    held = torch.cat([lay.local_index for lay in layouts])
    assert sorted(held.tolist()) == list(range(length))
    c = length // (2 * cp)
    for r, lay in enumerate(layouts):   # chunks r and 2cp - 1 - r, in that order
        assert lay.local_index.tolist() == list(range(r * c, (r + 1) * c)) + \
            list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert torch.equal(lay.local_index_host, lay.local_index)
        starts = torch.tensor([0] + lens).cumsum(0)
        sample = torch.searchsorted(starts[1:], lay.local_index, right=True)
        assert torch.equal(lay.positions, lay.local_index - starts[sample])
        assert (lay.local_of_row[lay.local_index] == torch.arange(len(lay.local_index))).all()
        assert int((lay.local_of_row >= 0).sum()) == len(lay.local_index)


def test_a_row_that_does_not_cut_into_equal_chunks_is_refused():
    with pytest.raises(ValueError, match="row of 10 tokens cannot be cut into 2 x cp = 4 equal chunks"):
        local_rows(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_ranks_attention_equals_the_whole_rows_at_its_tokens(cp):
    from miles.backends.attention import lower_right_causal

    torch.manual_seed(cp)
    lens = ROWS[cp]
    length, hq, hkv, d = sum(lens), 4, 2, 8
    q, k, v = torch.randn(length, hq, d), torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    bounds = torch.tensor([0] + lens).cumsum(0).tolist()
    whole = segment_attention(*(x.permute(1, 0, 2)[None] for x in (q, k, v)), bounds, None)[0]
    whole = whole.permute(1, 0, 2)   # [L, Hq, D]
    layouts = [cp_layout(lens, cp, r, "cpu") for r in range(cp)]
    k_all = torch.cat([k[lay.local_index] for lay in layouts])   # the gather's rank order
    v_all = torch.cat([v[lay.local_index] for lay in layouts])
    for lay in layouts:
        ql = q[lay.local_index]
        ks, vs = k_all[lay.kv_index], v_all[lay.kv_index]
        out = torch.cat([lower_right_causal(ql[a:b], ks[c:e], vs[c:e], None) for a, b, c, e in lay.segments])
        torch.testing.assert_close(out, whole[lay.local_index], rtol=1e-5, atol=1e-6)
        # the varlen form's boundaries describe the same segments
        assert lay.cu_q.tolist() == [0] + [b for _, b, _, _ in lay.segments]
        assert lay.cu_k.tolist() == [0] + [e for _, _, _, e in lay.segments]
        assert lay.max_q == max(b - a for a, b, _, _ in lay.segments)
