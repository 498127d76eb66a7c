"""R3 replay on HF Qwen3-MoE: alignment (a replayed index never lands on another token), gradients
through the dense scores, activation recompute, and the FSDP backend's refusals and metrics."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from miles.algo import LossConfig
from miles.algo.routing import micro_batch_indices, pack_routing, unpack_routing
from miles.backends import TrainConfig
from miles.backends.packing import pack_samples
from miles.backends.policy import PackedPolicy
from miles.backends.router_replay import RouterReplay
from miles.tiny import build_tiny_model
from miles.wire.messages import Sample

torch.set_num_threads(1)
E, K = 32, 2                              # 496 distinct top-2 sets: one per token below
PAIRS = list(itertools.combinations(range(E), K))


@pytest.fixture(scope="module")
def moe_path():
    return build_tiny_model(arch="qwen3_moe", num_experts=E, num_experts_per_tok=K)


def _lm(path, **kw):
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", **kw)
    lm.config.use_cache = False
    return lm


def pattern(sample: int, pos: int, layer: int) -> tuple[int, int]:
    """A top-2 set unique to (sample, position, layer) among the tokens of these tests."""
    return PAIRS[(sample * 97 + pos * 5 + layer * 211) % len(PAIRS)]


def unique_samples(lengths, layers, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s, n in enumerate(lengths):
        routed = np.array([[pattern(s, t, l) for l in range(layers)] for t in range(n - 1)], np.int32)
        out.append(Sample(tokens=rng.integers(0, vocab, n).astype(np.int32), response_length=n // 2,
                          routed_experts=pack_routing(routed, E), group_id=f"g{s}", reward=float(s % 2)))
    return out


def test_layout_padding_packing_and_cp_slicing_keep_each_index_on_its_token():
    layers, lengths = 2, [8, 4, 12]
    samples = unique_samples(lengths, layers)
    order = [2, 0, 1]                      # a micro-batch's own sample order
    packed = micro_batch_indices([samples[i].routed_experts for i in order], [lengths[i] for i in order], layers, K)
    tokens = torch.cat([torch.as_tensor(samples[i].tokens, dtype=torch.int64) for i in order])
    owner = torch.cat([torch.stack([torch.full((lengths[i],), i), torch.arange(lengths[i])], 1) for i in order])
    assert packed.shape == (sum(lengths), layers, K)
    for row, (s, t) in enumerate(owner.tolist()):
        for l in range(layers):
            want = sorted(pattern(s, t, l)) if t < lengths[s] - 1 else [-1, -1]  # the padded last row
            assert sorted(packed[row, l].tolist()) == want, (row, s, t, l)
    # Megatron's path: the row padded to a multiple of 2 x cp x tp (sentinel rows), each CP rank's
    # chunks picked (megatron_cp.cp_layout), then the SP slice per TP rank (megatron_replay.rows_for)
    from miles.backends.megatron_cp import cp_chunk_multiple, cp_layout
    from miles.backends.megatron_replay import rows_for

    seq_lens = [lengths[i] for i in order]
    for cp, tp in ((1, 2), (2, 1), (2, 2), (3, 1)):
        length = -(-sum(seq_lens) // cp_chunk_multiple(cp, tp)) * cp_chunk_multiple(cp, tp)
        pad = length - sum(seq_lens)
        tagged = torch.cat([owner, packed.flatten(1)], 1)   # [T, 2 + L * k]: (sample, token) + indices
        seen = []
        for r in range(cp):
            lay = cp_layout(seq_lens + ([pad] if pad else []), cp, r, "cpu") if cp > 1 else None
            for t in range(tp):
                piece = rows_for(tagged, length, t, tp,
                                 local_index=lay.local_index_host if lay is not None else None)
                for s, tok, *idx in piece.tolist():
                    if s == -1:    # rows_for's own padding rows
                        continue
                    seen.append((s, tok))
                    assert idx == [v for l in range(layers) for v in
                                   (pattern(s, tok, l) if tok < lengths[s] - 1 else (-1, -1))]
        assert sorted(seen) == sorted((s, t) for s in range(3) for t in range(lengths[s]))   # each once


def test_replayed_experts_receive_each_tokens_recorded_set(moe_path):
    """Through the real model: what mlp.experts receives at row t is the pattern of token t."""
    lm = _lm(moe_path)
    layers = lm.config.num_hidden_layers
    replay = RouterReplay.install(lm)
    got: dict[int, torch.Tensor] = {}
    for l in range(layers):
        lm.model.layers[l].mlp.experts.register_forward_pre_hook(
            lambda m, args, l=l: got.__setitem__(l, args[1].clone()))
    lengths, order = [9, 5, 14], [1, 2, 0]
    samples = unique_samples(lengths, layers, vocab=lm.config.vocab_size)
    mb = pack_samples([samples[i].tokens for i in order], [samples[i].response_length for i in order],
                      [np.ones(samples[i].response_length, np.uint8) for i in order], [None] * 3, order,
                      torch.device("cpu"))
    policy = PackedPolicy(lm, packed_attention=False)
    indices = micro_batch_indices([samples[i].routed_experts for i in order], [lengths[i] for i in order], layers, K)
    with replay.micro_batch(indices, replay=True):
        policy.run(mb.inputs)
    row = 0
    for s in order:
        for t in range(lengths[s] - 1):
            for l in range(layers):
                assert sorted(got[l][row].tolist()) == sorted(pattern(s, t, l)), (s, t, l)
            row += 1
        row += 1                            # the sample's last token: native routing (sentinel row)
    m = replay.take_metrics()
    assert m["routing_agreement"] == 1.0
    assert m["routing_native_agreement"] < 0.2   # random patterns: the model's own choice rarely matches
    assert m["routing_replay_sentinel_rows"] == 3 * layers


def test_weights_come_from_dense_scores_and_reach_the_router(moe_path):
    lm = _lm(moe_path)
    router = lm.model.layers[0].mlp.gate
    replay = RouterReplay.install(lm)
    h = torch.randn(6, lm.config.hidden_size)
    with torch.no_grad():
        probs = torch.softmax(h @ router.weight.T, -1)
    worst = probs.argsort(-1)[:, :K]        # the two experts the model would never pick
    idx = torch.stack([worst, worst], 1)[:, :lm.config.num_hidden_layers]
    with replay.micro_batch(idx, replay=True):
        _, weights, used = router(h)
        (weights * torch.arange(1.0, K + 1)).sum().backward()
    assert torch.equal(used, worst)
    want = probs.gather(1, worst)
    assert torch.allclose(weights, want / want.sum(-1, keepdim=True), atol=1e-6)   # norm_topk_prob
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with replay.micro_batch(idx, replay=False):   # measured, not replayed: the model's own top-k
        assert not torch.equal(router(h)[2], worst)


def test_gradient_checkpointing_recompute_uses_the_same_indices(moe_path):
    grads, calls = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        lm = _lm(moe_path)
        lm.train()
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = lm.config.num_hidden_layers
        replay = RouterReplay.install(lm)
        seen = []
        lm.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone()))
        samples = unique_samples([10, 7], layers, vocab=lm.config.vocab_size, seed=1)
        mb = pack_samples([s.tokens for s in samples], [s.response_length for s in samples],
                          [np.ones(s.response_length, np.uint8) for s in samples], [None] * 2, [0, 1],
                          torch.device("cpu"))
        indices = micro_batch_indices([s.routed_experts for s in samples], [10, 7], layers, K)
        with replay.micro_batch(indices, replay=True):
            logp, _ = PackedPolicy(lm, packed_attention=False).run(mb.inputs)
            logp.sum().backward()
        calls.append(replay.router_calls)
        assert all(torch.equal(seen[0], x) for x in seen)
        assert replay.take_metrics()["routing_agreement"] == 1.0    # a recompute is not counted twice
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    assert calls == [2, 4]                   # the recompute re-ran both routers, inside the context
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_wire_dtype_round_trip_and_bad_values():
    raw = np.array([[[0, 7], [-1, -1]], [[254, 3], [1, 2]]], np.int32)
    small = pack_routing(raw)
    assert small.dtype == np.uint8 and small[0, 1].tolist() == [255, 255]
    assert unpack_routing(small).tolist() == raw.tolist()
    big = pack_routing(np.array([[[300, -1]]], np.int32))
    assert big.dtype == np.uint16 and big.tolist() == [[[65535, 65535]]]   # a row with a -1 is "none"
    assert unpack_routing(big).tolist() == [[[-1, -1]]]
    assert pack_routing(raw, num_experts=512).dtype == np.uint16    # the model decides when known
    # DeepSeek-V3's 256 experts, top-8: uint8, expert 255 stays real; only an all-255 row is "none"
    ds = np.array([[[255, 0, 7, 3, 254, 1, 2, 9], [-1] * 8]], np.int32)
    packed = pack_routing(ds, num_experts=256)
    assert packed.dtype == np.uint8 and unpack_routing(packed).tolist() == ds.tolist()
    # top-1 with 256 experts has no spare value in uint8: uint16
    assert pack_routing(np.array([[[255], [-1]]], np.int32), num_experts=256).dtype == np.uint16
    assert pack_routing(np.array([[[254], [-1]]], np.int32), num_experts=255).dtype == np.uint8
    with pytest.raises(ValueError, match="expert id 8 outside \\[0, 8\\)"):
        pack_routing(np.array([[[8, 1]]], np.int32), num_experts=8)
    with pytest.raises(ValueError, match="value -2 < -1"):
        pack_routing(np.array([[[-2, 1]]], np.int32))
    with pytest.raises(ValueError, match="expected shape \\(tokens - 1, layers, top_k\\)"):
        pack_routing(np.zeros((3, 2), np.int32))


# ---- the FSDP backend (one rank, gloo) -----------------------------------------------------

def _native_routing(path, samples, flip_every=0):
    """The model's own top-k per token (what an fp32 engine records), optionally altered."""
    lm = _lm(path)
    layers = lm.config.num_hidden_layers
    out = []
    for s in samples:
        rows = []
        hooks = [lm.model.layers[l].mlp.gate.register_forward_hook(
            lambda m, a, o, l=l: rows.append((l, o[2].clone()))) for l in range(layers)]
        with torch.no_grad():
            lm.model(input_ids=torch.as_tensor(s.tokens, dtype=torch.int64)[None])
        for h in hooks:
            h.remove()
        arr = torch.stack([dict(rows)[l] for l in range(layers)], 1)[:-1].numpy().astype(np.int32)
        if flip_every:
            arr[::flip_every, :, 0] = (arr[::flip_every, :, 0] + 1) % lm.config.num_experts
            arr[::flip_every, :, 1] = np.where(arr[::flip_every, :, 1] == arr[::flip_every, :, 0],
                                               (arr[::flip_every, :, 1] + 1) % lm.config.num_experts,
                                               arr[::flip_every, :, 1])
        out.append(pack_routing(arr))
    return out


