"""Embedded engine on CUDA: numerics vs transformers, CUDA-graph decode == eager, served end to end.

Skipped without CUDA. Run on the GPU machine:
    python -m pytest tests/gpu/test_engine_gpu.py -q
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.tiny import build_tiny_model  # noqa: E402


def make_runner(arch: str, dtype: str, **kw):
    from miles.engines.embedded_engine.runner import ModelRunner, RunnerConfig
    path = build_tiny_model(arch=arch)
    cfg = RunnerConfig(device="cuda", dtype=dtype, max_running_requests=64, max_total_tokens=30000,
                       context_length=1024, **kw)
    return path, ModelRunner(str(path), cfg)


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def prefill(runner, seqs):
    rows = [runner.kv.alloc_row() for _ in seqs]
    slots = [runner.kv.alloc(len(s)) for s in seqs]
    logits, routing = runner.prefill(seqs, rows, slots, [0] * len(seqs), capture_routing=True)
    return rows, logits, routing


def seqs_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_prefill_and_decode_match_hf_fp32(arch):
    path, r = make_runner(arch, "float32")
    hf = hf_model(path)
    seqs = seqs_of([5, 33, 17, 64], r.shape.vocab_size)
    rows, logits, routing = prefill(r, seqs)
    with torch.no_grad():
        for s, lg, rt in zip(seqs, logits, routing or [None] * len(seqs)):
            out = hf(torch.tensor([s], device="cuda"), output_router_logits=arch == "qwen3_moe")
            ref = out.logits[0].float().log_softmax(-1)
            assert (ref - lg.log_softmax(-1)).abs().max().item() <= 2e-4
            if rt is not None:
                k = r.shape.num_experts_per_tok
                top = np.stack([torch.topk(x.float().softmax(-1), k).indices.cpu().numpy()
                                for x in out.router_logits], axis=1)
                assert (top == rt).all()
        nxt = [7, 8, 9, 10]
        logits, _ = r.decode(nxt, [len(s) for s in seqs], rows, r.kv.alloc(len(seqs)), False)
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s + [nxt[i]]], device="cuda")).logits[0, -1].float().log_softmax(-1)
            assert (ref - logits[i].log_softmax(-1)).abs().max().item() <= 2e-4


def test_bf16_prefill_varlen_and_padded_sdpa_both_match_hf():
    """Both prefill attention paths (FlashAttention varlen when the probe passes, else causal SDPA
    over a right-padded view), for sequences of uneven lengths in one batch, are as close to the
    fp32 truth as transformers' own bf16 forward is (a wrong mask or a padded key leaking in
    would be far off)."""
    path, r = make_runner("qwen3", "bfloat16")
    print(f"prefill attention: {'varlen' if r.model.varlen is not None else 'padded sdpa'}")
    seqs = seqs_of([5, 33, 1, 17, 64], r.shape.vocab_size, seed=3)
    hf32, hf16 = hf_model(path), hf_model(path, torch.bfloat16)
    with torch.no_grad():
        refs = [hf32(torch.tensor([s], device="cuda")).logits[0].float().log_softmax(-1) for s in seqs]
        base = [(hf16(torch.tensor([s], device="cuda")).logits[0].float().log_softmax(-1) - ref).abs()
                for s, ref in zip(seqs, refs)]
    got = {}
    kernel = r.model.varlen
    for name, varlen in {"varlen": kernel, "padded": None}.items():
        if name == "varlen" and kernel is None:
            continue  # no FlashAttention varlen here: the padded path alone
        r.model.varlen, r.model.varlen_always = varlen, True
        rows, logits, _ = prefill(r, seqs)
        got[name] = [lg.log_softmax(-1) for lg in logits]
        for row in rows:
            r.kv.free_row(row)
    failures = []
    for name, lps in got.items():
        for s, lp, ref, b in zip(seqs, lps, refs, base):
            err = (lp - ref).abs()
            # per position: mean error over the vocabulary, against HF bf16's at that position
            worst, allowed = err.mean(-1).max().item(), 2 * b.mean(-1).max().item() + 0.01
            print(f"{name} len {len(s)}: worst position mean err {worst:.4f} (HF bf16 "
                  f"{b.mean(-1).max().item():.4f}), max err {err.max().item():.3f}")
            if worst > allowed:
                failures.append((name, len(s), worst, allowed))
    assert not failures, failures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [8, 5])  # 8 is a bucket (identical shapes), 5 is padded to 8
def test_cuda_graph_decode_equals_eager(dtype, n):
    _, r = make_runner("qwen3", dtype)
    assert r.use_graphs
    seqs = seqs_of([3 + 7 * i for i in range(n)], r.shape.vocab_size, seed=1)
    rows, logits, _ = prefill(r, seqs)
    ids = [int(lg[-1].argmax()) for lg in logits]
    pos = [len(s) for s in seqs]
    for step in range(40):  # crosses the kv bucket 64 -> 128 for the longest rows
        slots = r.kv.alloc(n)
        eager, _ = r.decode(ids, pos, rows, slots, False, force_eager=True)
        graph, _ = r.decode(ids, pos, rows, slots, False)  # rewrites the same K/V
        # Same kernels on the same inputs: expect equality; allow only rounding-level differences
        # (cuBLAS may pick another algorithm under capture, or for the padded shape when n=5).
        tol = 1e-4 if dtype == "float32" else 0.1
        assert (eager - graph).abs().max().item() <= tol, step
        # The same token, or in bf16 a near-tie: the graph's pick is within rounding of eager's top
        # logit (a random-weight model's 512 logits are close together; ties do come up).
        picked = graph.argmax(-1)
        gap = eager.max(-1).values - eager.gather(1, picked[:, None])[:, 0]
        assert (torch.equal(eager.argmax(-1), picked) if dtype == "float32"
                else gap.max().item() <= tol), (step, gap)
        ids = picked.tolist()
        pos = [p + 1 for p in pos]
    assert len(r.graphs.graphs) >= 2  # captured lazily per (batch, kv) bucket


def test_graphs_precaptured_at_start_then_lazily_past_the_limit():
    _, r = make_runner("qwen3", "bfloat16", cuda_graph_precapture_kv=128)
    g = r.graphs
    assert set(g.graphs) == {(b, kv) for b in g.buckets for kv in (64, 128)} and g.capture_s > 0
    seqs = seqs_of([150, 20], r.shape.vocab_size, seed=2)
    rows, logits, _ = prefill(r, seqs)
    ids = [int(lg[-1].argmax()) for lg in logits]
    r.decode(ids, [len(s) for s in seqs], rows, r.kv.alloc(2), False)
    assert (2, 256) in g.graphs and len(g.graphs) == 2 * len(g.buckets) + 1  # kv 256: on first use


def test_graph_padding_rows_never_touch_live_kv():
    _, r = make_runner("qwen3", "float32")
    seqs = seqs_of([10, 20, 30], r.shape.vocab_size, seed=2)
    rows, _, _ = prefill(r, seqs)
    live = torch.cat([r.kv.req_to_token[row, :len(s)] for row, s in zip(rows, seqs)])
    before = [k[live].clone() for k in r.kv.k]
    r.decode([1, 2, 3], [len(s) for s in seqs], rows, r.kv.alloc(3), False)  # padded to bucket 4
    assert all(torch.equal(b, k[live]) for b, k in zip(before, r.kv.k))


async def _serve(tmp_path, *extra):
    from miles.engines.embedded import launch_embedded_engine
    path = build_tiny_model(arch="qwen3")
    return path, await launch_embedded_engine(
        path, extra_args=["--device", "cuda", "--max-total-tokens", "50000", "--context-length", "2048",
                          "--max-running-requests", "64", "--random-seed", "0", *extra],
        log_path=tmp_path / "engine.log", ready_timeout_s=300)


async def test_served_on_cuda_fp32_with_graphs(tmp_path):
    from miles.engines.client import EngineClient
    path, engine = await _serve(tmp_path, "--dtype", "float32")
    try:
        async with EngineClient(engine.url) as c:
            info = await c.server_info()
            assert info["internal_states"][0]["cuda_graph"] is True
            rng = np.random.default_rng(0)
            jobs = [(rng.integers(0, 500, rng.integers(2, 80)).tolist(), int(rng.integers(1, 100)))
                    for _ in range(48)]
            results = await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "ignore_eos": True,
                                                            "sampling_seed": i}, return_logprob=True)
                                             for i, (p, n) in enumerate(jobs)))
            assert all(len(r.output_ids) == n for (_, n), r in zip(jobs, results))
            hf = hf_model(path)
            for (prompt, _), res in list(zip(jobs, results))[:8]:
                with torch.no_grad():
                    lp = hf(torch.tensor([prompt + res.output_ids], device="cuda")).logits[0].float().log_softmax(-1)
                ref = lp[len(prompt) - 1:-1].gather(1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0]
                assert (ref.cpu() - torch.tensor(res.output_logprobs)).abs().max().item() <= 2e-4
            greedy = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
            alone = await c.generate([1, 2, 3, 4], greedy)
            bg = [asyncio.create_task(c.generate([5] * (10 + i), {"max_new_tokens": 300, "ignore_eos": True}))
                  for i in range(20)]
            await asyncio.sleep(0.2)
            joined = await c.generate([1, 2, 3, 4], greedy)
            await asyncio.gather(*bg)
            assert joined.output_ids == alone.output_ids
            # pause in place across a weight update on CUDA
            tasks = [asyncio.create_task(c.generate([9, i], {"max_new_tokens": 400, "ignore_eos": True}))
                     for i in range(8)]
            await asyncio.sleep(0.2)
            await c.pause_generation("in_place")
            await c.update_weights_from_disk(str(build_tiny_model(arch="qwen3", seed=1)), weight_version="1")
            await c.continue_generation()
            for r in await asyncio.gather(*tasks):
                assert len(r.output_ids) == 400 and [s.version for s in r.weight_versions][-1] == "1"
    finally:
        await engine.stop_async()


async def test_served_on_cuda_bf16_close_to_hf(tmp_path):
    from miles.engines.client import EngineClient
    path, engine = await _serve(tmp_path, "--dtype", "bfloat16")
    try:
        async with EngineClient(engine.url) as c:
            res = await c.generate(list(range(3, 40)), {"max_new_tokens": 32, "ignore_eos": True},
                                   return_logprob=True)
        hf = hf_model(path, torch.bfloat16)
        tokens = list(range(3, 40)) + res.output_ids
        with torch.no_grad():
            lp = hf(torch.tensor([tokens], device="cuda")).logits[0].float().log_softmax(-1)
        ref = lp[36:-1].gather(1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0].cpu()
        diff = (ref - torch.tensor(res.output_logprobs)).abs()
        assert diff.mean().item() < 0.05 and diff.max().item() < 0.3, diff
    finally:
        await engine.stop_async()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (trainer + engine)")
async def test_nccl_weight_update(tmp_path):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles.engines.client import EngineClient
    from miles.weights.checks import tensor_sha256
    from miles.engines.embedded_engine.weights import init_custom_process_group
    from miles.engines.procs import free_port
    path, engine = await _serve(tmp_path, "--dtype", "float32")  # engine on cuda:0
    new = build_tiny_model(arch="qwen3", seed=1)
    sd = {k: v.to("cuda:1") for k, v in load_file(str(new / "model.safetensors")).items()}
    names, port = sorted(sd), free_port()
    torch.cuda.set_device(1)
    try:
        async with EngineClient(engine.url) as c:
            init = asyncio.create_task(c.init_weights_update_group("127.0.0.1", port, 1, 2, backend="nccl"))
            pg = await asyncio.to_thread(init_custom_process_group, "nccl", f"tcp://127.0.0.1:{port}",
                                         2, 0, "weight_update_group")
            await init
            upd = asyncio.create_task(c.update_weights_from_distributed(
                names, [str(sd[n].dtype) for n in names], [list(sd[n].shape) for n in names],
                weight_version="3"))

            def bcast():
                for n in names:
                    dist.broadcast(sd[n], src=0, group=pg)
                torch.cuda.synchronize()
            await asyncio.to_thread(bcast)
            assert (await upd)["success"]
            assert await c.weights_checksum() == {n: tensor_sha256(t) for n, t in sd.items()}
            await c.destroy_weights_update_group()
            dist.destroy_process_group(pg)
    finally:
        await engine.stop_async()
