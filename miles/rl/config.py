"""Recipe sections of the RL loop (mounted into `miles.config.Recipe`).

Defaults are chosen for a small GPU run; the quickstart recipe overrides what a CPU needs.

Design decisions:
- Every numeric field declares its range next to it (`Annotated[int, Meta(ge=1)]`), so msgspec
  refuses a bad value at decode with the key path and the bound; `miles.config` words the message.
  Rules that span fields or sections (sync mode vs max_staleness, the two temperatures) live in
  `miles.config._check`; rules about the world (paths exist, import paths resolve) in
  `miles.recipe_checks`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]            # 0 is meaningful (none / off / the default)
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0.0)]      # every wait has a deadline; finiteness: config._check
NonNegative = Annotated[float, Meta(ge=0.0)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class LoopConfig(Section):
    # sync: generate, then train; one_step_off: generate one version ahead; fully_async: stream groups,
    # trained up to max_staleness versions late
    mode: Literal["sync", "one_step_off", "fully_async"] = "fully_async"
    num_steps: Count = 100            # 0: only the warm-start and the evaluations
    groups_per_step: Positive = 8     # prompts per training step (each gives a group of n samples)
    max_staleness: Count = 2          # fully_async: how many versions a group may lag when trained (a straggler overtaken by faster groups: one more)
    save_every: Count = 0             # checkpoint every k steps (0: only at the end)
    resume: bool = True               # continue from the newest checkpoint in the run directory
    eval_every: Count = 0             # 0: eval only at the start and the end
    timeout_s: Seconds = 600.0        # any single wait of the loop (a batch, a publish)
    # A trainer rank that dies takes its torch process group with it: the job ends with exit code
    # 75 and `miles run` starts it again from the newest checkpoint, at most this many times.
    auto_resumes: Count = 3

    @property
    def staleness(self) -> int:
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


class ModelConfig(Section):
    path: str = ""                    # HF safetensors directory
    tiny: str = ""                    # or build one offline: "qwen3" | "qwen2" | "qwen3_moe"
    # config fields of the tiny model built offline, e.g. {num_hidden_layers = 4}
    tiny_overrides: dict[str, int | float | bool | str] = {}
    tokenizer_vocab: Annotated[int, Meta(ge=256)] = 512  # the byte-level alphabet alone is 256


class DataConfig(Section):
    path: str = ""                    # .jsonl / .parquet rows with prompt, label, metadata
    # held-out rows, same format as `path` (scored greedily by `[eval]`)
    eval_path: str = ""
    sft_path: str = ""                # prompt/label rows for the supervised warm-start
    task: str = ""                    # or a built-in task ("sort_digits", "find_file", ...) or "module:function" task set
    source: str = ""                  # or "module:function" returning a DataSource
    # the row field that holds the prompt
    prompt_key: str = "prompt"
    # the row field that holds the label the reward reads
    label_key: str = "label"
    # the row field handed to the reward and the agent as metadata
    metadata_key: str = "metadata"
    # shuffle the train and SFT rows each epoch (seeded by run.seed and the epoch)
    shuffle: bool = True
    # wrap each prompt in the tokenizer's chat template
    apply_chat_template: bool = False


class RolloutConfig(Section):
    # samples per prompt: one group, the unit of GRPO's baseline
    n_samples_per_prompt: Positive = 8
    # samples generating at once across the engines
    max_inflight_samples: Positive = 64
    # generated tokens per sample (per model call for agents)
    max_new_tokens: Positive = 512
    temperature: NonNegative = 1.0    # must equal train.temperature (the trainer's log-probs)
    # nucleus sampling (1.0: off)
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1   # -1: off; 0 is refused (it would allow no token)
    # token ids that end a sample besides EOS
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = []
    # keep generating past EOS up to max_new_tokens
    ignore_eos: bool = False
    # Capture only: the engines record the experts each token was routed to, samples carry them
    # (uint8/uint16, miles.algo.routing) and the trainer measures train/routing_agreement.
    return_routed_experts: bool = False
    # R3 (routing replay): capture as above AND the trainer routes every token through the experts
    # the rollout used (old-logprob pass, training pass, recompute). Implies return_routed_experts
    # (set at load); refused for a dense model; a trained sample without routing is refused.
    r3: bool = False
    reward: str = "math"              # built-in name or "module:function"
    reward_batched: bool = False      # call the reward once per group with all its samples
    max_retries: Count = 2            # per group, for failed samples / retry decisions
    # one engine request, end to end
    request_timeout_s: Seconds = 600.0
    engine_retry_s: NonNegative = 60.0  # per request: retry transient engine/gateway errors with
                                        # back-off (0.2 s doubling to 5 s) for up to this long
    worker: str = "miles.actors.rollout:RolloutWorker"
    # The plug-in depths (miles.envs), each "module:function"; at most one of the three is set.
    # Unset: one engine call per sample (the worker's `generate_sample`).
    generate: str = ""                # async def generate(ctx, sample) -> Sample | list[Sample]
    agent: str = ""                   # async def agent(base_url, task) -> dict | None (via the session server)
    function: str = ""                # async def rollout(ctx, n_groups) -> list[Group] (one step's groups)


class AgentConfig(Section):
    """Limits of one episode (an agent run or a multi-turn generate), enforced by the framework
    and handed to agents as `task["limits"]`. A sample that hits one is marked "truncated"."""
    max_turns: Positive = 16          # model calls per episode
    max_episode_tokens: Positive = 8192  # tokens the model may generate in one episode
    turn_timeout_s: Seconds = 120.0   # one model call
    episode_timeout_s: Seconds = 600.0  # the whole episode, tools and verifier excluded
    tool_timeout_s: Seconds = 60.0    # one tool call in the sandbox
    keep: Literal["drop_retries", "all", "last"] = "drop_retries"  # which session samples to train


class SandboxConfig(Section):
    """`[sandbox]`: one fresh sandbox per episode, created before its first tool call and destroyed
    after the verifier in every outcome. A task's `metadata["image"]` overrides `image`, its
    `metadata["sandbox"]` (SandboxSpec fields: a Harbor task's Dockerfile, limits, network) goes over
    these keys for its episode (network only if both allow it), and its `metadata["files"]`
    ({path: text}) are written into the sandbox when it is created."""
    backend: str = ""                 # "" (none) | subprocess | bwrap | docker | e2b | daytona | modal | agentenv
    image: str = ""                   # default image (container and cloud backends)
    rootfs: str = ""                  # or a host directory as the root tree (subprocess, bwrap)
    # CPU cores per sandbox (where the backend enforces it)
    cpu: Annotated[float, Meta(gt=0.0, le=512.0)] = 1.0
    # memory limit per sandbox
    memory_mb: Annotated[int, Meta(ge=16)] = 1024
    # give the sandbox network access
    network: bool = False
    # a sandbox left alive this long is destroyed by the backend (a safety net; the run destroys each
    # after its episode)
    ttl_s: Annotated[float, Meta(ge=1.0, le=604800.0)] = 3600.0
    max_concurrent: Positive = 32     # live sandboxes at once (the pool's bound)
    create_rate_per_s: NonNegative = 0.0  # 0: unlimited
    options: dict[str, str | int | float | bool] = {}  # backend constructor options


class SessionConfig(Section):
    """`[session]`: the TITO session server, a supervised process in front of the gateway."""
    enabled: Literal["auto", "on", "off"] = "auto"  # auto: on when rollout.agent is set
    family: str = "qwen3"             # chat template + tool parser: qwen3 | llama3 | module:Class
    max_context_tokens: Count = 0     # 0: the model's context length
    session_ttl_s: Seconds = 3600.0   # idle sessions are dropped after this
    # how a turn's messages are matched to the session's history (prefix reuse): default, or
    # module:function
    message_matcher: str = "default"
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 << 20  # larger requests get a 413 before they are read


class BufferConfig(Section):
    capacity_groups: Positive = 64    # at least loop.groups_per_step, or no batch ever fills
    filter: str = "none"              # "none" | "nonzero_std" | "module:function"
    policy: str = ""                  # "module:Class" subclassing miles.actors.buffer.BufferPolicy
    # a group too stale to train when its batch forms: retry its prompt, or drop it
    stale_action: Literal["retry", "drop"] = "retry"
    journal: bool = True              # journal accepted groups and slots under <output_dir>/buffer/
                                      # so a restarted buffer loses nothing it accepted
    journal_compact_records: Positive = 2000  # records between two rewrites as one snapshot


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


class TeacherConfig(Section):
    """`[teacher]`: on-policy distillation's teacher on the rollout side. A frozen model served by
    engines of its own (`[teacher.engine]`, started and supervised like the policy's, never sent
    weights); the rollout worker scores every finished sample with it (the engines' prompt
    log-probs of the response tokens, `Sample.teacher_logprobs`) before the sample goes to the
    buffer, and the trainer builds no teacher. On when `path` or `tiny` is set; it replaces
    `train.teacher_model_path` (set one of the two) and needs `algo.opd_kl_coef > 0`."""
    path: str = ""                    # the teacher's HF directory (the student's vocabulary)
    tiny: str = ""                    # or build one offline, like model.tiny (model.tokenizer_vocab)
    tiny_overrides: dict[str, int | float | bool | str] = {}  # e.g. {num_hidden_layers = 4}
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)  # the teacher's engines (num_engines, device, dtype, ...)
    request_timeout_s: Seconds = 600.0  # one scoring request (transient errors are retried for rollout.engine_retry_s)


class EvalConfig(Section):
    # shared: through the rollout engines; fleet: an engine of its own on the step's weights; external:
    # eval.command; off
    mode: Literal["shared", "fleet", "external", "off"] = "shared"
    n_prompts: Count = 0              # 0: the whole eval set
    # sampling temperature of eval (0: greedy)
    temperature: NonNegative = 0.0
    max_new_tokens: Count = 0         # 0: rollout.max_new_tokens
    command: str = ""                 # external mode: run with {checkpoint} and {step} filled in
    # one whole evaluation
    timeout_s: Seconds = 600.0
    max_concurrency: Positive = 32        # eval requests in flight at once (shared and fleet modes)
    # pass@k (shared and fleet modes): episodes per prompt, n; eval/pass@1 and eval/pass@k (k = n)
    # by the unbiased estimator. n > 1 needs temperature > 0, or the n samples are one.
    samples_per_prompt: Positive = 1
    pass_threshold: float = 1.0           # a sample passes when its scalar reward is at least this


class SFTConfig(Section):
    steps: Count = 0                  # supervised warm-start steps before RL (0: none)
    # samples per warm-start step
    batch_size: Positive = 32
    # the warm-start's learning rate (RL uses train.lr)
    lr: Annotated[float, Meta(gt=0.0)] = 1e-3
    # stop the warm start once held-out eval/pass@1 of its published weights (checked every
    # sft.check_every steps, eval.mode = "shared") reaches this; sft.steps is the cap (0: off)
    until_heldout: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # warm-start steps between two held-out checks (with sft.until_heldout)
    check_every: Count = 0


class LoggingConfig(Section):
    # write metrics to <output_dir>/metrics.jsonl
    jsonl: bool = True
    # write TensorBoard event files under <output_dir>
    tensorboard: bool = False
    # log to Weights & Biases (needs wandb and its credentials)
    wandb: bool = False
    # the Weights & Biases project
    wandb_project: str = "miles"
    progress: bool = True             # a progress bar on the head's console (a TTY only)
    console_every: Positive = 10      # a one-line summary on the console every k steps
    # Prometheus /metrics on every node daemon, the dashboard on the head: 0 = cluster.head_port
    # + 1 + node rank (a free port if that one is taken), -1 = off (the URL is written to
    # <run>/metrics_url.node<rank>)
    metrics_port: Annotated[int, Meta(ge=-1, le=65535)] = 0
    # draw the reward curves to <output_dir>/rewards.png at the end
    plot: bool = True
    # the flight recorder: write every wire message of these steps to runs/<name>/wire/
    record_wire: bool = False
    # the steps the flight recorder writes (record_wire must be on); [] with record_wire: every step
    record_steps: list[Annotated[int, Meta(ge=0)]] = []
    # keep every finished rollout episode (messages, tool calls, reward, tokens, policy versions,
    # sandbox) in <output_dir>/episodes.jsonl for `miles episodes` and the dashboard's browser
    episodes: bool = True
    # the episode files' size cap: past half of it episodes.jsonl becomes episodes.1.jsonl (the
    # older one is deleted), so the two together stay under it and the newest are kept
    episodes_max_mb: Annotated[float, Meta(gt=0.0)] = 256.0
    # keep 1 in k successful episodes (reward > 0); every failed or zero-reward one is kept
    episodes_keep_success: Positive = 1