def _batch(path, vocab):
    rng = np.random.default_rng(3)
    samples = []
    for g in range(3):
        for j in range(2):
            n, r = int(rng.integers(10, 20)), int(rng.integers(3, 8))
            samples.append(Sample(tokens=rng.integers(0, vocab, n).astype(np.int32), response_length=r,
                                  rollout_logprobs=np.full(r, -1.0, np.float32), reward=float(j),
                                  group_id=f"g{g}", status="completed"))
    return samples


def test_backend_replay_agreement_and_refusals(moe_path, backends):
    import msgspec
    cfg = TrainConfig(model_path=str(moe_path), param_dtype="float32", lr=0.0, router_replay=True,
                      old_logprobs="recompute", attention="sdpa")
    backend = backends(cfg, LossConfig())
    samples = _batch(moe_path, backend.vocab_size)
    native = _native_routing(moe_path, samples)
    flipped = _native_routing(moe_path, samples, flip_every=2)
    exact = [msgspec.structs.replace(s, routed_experts=r) for s, r in zip(samples, native)]
    m = backend.train(exact)
    assert m["routing_agreement"] == 1.0 and m["routing_native_agreement"] == 1.0
    m = backend.train([msgspec.structs.replace(s, routed_experts=r) for s, r in zip(samples, flipped)])
    assert m["routing_agreement"] == 1.0            # replayed: the experts got the rollout's sets
    assert 0.4 < m["routing_native_agreement"] < 0.6   # every other row flipped (lr 0: the same weights)
    missing = list(exact)
    missing[3] = msgspec.structs.replace(missing[3], routed_experts=None)
    with pytest.raises(ValueError, match=r"sample 3 \(group_id='g1'.*routed_experts: missing.*rollout.r3"):
        backend.train(missing)
    short = list(exact)
    short[1] = msgspec.structs.replace(short[1], routed_experts=short[1].routed_experts[:-1])
    with pytest.raises(ValueError, match=r"sample 1 .*routed_experts: shape"):
        backend.train(short)
    from miles.backends.base import TrainPhase
    sft = TrainPhase("sft", msgspec.structs.replace(LossConfig(), loss_type="sft"), cfg)
    assert np.isfinite(backend.train(samples, sft)["loss"])   # a warm-start has no routing: not replayed


