"""Rank worker for the Megatron model/bridge tests, and `run_ranks` that launches it.

`python megatron_bridge_worker.py SCENARIO OUT_JSON` with torchrun-style RANK/WORLD_SIZE/MASTER_*;
a scenario is `kind:arch:tp,pp,ep`. Each rank writes its figures to OUT_JSON.rankN; the tests
assert on them (so a failure names the figure, not just "exited 1").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLE_LENS = (6, 9, 5)   # a packed row of 3 samples (20 tokens: divisible by tp=2 and 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out_dir: Path, *, world_size: int, timeout_s: float = 180) -> list[dict]:
    """Run this file as `world_size` gloo ranks (GPUs hidden); each rank's JSON, in rank order."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        out = out_dir / f"rank{rank}.json"
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), out, log))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{scenario!r}: ranks still running after {timeout_s} s") from None
    finally:
        for proc, _, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results = []
    for rank, (proc, out, _) in enumerate(procs):
        if proc.returncode != 0:
            text = (out_dir / f"rank{rank}.log").read_text()
            raise AssertionError(f"rank {rank} of {scenario!r} exited {proc.returncode}:\n{text[-6000:]}")
        results.append(json.loads(out.read_text()))
    return results


# ------------------------------------------------------------------ in the rank process


def _setup(arch: str, tp: int, pp: int, ep: int):
    import torch

    from miles.backends.base import RankInfo
    from miles.backends.config import MegatronConfig, TrainConfig
    from miles.backends.megatron_model import build_gpt_model, init_parallel
    from miles.tiny import build_tiny_model

    torch.set_num_threads(1)
    path = _tiny_llama() if arch == "llama" else build_tiny_model(arch=arch)
    cfg = TrainConfig(backend="megatron", param_dtype="float32",
                      megatron=MegatronConfig(tp=tp, pp=pp, ep=ep))
    init_parallel(cfg, RankInfo.from_env(), timeout_s=120)
    return path, cfg, build_gpt_model(path, cfg)


def _tiny_llama() -> Path:
    """A random tiny Llama (untied head, llama3 rope scaling) next to the tiny models' cache."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from miles.tiny import build_tokenizer, default_cache_dir
    out = default_cache_dir() / "megatron-test-llama-v1"
    if (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(build_tokenizer())
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16384, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _hf_logits(path, sample_ids):
    """transformers' logits of each sample alone, and its rotary inverse frequencies."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation="eager")
    with torch.no_grad():
        return [hf(ids[None]).logits[0] for ids in sample_ids], hf.model.rotary_emb.inv_freq


def _megatron_logits(model, ids, packed_lens=None):
    import torch
    from megatron.core import tensor_parallel

    from miles.backends.megatron_model import make_packed_seq_params
    pos = torch.arange(ids.shape[0])[None]
    params = make_packed_seq_params(packed_lens) if packed_lens else None
    with torch.no_grad():
        out = model(ids[None], pos, None, packed_seq_params=params)
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
    return out[0, :, :model.miles_vocab_size]


def scenario_logits(arch: str, tp: int, pp: int, ep: int, result: dict) -> None:
    """Megatron logits (HF weights loaded) against transformers', packed and sample by sample."""
    import torch

    from miles.backends.megatron_weights import load_hf_into
    path, _, model = _setup(arch, tp, pp, ep)
    # megatron's TP marks, which its grad norm and optimizer read, on every split weight
    result["tp_split"] = sorted(n for n, p in model.named_parameters()
                                if getattr(p, "tensor_model_parallel", False))
    result["params_loaded"] = load_hf_into(model, path)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.miles_vocab_size, (n,), generator=gen) for n in SAMPLE_LENS]
    ref, inv_freq = _hf_logits(path, samples)
    # rope (incl. llama3 scaling) is megatron's own table: compare it directly
    result["inv_freq_vs_hf"] = float((model.rotary_pos_emb.inv_freq.cpu() - inv_freq).abs().max())
    packed = _megatron_logits(model, torch.cat(samples), list(SAMPLE_LENS))
    ref_packed = torch.cat(ref)
    result["packed_vs_hf"] = float((packed - ref_packed).abs().max())
    result["logit_scale"] = float(ref_packed.abs().max())
    if tp == 1:  # a lone sample's length need not divide a sequence-parallel split
        alone = torch.cat([_megatron_logits(model, s) for s in samples])
        result["packed_vs_alone"] = float((packed - alone).abs().max())
        result["alone_vs_hf"] = float((alone - ref_packed).abs().max())


