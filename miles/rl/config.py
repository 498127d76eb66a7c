"""Recipe sections of the RL loop (mounted into `miles.config.Recipe`).

Defaults are chosen for a small GPU run; the quickstart recipe overrides what a CPU needs.

Design decisions:
- The sections of other parts live next to their code (`[engine]` in `miles/engines/config.py`,
  `[sandbox]`, `[session]`, `[agent]` likewise; the shared number types in `miles/sections.py`).
  Rules that span fields or sections (sync mode vs max_staleness, the two temperatures) live in
  `miles.config._check`; rules about the world (paths exist, import paths resolve) in
  `miles.recipe_checks`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from miles.engines.config import EngineConfig
from miles.sections import Count, NonNegative, Positive, Seconds, Section


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
    # After every train step each trainer rank snapshots its state (parameters, optimizer moments,
    # RNGs, step) into host memory kept by its node daemon (/dev/shm); a killed rank is restarted
    # and healed from it, with at most the step in flight redone, instead of a job restart from
    # the disk checkpoint (docs/recovery.md). false: a dead rank restarts the job from disk.
    snapshot: bool = True

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


class BufferConfig(Section):
    capacity_groups: Positive = 64    # at least loop.groups_per_step, or no batch ever fills
    filter: str = "none"              # "none" | "nonzero_std" | "module:function"
    policy: str = ""                  # "module:Class" subclassing miles.actors.buffer.BufferPolicy
    # a group too stale to train when its batch forms: retry its prompt, or drop it
    stale_action: Literal["retry", "drop"] = "retry"
    journal: bool = True              # journal accepted groups and slots under <output_dir>/buffer/
                                      # so a restarted buffer loses nothing it accepted
    journal_compact_records: Positive = 2000  # records between two rewrites as one snapshot


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
    # the first check's step (0: sft.check_every); a check costs a whole evaluation, wasted
    # before the warm start can solve anything
    check_from: Count = 0


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
    # draw <output_dir>/reward_curve.png at the end: sampled training reward per step and held-out pass@1
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
    # stamp every sample with its provenance (engine, version, weight digest, sampling, sandbox,
    # env and verifier, reward components, timestamps; docs/provenance.md) and write the trained
    # ones to <output_dir>/provenance.jsonl for `miles trace`
    provenance: bool = True
    # OpenTelemetry spans (docs/provenance.md): "none" (opentelemetry is not even imported),
    # "console", "file" (<output_dir>/otel_spans.jsonl) or an OTLP/HTTP endpoint URL
    # (http://host:4318, spans go to its /v1/traces); needs the `otel` extra
    otel: str = "none"
    # the fraction of traces (one per RL step, one per episode) whose spans are exported
    otel_sample_rate: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0

    def __post_init__(self) -> None:
        if self.otel not in ("none", "console", "file") and not self.otel.startswith(("http://", "https://")):
            raise ValueError(f"logging.otel: {self.otel!r} is not none, console, file or an "
                             f"http(s):// OTLP endpoint URL")
