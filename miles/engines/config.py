"""`[engine]`: the engine servers of a fleet (the embedded engine or SGLang behind the smg
gateway), their layout, and how the fleet starts, probes and restarts them. Mounted into
`miles.config.Recipe` (also as `[teacher.engine]` and `[eval.engine]`)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from miles.sections import Count, NonNegative, Positive, Seconds, Section


class EngineConfig(Section):
    # embedded: Miles' own torch engine; sglang: SGLang servers behind the smg gateway
    kind: Literal["embedded", "sglang"] = "embedded"
    # engine servers per node (each one DP replica)
    num_engines: Positive = 1
    # where the embedded engine runs (cpu, cuda, cuda:N)
    device: Annotated[str, Meta(pattern=r"^(cpu|cuda(:\d+)?)$")] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # what the embedded engine runs
    # requests one engine decodes at once (continuous batching)
    max_running_requests: Positive = 64
    context_length: Annotated[int, Meta(ge=2)] = 4096  # a prompt token and a generated one
    # torch intra-op threads of one embedded engine on CPU
    torch_threads: Positive = 1
    extra_args: list[str] = []         # the embedded engine's extra command-line flags
    # each engine server's layout (the embedded engine: tp_size only); engine i uses GPUs base_gpu_id + i*tp*dp onwards
    tp_size: Positive = 1
    # SGLang data-parallel ranks inside one engine server
    dp_size: Positive = 1
    # SGLang expert-parallel ranks inside one engine server
    ep_size: Positive = 1
    # SGLang's share of GPU memory for weights and KV cache (None: SGLang's default)
    mem_fraction_static: Annotated[float, Meta(gt=0.0, lt=1.0)] | None = None
    base_gpu_id: Count = 0            # the first GPU of this node the engines use (after the trainer's)
    sglang: dict[str, str | int | float | bool | list[str]] = {}  # any other SGLang flag, as written
    # smg's routing policy across engines (manual, consistent_hashing, ...; sessions need a sticky one)
    gateway_policy: str = "manual"
    # an engine (or smg) must answer /health within this
    start_timeout_s: Seconds = 600.0
    # how often the fleet probes every engine, smg and the session server
    health_interval_s: Seconds = 2.0
    # engine restarts per restart_window_s (more wait for room; a first start gets 1 + this
    # many tries); smg and the session server: quick deaths in a row before the fleet ends
    max_restarts: Count = 3
    # the restart budget's window; for smg and the session server a death this soon after
    # becoming ready counts as quick (crash loops, not kills)
    restart_window_s: NonNegative = 60.0
    # with no engine up (serving or pending) for this long, the fleet ends the job with one line
    no_engine_timeout_s: Seconds = 300.0