def test_dense_model_with_replay_is_refused(backends):
    path = build_tiny_model(arch="qwen3")
    with pytest.raises(ValueError, match="train.router_replay = true .* no MoE router"):
        backends(TrainConfig(model_path=str(path), param_dtype="float32", router_replay=True), LossConfig())


def test_a_micro_batchs_indices_cross_to_the_device_once():
    """Every router call of a micro-batch reads its layer from one device copy of the indices (a
    copy per call synchronised the stream each time on CUDA: +28% per replayed H200 step)."""
    replay = RouterReplay({}, num_layers=3, top_k=2, num_experts=4)
    indices = torch.arange(5 * 3 * 2).reshape(5, 3, 2) % 4
    meta = torch.device("meta")
    with replay.micro_batch(indices, replay=True):
        assert torch.equal(replay.layer_indices(1, indices.device), indices[:, 1])   # same device: no copy
        first = replay.layer_indices(0, meta)
        moved = replay.indices
        assert first.device == meta and first.shape == (5, 2) and moved.shape == (5, 3, 2)
        for layer in (1, 2, 0):
            assert replay.layer_indices(layer, meta).device == meta
            assert replay.indices is moved                                   # not copied again
    assert replay.indices is None


def test_the_old_logprob_pass_replays_the_same_routing(moe_path, backends):
    """`old_logprobs = "recompute"` with R3: the no-grad old-policy pass routes by the recorded
    experts too, so at lr 0 the PPO ratio is exactly 1 even though the record disagrees with the
    model's own routing on half the rows. The same pass without replay leaves a gap (ppo_kl != 0):
    the metric sees a pass that routes natively."""
    import msgspec
    cfg = TrainConfig(model_path=str(moe_path), param_dtype="float32", lr=0.0, router_replay=True,
                      old_logprobs="recompute", attention="sdpa")
    backend = backends(cfg, LossConfig())
    samples = _batch(moe_path, backend.vocab_size)
    flipped = [msgspec.structs.replace(s, routed_experts=r)
               for s, r in zip(samples, _native_routing(moe_path, samples, flip_every=2))]
    m = backend.train(flipped)
    assert m["routing_agreement"] == 1.0 and m["routing_native_agreement"] < 0.6
    assert m["ppo_kl"] == 0.0 and m["pg_clipfrac"] == 0.0

    no_grad = backend._no_grad_logprobs
    backend._no_grad_logprobs = lambda policy, flat, routing, replay, replaying: no_grad(
        policy, flat, routing, replay, False)      # the old pass routes natively, training replays
    m = backend.train(flipped)
    assert abs(m["ppo_kl"]) > 1e-4, m


def test_the_rollout_takes_the_wire_dtype_from_the_models_expert_count(tmp_path, moe_path):
    from miles.engines.routed_experts import num_routed_experts
    assert num_routed_experts(moe_path) == E
    for key, n in (("n_routed_experts", 256), ("num_local_experts", 8)):   # DeepSeek, Mixtral
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(f'{{"{key}": {n}, "num_experts_per_tok": 2}}')
        assert num_routed_experts(tmp_path / key) == n
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text('{"num_hidden_layers": 2}')
    assert num_routed_experts(tmp_path / "dense") is None
