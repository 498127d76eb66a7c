"""Recipe sections of the RL loop (mounted into `miles.config.Recipe`).

Defaults are chosen for a small GPU run; the quickstart recipe overrides what a CPU needs.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class LoopConfig(Section):
    mode: Literal["sync", "one_step_off", "fully_async"] = "fully_async"
    num_steps: int = 100
    groups_per_step: int = 8          # prompts per training step (each gives a group of n samples)
    max_staleness: int = 2            # fully_async: how many versions a group may lag when trained
    save_every: int = 0               # checkpoint every k steps (0: only at the end)
    resume: bool = True               # continue from the newest checkpoint in the run directory
    eval_every: int = 0               # 0: eval only at the start and the end
    timeout_s: float = 600.0          # any single wait of the loop (a batch, a publish)

    @property
    def staleness(self) -> int:
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


class ModelConfig(Section):
    path: str = ""                    # HF safetensors directory
    tiny: str = ""                    # or build one offline: "qwen3" | "qwen2" | "qwen3_moe"
    tiny_overrides: dict[str, int | float | bool | str] = {}
    tokenizer_vocab: int = 512


class DataConfig(Section):
    path: str = ""                    # .jsonl / .parquet rows with prompt, label, metadata
    eval_path: str = ""
    sft_path: str = ""                # prompt/label rows for the supervised warm-start
    task: str = ""                    # or a built-in synthetic task: "sort_digits" | "addition"
    source: str = ""                  # or "module:function" returning a DataSource
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    shuffle: bool = True
    apply_chat_template: bool = False


class RolloutConfig(Section):
    n_samples_per_prompt: int = 8
    max_inflight_samples: int = 64
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    return_routed_experts: bool = False  # R3: record the experts each token was routed to
    reward: str = "math"              # built-in name or "module:function"
    reward_batched: bool = False      # call the reward once per group with all its samples
    max_retries: int = 2              # per group, for failed samples / retry decisions
    request_timeout_s: float = 600.0
    engine_retry_s: float = 60.0      # per request: retry transient engine/gateway errors with
                                      # back-off (0.2 s doubling to 5 s) for up to this long
    worker: str = "miles.actors.rollout:RolloutWorker"


class BufferConfig(Section):
    capacity_groups: int = 64
    filter: str = "none"              # "none" | "nonzero_std" | "module:function"
    policy: str = ""                  # "module:Class" subclassing miles.actors.buffer.BufferPolicy
    stale_action: Literal["retry", "drop"] = "retry"
    journal: bool = True              # journal accepted groups and slots under <output_dir>/buffer/
                                      # so a restarted buffer loses nothing it accepted
    journal_compact_records: int = 2000  # rewrite the journal as one snapshot after this many records


class EngineConfig(Section):
    kind: Literal["embedded", "sglang"] = "embedded"
    num_engines: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 64
    context_length: int = 4096
    torch_threads: int = 1
    extra_args: list[str] = []
    sglang: dict[str, str | int | float | bool | list[str]] = {}
    gateway_policy: str = "manual"
    start_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    max_restarts: int = 3             # quick deaths in a row before an engine (or smg) is given up
    restart_window_s: float = 60.0    # a death this soon after becoming ready counts as quick; a
                                      # longer life starts the count again (crash loops, not kills)


class EvalConfig(Section):
    mode: Literal["shared", "fleet", "external", "off"] = "shared"
    n_prompts: int = 0                # 0: the whole eval set
    temperature: float = 0.0
    max_new_tokens: int = 0           # 0: rollout.max_new_tokens
    command: str = ""                 # external mode: run with {checkpoint} and {step} filled in
    timeout_s: float = 600.0
    max_concurrency: int = 32         # eval requests in flight at once (shared and fleet modes)


class SFTConfig(Section):
    steps: int = 0                    # supervised warm-start steps before RL (0: none)
    batch_size: int = 32
    lr: float = 1e-3


class LoggingConfig(Section):
    jsonl: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "miles"
    progress: bool = True
    plot: bool = True
