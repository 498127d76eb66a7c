"""The embedded engine's command line (`python -m miles.engines.embedded`), shared by rank 0 and
the tensor-parallel worker ranks (tp.py), which parse the same flags."""

from __future__ import annotations

import argparse


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles.engines.embedded",
                                description="Miles embedded engine (SGLang native HTTP API)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: from memory)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: do not read the checkpoint's weights (config.json only); they stay "
                        "zero until a weight update (benchmarks of the update paths)")
    p.add_argument("--quantization", default=None,
                   choices=["fp8", "mxfp8", "mxfp4", "nvfp4", "int4", "int4_asym"],
                   help="weight updates arrive quantized (SGLang names); dequantized on load, "
                        "matmuls emulated in --dtype (miles/engines/embedded_engine/quantized.py), "
                        "except what --fp8-gemm runs in FP8")
    p.add_argument("--fp8-gemm", default="off", choices=["auto", "on", "off"],
                   help="with --quantization fp8: keep the dense linears' FP8 weights and block "
                        "scales and run FP8 block-wise GEMMs (torch scaled_mm) for them; auto: on "
                        "when a CUDA device in bfloat16 passes the GEMM probe, else emulated; on: "
                        "refuse to start without it. Off by default: on an H200 it halves the "
                        "weights' bytes but decodes at 0.6-0.7x the bf16 speed (bench/quant.py --engine)")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--cuda-graph-precapture-kv", type=int, default=1024,
                   help="capture every batch size's decode graph at start-up for kv lengths up to "
                        "this (0: capture each lazily, on first use)")
    p.add_argument("--decode-kernels", choices=("auto", "triton", "torch"), default="torch",
                   help="triton: the fused decode kernels (kernels.py; dense models, refuse to start "
                        "without them); torch: the op-by-op path; auto: triton on CUDA where they "
                        "apply, else torch. Default torch until the fused kernels are measured on a "
                        "card (tests/gpu/test_engine_decode_gpu.py, bench/engine.py --decode-kernels)")
    p.add_argument("--prefill-attention", choices=("auto", "varlen", "sdpa"), default="auto",
                   help="sdpa: causal SDPA over right-padded sequences; varlen: FlashAttention "
                        "varlen (CUDA, bf16/fp16; refuse to start without it); auto: sdpa, or varlen "
                        "where it works and padding would more than double a batch's work")
    p.add_argument("--mem-fraction-kv", type=float, default=0.5,
                   help="fraction of free device memory for the KV pool when --max-total-tokens is unset")
    p.add_argument("--torch-threads", type=int, default=2, help="intra-op CPU threads")
    p.add_argument("--delta-staging", choices=("auto", "dense", "sparse"), default="auto",
                   help="where a disk delta waits between prepare and apply: auto: whole tensors on "
                        "the GPU if they fit, else only the changed elements there, else whole "
                        "tensors on the host; dense: never sparse; sparse: the changed elements "
                        "wherever the delta allows (on a CPU engine too)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks: this process is rank 0 and starts the others "
                        "(CPU: gloo; cuda: rank r on GPU device+r, NCCL)")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--log-level", default="info")
    p.add_argument("--prefill-interval-steps", type=int, default=4,
                   help="while requests decode, prefill new arrivals only every N decode steps "
                        "(or once max(8, running/4) wait): fewer, larger prefills (0: at once)")
    p.add_argument("--inline-steps", choices=("auto", "all", "prefill", "none"), default="auto",
                   help="which steps run on the event loop rather than the compute thread "
                        "(auto: all on CPU, none on CUDA)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every request prefills its whole input (SGLang's flag)")
    p.add_argument("--prefix-cache-max-share", type=_share, default=0.5,
                   help="the prefix cache holds at most this share of the KV pool (0 to 1)")
    limits = p.add_argument_group("request limits (per /generate call; over one is a 400)")
    limits.add_argument("--max-n", type=_positive_int, default=64, help="sampling_params.n")
    limits.add_argument("--max-batch-size", type=_positive_int, default=1024,
                        help="requests one call fans out to: prompts x n")
    limits.add_argument("--max-top-logprobs-num", type=_positive_int, default=64, help="top_logprobs_num")
    limits.add_argument("--max-prompt-logprob-tokens", type=_positive_int, default=4096,
                        help="prompt positions with logprobs (logprob_start_len); each costs a "
                             "vocabulary-wide fp32 logits row")
    limits.add_argument("--max-stop", type=_positive_int, default=64,
                        help="entries of stop, of stop_token_ids and of logit_bias (each is "
                             "matched or applied on every decode step)")
    p.add_argument("--log-stats-interval-s", type=float, default=30.0,
                   help="an INFO line of decode/prefill/pause time and tokens/s this often (0: never)")
    return p
