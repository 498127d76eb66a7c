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

import logging
import os
import sys
from pathlib import Path

from miles.engines.embedded_engine.args import build_parser


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
        from miles.engines.embedded_engine.shapes import check_tp_split, load_hf_config, shape_from_config
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
