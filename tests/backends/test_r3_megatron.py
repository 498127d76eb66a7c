"""R3 in the Megatron backend with real processes on gloo (qwen3_moe, 2 ranks, EP=2 and PP=2): with
replay, the experts each token reaches (the routing map megatron's dispatcher receives, read by
a hook) equal the recorded ones on 100% of (token, layer) pairs although the model's own router
almost never picks them; without replay they are only measured; activation recompute replays the
same indices (same loss and gradient norm); gradients reach the router; a sample without routing
is refused on every rank. megatron_r3_worker.py runs each layout and asserts nothing itself.
In process: sentinel rows stay native, weights come from the dense scores, the recompute queue,
upstream's global instance list untouched, rows padded and sliced like the tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_helpers import run_ranks

WORKER = Path(__file__).with_name("megatron_r3_worker.py")


def _native(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_keeps_sentinel_rows_native_and_gathers_dense_scores():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from miles.backends.megatron_replay import NO_GRAD, OFF, TRAIN, MegatronReplay, MilesRouterReplay

    before = len(RouterReplay.global_router_replay_instances)
    state = MegatronReplay([], num_layers=1, top_k=2, sequence_parallel=False, device=torch.device("cpu"))
    replay = MilesRouterReplay(state, layer=0)
    assert len(RouterReplay.global_router_replay_instances) == before   # not leaked upstream
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 1.0]],
                          requires_grad=True)
    replay.target_topk_idx = torch.tensor([[2, 3], [0, 1], [-1, -1]])   # row 2: a sentinel row
    replay.set_router_replay_action(NO_GRAD)
    values, used = replay.get_replay_topk(logits, 2, default_compute_topk=_native)
    assert used.tolist() == [[2, 3], [0, 1], [0, 3]]          # sentinel: the native top-2
    assert torch.equal(values, logits.gather(1, used))
    values.sum().backward()                                    # the replayed (unpicked) logits get gradient
    assert logits.grad[0, 2] == 1 and logits.grad[0, 0] == 0
    # measure only: native routing, counted against the record
    replay.set_router_replay_action(OFF)
    replay.measure = True
    _, used = replay.get_replay_topk(logits.detach(), 2, default_compute_topk=_native)
    assert sorted(used[0].tolist()) == [0, 1]
    sums = {k: float(v) for k, v in state._counts.items()}
    assert sums == {"routing_native_matches": 0.0, "routing_rows": 2.0, "routing_used_matches": 0.0}
    # training with recompute: the no-grad forward queues, the recompute pops the oldest
    replay.set_router_replay_action(TRAIN)
    first = replay.target_topk_idx
    with torch.no_grad():
        replay.get_replay_topk(logits, 2, default_compute_topk=_native)
    replay.target_topk_idx = torch.tensor([[1, 2], [1, 2], [1, 2]])   # the next micro-batch's forward
    with torch.no_grad():
        replay.get_replay_topk(logits, 2, default_compute_topk=_native)
    _, used = replay.get_replay_topk(logits, 2, default_compute_topk=_native)   # recompute of the first
    assert replay.last_recompute and used[:2].tolist() == first[:2].tolist()
    with pytest.raises(ValueError, match="layer 0 routes 2 tokens to 2 experts.*shape \\(3, 2\\)"):
        replay.set_router_replay_action(NO_GRAD)
        replay.get_replay_topk(logits[:2], 2, default_compute_topk=_native)


def test_rows_follow_the_padded_and_sequence_parallel_tokens():
    from miles.backends.megatron_replay import rows_for

    indices = torch.arange(10 * 2 * 2).reshape(10, 2, 2)
    padded = rows_for(indices, 12)
    assert padded.shape == (12, 2, 2) and torch.equal(padded[:10], indices) and (padded[10:] == -1).all()
    assert torch.equal(torch.cat([rows_for(indices, 12, r, 3) for r in range(3)]), padded)
    assert torch.equal(rows_for(indices, 12, 1, 2), padded[6:])
    with pytest.raises(ValueError, match="10 routing rows for a row of 8 tokens"):
        rows_for(indices, 8)
    with pytest.raises(ValueError, match="row of 10 tokens is not a multiple of TP = 4"):
        rows_for(indices, 10, 0, 4)


@pytest.mark.slow
# ep2 and cp2 are each inside cp2_ep2: `extended` (MILES_TEST_EXTENDED=1)
@pytest.mark.parametrize("sizes", [pytest.param("1,1,2", marks=pytest.mark.extended), "1,2,1", "2,1,1",
                                   pytest.param("1,1,1,cp2", marks=pytest.mark.extended), "1,1,2,cp2"],
                         ids=["ep2", "pp2", "tp2_sp", "cp2", "cp2_ep2"])
def test_megatron_replays_the_recorded_routing(sizes, tmp_path):
    """Each layout replays every recorded (token, layer) pair. Under TP = 2 with sequence
    parallelism (megatron requires it for MoE with TP) each TP rank's routers see half of each
    row's tokens; under CP = 2 each CP rank holds two of a row's four chunks (megatron_cp.py). The
    hook checks every token at its row position, so an index replayed on the wrong token fails."""
    ranks = run_ranks(f"r3:{sizes}", tmp_path, world_size=2, timeout_s=400, worker=WORKER)
    check_ranks(ranks, pp=sizes == "1,2,1")
    sp, cp = sizes == "2,1,1", sizes.endswith("cp2")
    for r in ranks:
        assert r["on"]["sequence_parallel"] is sp
        assert (r["on"]["offset_slices"] > 0) is (sp and r["rank"] == 1), r["on"]
        # rank 1 of CP holds the row's second chunk first: its tokens are not at their row index
        assert (r["on"]["cp_slices"] > 0) is (cp and r["rank"] == 1), r["on"]
    if sp or cp:   # each rank checks about half of the tokens
        checked = [r["on"]["checked"] for r in ranks]
        assert abs(checked[0] - checked[1]) < 0.5 * max(checked), checked


def test_replay_on_a_dense_model_is_refused(tmp_path):
    (rank,) = run_ranks("dense", tmp_path, world_size=1, timeout_s=120, worker=WORKER)
    assert rank["error"] and "train.router_replay = true" in rank["error"], rank
    assert rank["path"] in rank["error"] and "no MoE router" in rank["error"]


def check_ranks(ranks: list[dict], *, pp: bool, grad_rtol: float = 1e-5) -> None:
    """What every layout must show (the GPU test checks the same on CUDA)."""
    for r in ranks:
        off, on, rec = r["off"], r["on"], r["on_recompute"]
        # PP: each stage holds its own (global) layer; EP: every rank holds both
        assert on["layers"] == ([r["rank"]] if pp else [0, 1]), on["layers"]
        # the hook saw real tokens on every rank
        assert off["checked"] > 50 and on["checked"] == off["checked"] == rec["checked"]
        # replay off: native routing, which the record was built to disagree with
        assert off["matched"] / off["checked"] < 0.2, off
        assert on["matched"] == on["checked"], on
        assert rec["matched"] == rec["checked"], rec
        # recompute re-ran the routers and replayed the same indices
        assert rec["calls"] > on["calls"]
        assert abs(rec["metrics"]["grad_norm"] - on["metrics"]["grad_norm"]) <= grad_rtol * on["metrics"]["grad_norm"]
        assert on["router_grad"] > 0 and rec["router_grad"] > 0
        # the replayed experts are the ones trained: another gradient than native routing's
        assert abs(on["metrics"]["grad_norm"] - off["metrics"]["grad_norm"]) > 1e-4 * off["metrics"]["grad_norm"]
        assert abs(on["router_grad"] - off["router_grad"]) > 1e-3 * off["router_grad"]
        assert r["refused"] is not None and r["refused_weights_kept"], r["refused"]
    routing = lambda m: {k: v for k, v in m.items() if k.startswith("routing")}  # noqa: E731
    m_off, m_on = ranks[0]["off"]["metrics"], ranks[0]["on"]["metrics"]
    assert m_on["routing_agreement"] == 1.0
    assert m_off["routing_agreement"] == m_off["routing_native_agreement"] < 0.2
    assert m_on["routing_native_agreement"] < 0.2
    assert m_on["routing_replay_sentinel_rows"] > 0        # last tokens and padding: native
    assert "routing_agreement" in m_off and "routing_replay_sentinel_rows" not in m_off
    if len(ranks) > 1:   # summed over the ranks: every rank reports the same
        assert routing(ranks[0]["on"]["metrics"]) == routing(ranks[1]["on"]["metrics"])
    # the rank training sample 3 names it; another raises with it
    assert any("sample 3" in r["refused"] and "routed_experts: missing" in r["refused"] for r in ranks)
