"""Launch real SGLang servers (`python -m sglang.launch_server ...`) with passthrough arguments.

Design decisions:
- We own a handful of flags (model path, host, port, parallel sizes, memory fraction, R3,
  weight version, memory saver) because Miles must know them: the gateway needs the URL, the
  weight path needs the TP layout, R3 needs `--enable-return-routed-experts`. Everything else
  is SGLang's business and passes through from the recipe table `[engine.sglang]` unchanged,
  so a new SGLang flag never needs a Miles release.
- Passthrough rules (`procs.table_to_flags`) follow SGLang's argparse, which is generated from
  its dataclass fields (`sglang/srt/arg_groups/arg_utils.py`): `foo_bar = v` -> `--foo-bar v`; `true` -> bare
  `--foo-bar` (store_true); `false` / absent -> omitted (SGLang's default); a list ->
  `--foo-bar v1 v2` (nargs="+"); a table -> one JSON string (the `json_*` flags). A few list
  flags take one JSON string instead (`json_list_type`); write those as a string in the recipe.
- A passthrough key may not name a flag we own: two sources for one value is how a run
  silently uses the wrong port. The error names the key and the field to use instead.
- DP attention uses `--attn-dp-size N` (sglang 0.5.23; `--dp-size N --enable-dp-attention`
  is the deprecated spelling). Such an engine needs the gateway in `--dp-aware` mode.
- Every flag we emit is checked against the CLI of the sglang 0.5.23 wheel
  (tests/engines/test_sglang.py). SGLang is not importable on CPU machines, so nothing here
  imports it; a bad passthrough flag
  fails in SGLang's own argparse and the launch error quotes its log.
- One log-prob convention for both engines (embedded_engine/sampling.py): rollout log-probs are
  of the temperature-scaled distribution before top-k/top-p/min-p truncation, what the trainer
  recomputes at `train.temperature`. SGLang's sampler does that unless
  `SGLANG_RETURN_ORIGINAL_LOGPROB` is true, in which case it reports temperature-1 log-probs (it
  reads the switch once at import, `sglang/srt/layers/sampler.py`; greedy batches always report
  temperature 1). So every launch sets the switch to false in the child's environment, whatever
  the caller's environment holds: a stray export must not make the TIS / rollout-logprob ratios
  silently wrong on a cluster only.
- Lifecycle (own process group, health wait with log tail, SIGTERM then SIGKILL) is
  `procs.ServerProcess`; this file only builds the command line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from miles.engines.procs import ServerProcess, table_to_flags

SGLANG_VERSION = "0.5.23"

# Set in every SGLang child's environment (the log-prob convention above).
LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}

# Passthrough keys that would override a flag we set (and their aliases in SGLang's CLI).
_OWNED_KEYS = {
    "model_path": "model_path", "model": "model_path", "host": "host", "port": "port",
    "tp_size": "tp_size", "tensor_parallel_size": "tp_size",
    "dp_size": "dp_size", "data_parallel_size": "dp_size",
    "attn_dp_size": "attn_dp_size", "attention_data_parallel_size": "attn_dp_size",
    "enable_dp_attention": "attn_dp_size",
    "ep_size": "ep_size", "expert_parallel_size": "ep_size",
    "mem_fraction_static": "mem_fraction_static",
    "enable_return_routed_experts": "enable_routed_experts",
    "weight_version": "weight_version", "enable_memory_saver": "enable_memory_saver",
    "base_gpu_id": "base_gpu_id", "nnodes": "nnodes", "node_rank": "node_rank",
    "dist_init_addr": "dist_init_addr",
}


class SGLangServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What Miles decides about one SGLang server; `extra_args` is the recipe's passthrough."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    attn_dp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float | None = None
    enable_routed_experts: bool = False  # R3: --enable-return-routed-experts
    weight_version: str | None = None
    enable_memory_saver: bool = False  # release/resume memory when colocated with the trainer
    base_gpu_id: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of node rank 0, for multi-node engines
    extra_args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for name in ("port", "tp_size", "dp_size", "attn_dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"sglang.{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"sglang.mem_fraction_static: expected a value in (0, 1), got "
                             f"{self.mem_fraction_static!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"sglang.node_rank: expected 0 <= node_rank < nnodes={self.nnodes}, "
                             f"got {self.node_rank!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"sglang.dist_init_addr: required when nnodes={self.nnodes} > 1")
        passthrough_flags(self.extra_args)  # validate once, at construction

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def recipe_server_args(recipe, index: int, port: int) -> SGLangServerArgs:
    """Engine `index` of a recipe's fleet (`engine.kind = "sglang"`): its layout from `[engine]`,
    its GPUs after the previous engines' (base_gpu_id + index * tp * dp), `engine.context_length`,
    R3 capture when the rollout asks for routed experts."""
    cfg = recipe.engine
    return SGLangServerArgs(
        model_path=recipe.model.path, port=port, tp_size=cfg.tp_size, dp_size=cfg.dp_size,
        ep_size=cfg.ep_size, mem_fraction_static=cfg.mem_fraction_static,
        base_gpu_id=cfg.base_gpu_id + index * cfg.tp_size * cfg.dp_size,
        enable_routed_experts=recipe.rollout.return_routed_experts,
        # the context the recipe's checks bound max_new_tokens by; the table may say otherwise
        extra_args={"context_length": cfg.context_length, **cfg.sglang})


def passthrough_flags(table: Mapping[str, Any], *, section: str = "engine.sglang") -> list[str]:
    """Turn the recipe table `[engine.sglang]` into SGLang CLI flags (rules above)."""
    return table_to_flags(table, section=section, owned=_OWNED_KEYS)


def build_command(args: SGLangServerArgs, *, python: str = sys.executable) -> list[str]:
    """The full `python -m sglang.launch_server ...` command line for one server."""
    return [python, "-m", "sglang.launch_server", *server_flags(args)]


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `env` (default: ours) with the log-prob switch forced off."""
    return {**(os.environ if env is None else env), **LOGPROB_ENV}


