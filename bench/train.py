"""One RL training step of a training backend (FSDP, Megatron or both): throughput, MFU, peak memory.

Prints one JSON line:
  {"bench": "train", "model", "tokens_per_s", "mfu", "peak_mem_gib", "step_s", "machine", ...}
With several backends (`--backend megatron,fsdp`) they run one after another on the same model and
batch, in the same process, and the line is {"bench": "train", "model", "machine",
"backends": {name: {the per-backend figures}}}.

- Model: Qwen2-1.5B-shaped (hidden 1536, 28 layers, 12 heads / 2 kv heads, intermediate 8960,
  vocab 151936, tied embeddings), random weights, bf16 compute over fp32 master weights. Written
  once as an HF directory under the temp dir (or --model-dir) and loaded the way a run loads it.
  `--model tiny` (the default without CUDA) is the CPU smoke test.
- Batch: GRPO groups of 8 samples with prompt:response 1:3 and varied lengths, cut so that
  `--microbatches` packed micro-batches of `--microbatch-tokens` tokens come out of the planner.
- Step: `backend.train(batch)` as a run calls it: batch checks, packing, log-probs under the current
  policy, GRPO advantages, policy loss (miles.algo), backward, grad clip, fused AdamW. With one
  optimizer step per batch the training forward's log-probs are the recomputed old log-probs;
  `--recompute-pass` adds the separate no-grad pass a multi-step batch would need.
- MFU counts the flops the step needs, against 781 TFLOP/s (bf16 dense matmul measured on H200):
  6 x (decoder params) x tokens + 6 x (LM head params) x response tokens (the head runs only on
  rows that predict a response token) + causal attention 6 x layers x heads x head_dim x len^2 per
  sample (fwd + bwd, half the square), plus 1/3 of that again with --recompute-pass.
- Timing: median of --steps steps after --warmup steps, CUDA-synchronized; peak memory after warmup.

- Megatron (`--backend megatron`): TP=1 on one device, local layer spec (no Transformer Engine),
  megatron's optimizer with fp32 main params (distributed optimizer over a DP of 1).
- `--quant-train bf16,fp8,fp8-rowwise`: each backend once per training precision (`quant.train`:
  torchao float8 with tensorwise or rowwise scales on the Linears the keep list quantizes; FSDP
  only), keyed `fsdp`, `fsdp+fp8`, `fsdp+fp8-rowwise`. MFU counts the same flops against the bf16
  limit for every precision, so FP8's figure says how much of the bf16 limit it reaches.

Usage: .venv/bin/python bench/train.py [--backend fsdp|megatron|megatron,fsdp] [--model qwen2-1.5b|tiny] [--microbatches 4]
       [--microbatch-tokens 8192] [--steps 3] [--attention packed|sdpa] [--recompute-pass]
       [--compile auto|on|off] [--no-master] [--gradient-checkpointing] [--profile FILE]
       [--quant-train bf16,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from miles.hostinfo import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_TFLOPS = 781.0
QWEN2_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  use_sliding_window=False, bos_token_id=151643, eos_token_id=151645)


def build_model_dir(name: str, root: Path) -> Path:
    if name == "tiny":
        from miles.tiny import build_tiny_model
        return build_tiny_model(arch="qwen2")
    out = root / "miles-bench-qwen2-1.5b-random"
    if (out / ".complete").exists():
        return out
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN2_1_5B)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU takes a second instead of a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / ".complete").touch()
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def make_batch(vocab: int, microbatches: int, tokens_per_mb: int, seed: int = 0):
    """Samples whose lengths add up to exactly tokens_per_mb per micro-batch (so packing is full).

    tokens_per_mb must be a power of two."""
    from miles.wire.messages import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(microbatches):
        # Split the budget in halves a few times: lengths vary (budget/2 .. budget/16) and, being a
        # divisible sequence, first-fit-decreasing packs them back into exactly full micro-batches.
        lengths = [tokens_per_mb]
        for _ in range(int(rng.integers(3, 6))):
            big = [j for j, n in enumerate(lengths) if n >= max(16, tokens_per_mb // 8)]
            j = big[int(rng.integers(len(big)))]
            lengths[j] //= 2
            lengths.append(lengths[j])
        for n in lengths:
            r = (3 * n) // 4
            samples.append(Sample(
                tokens=rng.integers(0, vocab, n).astype(np.int32), response_length=r,
                loss_mask=np.ones(r, np.uint8), rollout_logprobs=(-rng.random(r) * 3).astype(np.float32),
                reward=float(rng.random()), status="completed"))
    for i, s in enumerate(samples):
        s.group_id, s.index = f"g{i // 8}", i % 8
    return samples


def count_flops(model_dir: Path, samples, recompute_pass: bool) -> float:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    attn_params = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o and k, v projections
    bias = (heads + 2 * kv) * head_dim if c.model_type == "qwen2" else 0
    layer_params = attn_params + bias + 3 * h * inter + 2 * h
    tokens = sum(len(s.tokens) for s in samples)
    response = sum(s.response_length for s in samples)
    fwd_bwd = 6 * layers * layer_params * tokens + 6 * vocab * h * response
    fwd_bwd += 6 * layers * heads * head_dim * sum(len(s.tokens) ** 2 for s in samples)
    return fwd_bwd * (4 / 3 if recompute_pass else 1.0)


KERNEL_KINDS = (  # first match wins; by CUDA kernel name
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy/cast", ("copy", "cat", "fill", "to_copy", "memcpy", "memset")),
    ("reduce", ("reduce", "logsumexp", "softmax", "norm")),
)


def profile_step(backend, samples, path: Path, step_s: float) -> dict:
    """One step under torch.profiler: kernel time by kind, the top kernels written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.train(samples)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e6
    kinds: dict[str, float] = {}
    for name, sec in kernels.items():
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), "elementwise/other")
        kinds[kind] = kinds.get(kind, 0.0) + sec
    busy = sum(kernels.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(f"step_s {step_s:.4f}  kernel_s {busy:.4f}\n")
        for kind, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
            f.write(f"{kind:20s} {sec:8.4f} s  {sec / step_s:6.1%} of step\n")
        f.write("\n")
        for name, sec in sorted(kernels.items(), key=lambda kv: -kv[1])[:60]:
            f.write(f"{sec * 1e3:9.2f} ms  {name[:160]}\n")
        f.write("\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    return {"kernel_s": round(busy, 4), "kernel_s_by_kind": {k: round(v, 4) for k, v in kinds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fsdp",
                    help="fsdp, megatron, or a comma list run one after another (one JSON line)")
    ap.add_argument("--model", choices=["qwen2-1.5b", "tiny"],
                    default="qwen2-1.5b" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--attention", choices=["packed", "sdpa"], default="packed")
    ap.add_argument("--recompute-pass", action="store_true")
    ap.add_argument("--no-master", action="store_true", help="bf16 params, no fp32 master copy")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="train.compile (auto: the backend's default, on with CUDA)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="after timing, profile one more step; kernel table written to this file")
    ap.add_argument("--quant-train", default="bf16",
                    help="comma list of bf16, fp8 (torchao tensorwise), fp8-rowwise (FSDP only)")
    args = ap.parse_args()
    tokens_per_mb = args.microbatch_tokens or (8192 if args.model != "tiny" else 512)
    if tokens_per_mb & (tokens_per_mb - 1):
        ap.error(f"--microbatch-tokens={tokens_per_mb} must be a power of two")
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)) if torch.cuda.is_available() else 1)

    names = [n.strip() for n in args.backend.split(",") if n.strip()]
    if not names or any(n not in ("fsdp", "megatron") for n in names):
        ap.error(f"--backend={args.backend!r}: expected fsdp, megatron or a comma list of them")
    quants = [q.strip() for q in args.quant_train.split(",") if q.strip()]
    if not quants or any(q not in ("bf16", "fp8", "fp8-rowwise") for q in quants):
        ap.error(f"--quant-train={args.quant_train!r}: expected bf16, fp8, fp8-rowwise or a comma list")
    if "megatron" in names and quants != ["bf16"]:
        ap.error("--quant-train: FP8 training is FSDP-only (quant.train is refused on Megatron)")
    model_dir = build_model_dir(args.model, args.model_dir)
    results = {(name if q == "bf16" else f"{name}+{q}"): run_backend(name, args, model_dir, tokens_per_mb, q)
               for name in names for q in quants}
    if len(results) == 1:
        print(json.dumps({"bench": "train", "backend": names[0], **next(iter(results.values()))}))
    else:
        print(json.dumps({"bench": "train", "model": args.model, "machine": machine(), "backends": results}))


