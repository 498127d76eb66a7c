"""AdamW and the learning-rate schedule (linear warmup, then constant / linear / cosine decay).

Design decisions:
- The schedule is a pure function of the optimizer step count (`lr_at`); the backend sets each
  param group's lr before every step. Resuming therefore needs only the step count, not a
  scheduler object's state.
- Warmup starts above zero: step s (0-based) of warmup uses lr * (s + 1) / warmup_steps, so the very
  first update is not wasted at lr 0.
- No weight decay on 1-D parameters (norm scales, biases), as in Megatron and most LLM recipes.
- Fused AdamW on CUDA (one kernel for all parameters, works on FSDP2 DTensors); the foreach
  implementation elsewhere. `adamw_over` is the one place that choice (and optimizer offload) is
  made: the FSDP backend's model parameters and the Megatron backend's main copies both go
  through it, so the two backends step with the same kernels.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from miles.backends.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the optimizer step with 0-based index `step`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_decay_style == "constant" or cfg.lr_decay_steps == 0:
        return cfg.lr
    span = cfg.lr_decay_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def build_adamw(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return adamw_over([p for p in model.parameters() if p.requires_grad], cfg, device)


def adamw_over(params, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `params` (the FSDP model's, or the Megatron backend's main copies): weight decay
    on the >= 2-D ones, fused on CUDA, foreach elsewhere; `OffloadedAdamW` when
    train.optimizer_offload is not "none"."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    kwargs.update(lr=lr_at(0, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if cfg.optimizer_offload != "none":  # the moments live off the device, streamed per bucket
        from miles.backends.optim_offload import OffloadedAdamW
        return OffloadedAdamW(groups, offload=cfg.optimizer_offload, offload_dir=cfg.offload_dir,
                              **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