def scenario_roundtrip(arch: str, tp: int, pp: int, ep: int, result: dict, out_json: Path) -> None:
    """HF -> Megatron -> HF: every exported tensor equal (torch.equal) to the checkpoint's."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    from miles.backends import megatron_weights as mw
    path, _, model = _setup(arch, tp, pp, ep)
    with torch.no_grad():  # poison, so a parameter the load skipped cannot pass by accident
        for p in model.parameters():
            p.fill_(float("nan"))
    result["params_loaded"] = mw.load_hf_into(model, path)
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        expected = {k: f.get_tensor(k) for k in f.keys()}
    t0 = time.perf_counter()
    exported = list(mw.iter_hf_weights(model))
    result["export_s"] = time.perf_counter() - t0
    names = [n for n, _ in exported]
    result["names"] = names
    result["missing"] = sorted(set(expected) - set(names))
    result["extra"] = sorted(set(names) - set(expected))
    result["duplicates"] = len(names) - len(set(names))
    result["not_equal"] = sorted(n for n, t in exported
                                 if n in expected and not torch.equal(t, expected[n]))
    budget = 40_000
    buckets = list(mw.iter_hf_weight_buckets(model, budget))
    result["bucket_budget"] = budget
    result["buckets"] = [[(n, t.numel() * t.element_size()) for n, t in b] for b in buckets]
    out = out_json.parent / "hf_out"
    mw.save_hf(model, path, out, dtype=torch.float32, shard_bytes=200_000)
    dist.barrier()
    files = sorted(out.glob("*.safetensors"))
    result["saved_files"] = [f.name for f in files]
    saved = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            saved.update({k: st.get_tensor(k) for k in st.keys()})
    result["saved_not_equal"] = sorted(k for k in expected
                                       if k not in saved or not torch.equal(saved[k], expected[k]))
    result["saved_has_tokenizer"] = (out / "tokenizer.json").exists()


def scenario_recompute(arch: str, tp: int, pp: int, ep: int, result: dict) -> None:
    """Gradients of a packed forward/backward with selective and full activation recompute
    (megatron's CheckpointFunction, under the CPU shim's RNG stand-in) against none."""
    import torch

    from miles.backends.base import RankInfo
    from miles.backends.config import MegatronConfig, TrainConfig
    from miles.backends.megatron_model import build_gpt_model, init_parallel
    from miles.backends.megatron_weights import load_hf_into
    from miles.tiny import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(arch=arch)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (sum(SAMPLE_LENS),), generator=gen)
    grads = {}
    for mode in ("none", "selective", "full"):
        cfg = TrainConfig(backend="megatron", param_dtype="float32",
                          megatron=MegatronConfig(tp=tp, pp=pp, ep=ep, recompute=mode))
        if mode == "none":
            init_parallel(cfg, RankInfo.from_env(), timeout_s=120)
        model = build_gpt_model(path, cfg)
        load_hf_into(model, path)
        model.train()
        logits = _megatron_logits_train(model, ids, list(SAMPLE_LENS))
        logits.float().logsumexp(-1).sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for mode in ("selective", "full"):
        result[f"{mode}_max_diff"] = max(float((grads[mode][n] - g).abs().max())
                                         for n, g in grads["none"].items())
        result[f"{mode}_grads"] = len(grads[mode])
    result["none_grads"] = len(grads["none"])
    result["grad_scale"] = max(float(g.abs().max()) for g in grads["none"].values())


def _megatron_logits_train(model, ids, lens):
    import torch

    from miles.backends.megatron_model import make_packed_seq_params
    pos = torch.arange(ids.shape[0])[None]
    return model(ids[None], pos, None, packed_seq_params=make_packed_seq_params(lens))


def main() -> None:
    scenario, out_json = sys.argv[1], Path(sys.argv[2])
    kind, arch, layout = scenario.split(":")
    tp, pp, ep = (int(x) for x in layout.split(","))
    result: dict = {"rank": int(os.environ["RANK"])}
    if kind == "logits":
        scenario_logits(arch, tp, pp, ep, result)
    elif kind == "recompute":
        scenario_recompute(arch, tp, pp, ep, result)
    elif kind == "roundtrip":
        scenario_roundtrip(arch, tp, pp, ep, result, out_json)
    else:
        raise SystemExit(f"unknown scenario kind {kind!r}")
    out_json.write_text(json.dumps(result))
    from miles.backends.megatron_model import destroy_parallel
    destroy_parallel()


if __name__ == "__main__":
    main()