def run_backend(name: str, args, model_dir: Path, tokens_per_mb: int, quant: str = "bf16") -> dict:
    from miles.algo import LossConfig
    from miles.backends import RankInfo, TrainConfig, make_backend
    from miles.quant.config import QuantConfig
    from miles.quant.train import training_transform

    cuda = torch.cuda.is_available()
    cfg = TrainConfig(backend=name, model_path=str(model_dir), param_dtype="bfloat16" if cuda else "float32",
                      master_weights_fp32=not args.no_master, lr=1e-6,
                      max_tokens_per_microbatch=tokens_per_mb, attention=args.attention,
                      old_logprobs="recompute" if args.recompute_pass else "auto",
                      gradient_checkpointing=args.gradient_checkpointing,
                      compile={"auto": None, "on": True, "off": False}[args.compile])
    backend = make_backend(name)
    if quant != "bf16":  # what the trainer actor does for quant.train (before init builds the model)
        backend.lm_transform = training_transform(QuantConfig(
            train="fp8", fp8_recipe="rowwise" if quant == "fp8-rowwise" else "tensorwise"))
    backend.init(cfg, RankInfo(), LossConfig(advantage_estimator="grpo"))
    vocab = backend.vocab_size
    samples = make_batch(vocab, args.microbatches, tokens_per_mb)

    times, metrics = [], {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = backend.train(samples)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    profile = {}
    if args.profile and cuda:
        tag = name if quant == "bf16" else f"{name}+{quant}"
        path = args.profile if len(args.backend.split(",")) == 1 and args.quant_train == "bf16" \
            else args.profile.with_suffix(f".{tag}.txt")
        profile = profile_step(backend, samples, path, step_s)
    tokens = sum(len(s.tokens) for s in samples)
    flops = count_flops(model_dir, samples, args.recompute_pass)
    from miles.backends import attention as packed_attention
    result = {
        "model": args.model, "tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(flops / step_s / (PEAK_TFLOPS * 1e12), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "step_s": round(step_s, 4), "machine": machine(),
        "tokens_per_step": tokens, "microbatches": int(metrics.get("microbatches", 0)) or None,
        "microbatch_tokens": tokens_per_mb, "tflops_per_step": round(flops / 1e12, 2),
        "attention": args.attention + ("+varlen" if packed_attention._varlen_fn is not None else ""),
        "recompute_pass": args.recompute_pass, "master_fp32": not args.no_master, "quant_train": quant,
        "compile": getattr(backend, "use_compile", None),
        "loss": round(metrics["loss"], 6), "grad_norm": round(metrics["grad_norm"], 4),
        **profile,
    }
    backend.close()
    del backend
    if cuda:
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    main()
