"""FSDP backend on CUDA: bf16 compute over fp32 master weights, packed attention kernels, sleep/wake
really freeing device memory, weights out in bf16, and (with 2+ GPUs) the 2-rank suite over NCCL.

Skipped without CUDA. Run: .venv/bin/python -m pytest tests/gpu/test_fsdp_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples, run_ranks  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, attention, make_backend  # noqa: E402
from miles.backends.packing import pack_samples  # noqa: E402
from miles.backends.policy import PackedPolicy  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

# Big enough that its optimizer state dominates what stays on the device (rotary buffers, NCCL).
MODEL = dict(arch="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_packed_attention_bf16_matches_unpacked():
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(**MODEL)
    device = torch.device("cuda")
    impl = attention.register()
    varlen = attention.enable_varlen_kernel(device, torch.bfloat16)
    print(f"torch varlen_attn in use: {varlen}")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=impl).to(device)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    samples = make_samples(groups=1, per_group=6, seed=5, prompt=(20, 60), response=(40, 200))
    mb = pack_samples([s.tokens for s in samples], [s.response_length for s in samples],
                      [np.ones(s.response_length, np.uint8) for s in samples], [None] * 6,
                      list(range(6)), device)
    with torch.no_grad():
        packed, _ = PackedPolicy(lm, packed_attention=True).run(mb.inputs)
        alone = []
        for s in samples:
            n, r = len(s.tokens), s.response_length
            ids = torch.as_tensor(s.tokens, dtype=torch.int64, device=device)[None]
            logits = ref(input_ids=ids).logits[0, n - r - 1:n - 1].float()
            alone.append(torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None]).squeeze(1))
    alone = torch.cat(alone)
    # bf16 compute: the two paths round differently, but must agree far better than a wrong mask
    assert float((packed - alone).abs().mean()) < 0.02, float((packed - alone).abs().mean())


def _live_allocations(top: int = 8) -> str:
    """The live caching-allocator blocks (from `_record_memory_history`), summed by the first frame
    outside torch that allocated them: what stays on the device, and who made it."""
    snap = torch.cuda.memory._snapshot()
    by_site: dict[str, int] = {}
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if f.get("filename", "").endswith(".py")]
            ours = [f for f in frames if "/torch/" not in f["filename"]] or frames
            site = " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours[:3])
            by_site[site or "?"] = by_site.get(site or "?", 0) + block["size"]
    rows = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return "\n".join(f"{n / 2**20:8.1f} MiB  {site}" for site, n in rows)


def test_train_bf16_then_sleep_frees_memory_and_wake_resumes():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    path = build_tiny_model(**MODEL)
    cfg = TrainConfig(model_path=str(path), param_dtype="bfloat16", lr=1e-3,
                      max_tokens_per_microbatch=512, compile=False)  # (compiled graphs keep buffers)
    backend = make_backend("fsdp")
    backend.init(cfg, RankInfo(), LossConfig(loss_type="sft", loss_reduction="token"))
    batch = make_samples(groups=2, per_group=4, seed=6, vocab=400)
    try:
        losses = [backend.train(batch)["loss"] for _ in range(3)]
        assert losses[2] < losses[0], losses
        param = next(backend.policy.parameters())
        assert param.dtype == torch.float32 and param.device.type == "cuda"  # fp32 master shards

        names = []
        for bucket in backend.iter_hf_weight_buckets(1 << 20):
            names += [n for n, _ in bucket]
            assert all(t.dtype == torch.bfloat16 and t.is_cuda for _, t in bucket)
        assert "model.layers.0.self_attn.q_proj.weight" in names
        del bucket

        # a no-grad forward leaves FSDP's root unsharded (bf16 copies); sleep must still free all
        mb = pack_samples([s.tokens for s in batch[:2]], [s.response_length for s in batch[:2]],
                          [np.ones(s.response_length, np.uint8) for s in batch[:2]], [None] * 2,
                          [0, 1], backend.device)
        with torch.no_grad():
            backend.policy.run(mb.inputs)
        del mb
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        # the optimizer's params are the fp32 master shards whatever FSDP has registered now
        # (after a no-grad forward that is the unsharded bf16 copies)
        masters = [p for g in backend.optimizer.param_groups for p in g["params"]]
        snapshot = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone().cpu() for p in masters]
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        state = sum(local(p).numel() * local(p).element_size() for p in backend.policy.parameters())
        state += sum(local(v).numel() * local(v).element_size() for s in backend.optimizer.state.values()
                     for v in s.values() if isinstance(v, torch.Tensor) and local(v).is_cuda)
        backend.sleep()
        asleep = torch.cuda.memory_allocated()
        live = _live_allocations()
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"memory_allocated: before init {before / 2**20:.1f} MiB, awake {awake / 2**20:.1f} MiB, "
              f"asleep {asleep / 2**20:.1f} MiB, state {state / 2**20:.1f} MiB; live asleep:\n{live}")
        # parameters and optimizer state (and any gradients) leave; a few buffers may stay. What
        # earlier tests of this process left allocated (`before`) is not this backend's.
        assert awake - asleep >= state, (awake, asleep, state)
        assert asleep - before < 0.1 * (awake - before), (before, awake, asleep, live)
        backend.wake_up()
        # the state comes back; transient copies (unsharded bf16 params, cuBLAS workspaces) do not
        assert torch.cuda.memory_allocated() >= state
        for k, p in enumerate(masters):
            assert torch.equal((p.to_local() if hasattr(p, "to_local") else p).detach().cpu(), snapshot[k]), k
        after = backend.train(batch)["loss"]
        assert np.isfinite(after) and after < losses[0]
    finally:
        backend.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_nccl(tmp_path):
    ranks = run_ranks("suite:qwen3", tmp_path, world_size=2, timeout_s=300, cuda=True)
    zero = ranks[0]
    assert zero["grad_rel_err_split"] < 1e-4
    assert zero["grad_rel_err_reference"] < 1e-4
    assert zero["export_logprob_max_diff"] < 1e-3
    assert zero["sft_losses"][0] > zero["sft_losses"][2]
