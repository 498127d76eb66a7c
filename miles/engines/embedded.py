"""The embedded engine: our own small torch engine serving SGLang's native HTTP API.

Start it (one process per engine; the model is an HF safetensors directory):

    python -m miles.engines.embedded --model-path DIR --host 127.0.0.1 --port N \
        [--device cpu|cuda] [--dtype float32|bfloat16] [--max-running-requests N] \
        [--max-total-tokens N] [--context-length N] [--enable-return-routed-experts] \
        [--weight-version default] [--served-model-name NAME] [--random-seed N] \
        [--tp-size N] [--max-prefill-tokens N] [--disable-cuda-graph] [--cuda-graph-max-bs N] [--torch-threads N] \
        [--cuda-graph-precapture-kv N] [--prefill-interval-steps N] [--log-stats-interval-s S] \
        [--prefill-attention auto|varlen|sdpa] [--load-format auto|safetensors|dummy] \
        [--quantization FMT] [--fp8-gemm auto|on|off] \
        [--inline-steps auto|all|prefill|none] \
        [--max-n 64] [--max-batch-size 1024] [--max-top-logprobs-num 64] \
        [--max-prompt-logprob-tokens 4096] [--max-stop 64] \
        [--mem-fraction-kv F] [--log-level info]

The `--max-*` limits bound what one `/generate` call may ask for (a 400 naming the field, the
value and the limit, before any work): `--max-n` samples per prompt, `--max-batch-size` requests
per call (prompts x n), `--max-top-logprobs-num` top logprobs per position,
`--max-prompt-logprob-tokens` prompt positions with logprobs, `--max-stop` entries of `stop`,
`stop_token_ids` and `logit_bias`. Token counts are bounded by the context length and the KV
pool (embedded_engine/server.py).

It is ready when `GET /health` answers 200 (the port opens only after the model is loaded). smg
registers it like an SGLang worker (`/server_info`, `/model_info`, `/v1/models`, `dp_size: 1`).
From Python, `await launch_embedded_engine(model_path, extra_args=[...])` starts one as a child
process (miles.engines.procs.ServerProcess) on a free loopback port and waits for /health;
`EmbeddedEngine.stop()` ends it.

Design decisions (details in miles/engines/embedded_engine/*):
- Real generation, not a mock: a Qwen-family forward over HF weights (Qwen2, Qwen3, Qwen3-MoE,
  Llama; fp32/bf16; CPU/CUDA) whose fp32 logits match transformers within 1e-5 (model.py), a
  token-slot KV pool (kv_cache.py), continuous batching with retraction (scheduler.py), seeded
  per-request sampling (sampling.py), CUDA graphs for dense decode (runner.py), a prefix cache
  over token ids that keeps finished requests' KV for the next turn of a session
  (prefix_cache.py; on by default, `--disable-radix-cache` as in SGLang).
- Logprobs are `log_softmax(logits / temperature)` (the temperature-scaled distribution,
  before top-k/top-p/min-p and masking; temperature 1 for greedy requests) of the forward the
  token was sampled from: what the trainer recomputes at `train.temperature`. The SGLang launcher
  makes SGLang report the same (sampling.py and sglang.py explain why). Prompt logprobs
  (`logprob_start_len`) are temperature 1, as SGLang's are.
- Weight updates: `/update_weights_from_disk`, `/update_weights_from_tensor` (base64 safetensors,
  never pickle), `/init_weights_update_group` + `/update_weights_from_distributed` (gloo on CPU,
  NCCL on CUDA; the trainer's rank 0 broadcasts; `load_format: "flattened_bucket"` receives one
  flat buffer per call, pipelined), `/update_weight_version`; plus our extensions
  `/weights_checksum`, `/update_weights_from_delta` (disk-delta, delta.py) and CUDA IPC buckets
  (`load_format: "miles_cuda_ipc"`, weights.py). `--load-format dummy` skips the checkpoint's
  weights (benchmarks of the update paths).
- Tensor parallelism (`--tp-size N`, embedded_engine/tp.py): this process is TP rank 0 (HTTP,
  scheduler, sampling) and starts ranks 1..N-1, each holding only its slices (miles.weights.p2p's
  TP_RULES; MoE experts by EP over the same ranks); each step rank 0 broadcasts the step's inputs
  and every rank runs the same forward (all-reduce after o_proj / down_proj / experts, the
  vocab-parallel logits all-gathered). gloo on CPU, NCCL on CUDA; CUDA graphs are off at tp > 1.
  Weight updates at tp > 1: `/update_weights_from_disk` (each rank its slices of the files) and
  the P2P transfer (`/init_p2p_group` + `/update_weights_from_p2p`, p2p_routes.py: each rank
  receives its slices from the trainer ranks); `/weights_checksum` gathers each full tensor to
  rank 0 and hashes it there, so digests equal a tp=1 engine's. The one-rank update paths
  (tensor, distributed, delta, CUDA IPC) answer 400 at tp > 1.
- What it does not do: data parallelism (dp_size = 1: run several engines behind smg),
  grammars, penalties, speculative decoding, LoRA, multimodal input; those get a 400 that says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


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


def build_server(args):
    """Load the model and return the EngineServer (no sockets yet). At --tp-size N > 1 this
    process is TP rank 0: it starts ranks 1..N-1 (embedded_engine/tp.py) and joins them."""
    import torch

    from miles.engines.embedded_engine.runner import ModelRunner, runner_config
    from miles.engines.embedded_engine.server import EngineServer

    if args.dp_size != 1:
        raise SystemExit(f"--dp-size {args.dp_size}: the embedded engine runs one data-parallel "
                         "rank; start several engines behind smg instead")
    if args.tp_size < 1:
        raise SystemExit(f"--tp-size {args.tp_size}: expected an integer >= 1")
    torch.set_num_threads(max(1, args.torch_threads))
    tp = workers = None
    device = args.device
    if args.tp_size > 1:
        from miles.engines.embedded_engine import tp as TP
        from miles.engines.embedded_engine.model import check_tp_split, load_hf_config, shape_from_config
        if args.quantization:
            raise SystemExit(f"--quantization {args.quantization} with --tp-size {args.tp_size}: "
                             "quantized updates are wired for one rank only")
        try:  # refuse a model that does not split before starting any worker
            check_tp_split(shape_from_config(load_hf_config(args.model_path)), args.tp_size)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        from miles.engines.procs import free_port
        port = free_port()
        workers = TP.Workers(list(getattr(args, "argv", None) or sys.argv[1:]), args.tp_size,
                             port).start()
        device = TP.rank_device(args.device, 0)
        try:
            tp = TP.join_tp_group(0, args.tp_size, port, device)
        except BaseException:
            workers.stop()
            raise
    runner = ModelRunner(args.model_path, runner_config(args, device), tp=tp)
    tokenizer = None
    if not args.skip_tokenizer_init:
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        except Exception as e:  # a model dir without a tokenizer still serves input_ids
            logging.getLogger(__name__).warning("no tokenizer (%s); serving input_ids only", e)
    server = EngineServer(runner, tokenizer, args)
    server.tp_workers = workers
    return server


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what TP workers are started with
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        import torch
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    from aiohttp import web
    server = build_server(args)
    logging.getLogger(__name__).info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True, shutdown_timeout=0.5)


# ---- launching from Python (tests, quickstart) -----------------------------------------------

def embedded_argv(model_path: str | Path, *, host: str = "127.0.0.1", port: int,
                  extra_args: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "miles.engines.embedded", "--model-path", str(model_path),
            "--host", host, "--port", str(port), *(extra_args or [])]


class EmbeddedEngine:
    """A running engine child process (a `ServerProcess`) and its URL."""

    def __init__(self, process, host: str, port: int):
        self.process, self.host, self.port = process, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, grace_s: float = 10.0) -> None:
        self.process.stop(grace_s)

    async def stop_async(self, grace_s: float = 10.0) -> None:
        await self.process.stop_async(grace_s)


async def launch_embedded_engine(model_path: str | Path, *, host: str = "127.0.0.1",
                                 port: int | None = None, extra_args: list[str] | None = None,
                                 log_path: str | Path | None = None, ready_timeout_s: float = 120.0,
                                 env: dict | None = None) -> EmbeddedEngine:
    """Start `python -m miles.engines.embedded` on a free loopback port; wait for /health."""
    from miles.engines.procs import ServerProcess, free_port
    port = port or free_port(host)
    proc = ServerProcess(f"embedded-{port}", embedded_argv(model_path, host=host, port=port,
                                                           extra_args=extra_args),
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                         log_path=log_path).start()
    engine = EmbeddedEngine(proc, host, port)
    try:
        await proc.wait_healthy(engine.url, timeout_s=ready_timeout_s)
    except BaseException:
        await proc.stop_async(grace_s=2.0)
        raise
    return engine


if __name__ == "__main__":
    main()