def server_flags(args: SGLangServerArgs) -> list[str]:
    """The flags after the launcher: ours first, then the passthrough."""
    cmd = ["--model-path", args.model_path, "--host", args.host, "--port", str(args.port),
           "--tp-size", str(args.tp_size)]
    if args.dp_size > 1:
        cmd += ["--dp-size", str(args.dp_size)]
    if args.attn_dp_size > 1:
        cmd += ["--attn-dp-size", str(args.attn_dp_size)]
    if args.ep_size > 1:
        cmd += ["--ep-size", str(args.ep_size)]
    if args.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", repr(args.mem_fraction_static)]
    if args.enable_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if args.weight_version is not None:
        cmd += ["--weight-version", args.weight_version]
    if args.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if args.base_gpu_id:
        cmd += ["--base-gpu-id", str(args.base_gpu_id)]
    if args.nnodes > 1:
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                "--dist-init-addr", args.dist_init_addr]
    return cmd + passthrough_flags(args.extra_args)


class SGLangServer:
    """One SGLang server process: `start()`, `await wait_ready()`, `url`, `stop()`.

    `launcher` replaces `python -m sglang.launch_server` (tests use a stand-in that accepts the
    same flags); the flags after it are always the ones `build_command` makes.
    """

    def __init__(self, args: SGLangServerArgs, *, log_path: str | Path | None = None,
                 env: Mapping[str, str] | None = None, launcher: Sequence[str] | None = None,
                 python: str = sys.executable):
        self.args = args
        launcher = launcher or [python, "-m", "sglang.launch_server"]
        cmd = [*launcher, *server_flags(args)]
        self.process = ServerProcess(f"sglang-{args.port}", cmd, env=server_env(env), log_path=log_path)

    @property
    def url(self) -> str:
        return self.args.url

    @property
    def command(self) -> list[str]:
        return self.process.argv

    def start(self) -> SGLangServer:
        self.process.start()
        return self

    async def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Wait for `/health` (SGLang answers it with a 1-token generate, so the model works).

        Non-zero node ranks of a multi-node engine serve no HTTP; for them this only checks
        that the process is still alive.
        """
        if self.args.node_rank > 0:
            if not self.process.alive:
                raise self.process.exit_error("on a follower node rank")
            return
        await self.process.wait_healthy(self.url, timeout_s=timeout_s, path="/health")

    def stop(self, grace_s: float = 30.0) -> int | None:
        return self.process.stop(grace_s)

    async def stop_async(self, grace_s: float = 30.0) -> int | None:
        return await self.process.stop_async(grace_s)


async def launch_sglang(args: SGLangServerArgs, *, timeout_s: float = 1800.0,
                        **kwargs: Any) -> SGLangServer:
    """Start one server and wait until it is healthy; on failure nothing is left running."""
    server = SGLangServer(args, **kwargs).start()
    try:
        await server.wait_ready(timeout_s)
    except BaseException:
        await server.stop_async(grace_s=5.0)
        raise
    return server
