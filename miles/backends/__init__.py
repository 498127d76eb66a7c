"""Training backends behind one contract (base.py: six core members, three optional, and the
`Offloadable` protocol); `make_backend(name)` picks one.

    from miles.backends import TrainConfig, RankInfo, make_backend
    backend = make_backend(cfg.backend)          # "fsdp" | "megatron"
    backend.init(cfg, RankInfo.from_env(), loss_cfg)
    metrics = backend.train(samples)             # the whole step batch, on every rank
    metrics = backend.train(step.samples, index=step.index)  # or this rank's shard (loop.shard_batch)
    backend.train(samples, TrainPhase("sft", sft_loss, sft_cfg))  # another phase: its own optimizer
    backend.update_weights(transport, version)
    backend.save_model(path) / backend.load_model(path) / backend.save_model(path, hf=True)
    backend.sleep(); backend.wake_up()           # Offloadable (train.sleep_between_steps)

The FSDP backend also offers `iter_hf_weight_buckets(bucket_bytes)` (full tensors under HF names),
and `miles.backends.hf_weights.iter_hf_weight_buckets(model, ...)` for any HF module.
"""

import importlib

# Lazy (PEP 562): the recipe loader reads `miles.backends.config` in every process; torch is
# only imported where a backend actually runs.
_EXPORTS = {"RankInfo": "base", "TrainPhase": "base", "TrainingBackend": "base", "make_backend": "base",
            "TrainConfig": "config"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(f"miles.backends.{module}"), name)

__all__ = ["RankInfo", "TrainConfig", "TrainPhase", "TrainingBackend", "make_backend"]
