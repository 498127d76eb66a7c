"""The PPO critic: a value model trained alongside the policy inside the same `train` call (FSDP).

Design decisions:
- The value model is the policy's decoder (`train.critic_model_path`, or the policy's own
  checkpoint) with its LM head dropped and a scalar head on the last hidden state. Tied embeddings
  stay in the decoder, so the critic never shares a tensor with the policy.
- A value per response token, read at the same rows that predict the response tokens (the state
  before the token is emitted): `values[t]` lines up with `logprobs[t]` and the algo's token layout,
  so GAE, the clipped value loss and the reductions take them as they are.
- The head starts at zero: every value is 0 before the first update, so explained variance starts
  at 0 and the first advantages are the plain (discounted) returns.
- Without `train.critic_model_path` the decoder is copied from the policy at the first RL call
  (`start_from`; with `train.lora`, the merged weights the engines serve, as the critic is always a
  dense model), so it starts from what the policy knows after any SFT warm-start, as PPO's
  critics start from the SFT model; a random-init decoder learned nothing in the quickstart's 60
  steps (explained variance ~0.02). A resumed critic is never overwritten.
- Sharded like the policy (fully_shard per decoder layer plus the root, the same mesh and mixed
  precision) and trained with its own AdamW: `train.critic_lr`, `critic_warmup_steps`,
  `critic_lr_decay_style`, `critic_lr_decay_steps` (betas, eps, weight decay and gradient
  clipping are the policy's). Its step count is its own, checkpointed beside the policy's.
- Order inside `train`: values with the pre-update critic (no grad) -> GAE (algo) -> for each
  optimizer step the policy steps, then the critic steps on the same micro-batches against the
  returns, clipped around those pre-update values (`algo.value_clip`). Explained variance compares
  the pre-update values with the returns over every rank's trained tokens (1 - Var(R - V) / Var(R)).
- Checkpoints: `save` writes `<checkpoint>/critic/` (the same DCP format as the policy) BEFORE the
  policy's COMPLETE marker is written, so a checkpoint that reads complete always has its critic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from miles.algo import LossConfig, compute_value_loss
from miles.backends.checkpoint import load_checkpoint, save_checkpoint
from miles.backends.config import TrainConfig
from miles.backends.optim import build_adamw, lr_at, set_lr
from miles.backends.packing import PackedMicroBatch
from miles.backends.policy import PackedInputs

CRITIC_DIR = "critic"


def critic_schedule(cfg: TrainConfig) -> TrainConfig:
    """The TrainConfig whose lr / schedule fields are the critic's (what build_adamw and lr_at read)."""
    return msgspec.structs.replace(
        cfg, lr=cfg.critic_lr, min_lr=min(cfg.min_lr, cfg.critic_lr), warmup_steps=cfg.critic_warmup_steps,
        lr_decay_style=cfg.critic_lr_decay_style, lr_decay_steps=cfg.critic_lr_decay_steps)


def uses_critic(loss: LossConfig) -> bool:
    return loss.loss_type == "policy" and loss.advantage_estimator == "ppo"


class ValueModel(nn.Module):
    """Decoder + scalar head; the FSDP root (as PackedPolicy is, for the same reason)."""

    def __init__(self, decoder: nn.Module, hidden_size: int, *, packed_attention: bool):
        super().__init__()
        self.decoder = decoder
        self.value_head = nn.Linear(hidden_size, 1, dtype=next(decoder.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.packed_attention = packed_attention

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                seq_bounds: tuple[int, ...], max_seqlen: int, logprob_rows: torch.Tensor) -> torch.Tensor:
        """-> float32 [R]: the value of the state before each response token."""
        kwargs = {}
        if self.packed_attention:
            kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
                          max_length_k=max_seqlen, miles_seq_bounds=seq_bounds)
        out = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        hidden = out.last_hidden_state[0].index_select(0, logprob_rows)
        # sum over the size-1 axis, not squeeze: FSDP2 warns on a root output that is a view
        return self.value_head(hidden).sum(-1).float()

    def run(self, batch: PackedInputs) -> torch.Tensor:
        return self(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.seq_bounds,
                    batch.max_seqlen, batch.logprob_rows)


class Critic:
    """The value model, its optimizer and step count, on one trainer rank (calls are collectives)."""

    def __init__(self, model: ValueModel, cfg: TrainConfig, device: torch.device, world_size: int):
        self.model, self.device, self.world_size = model, device, world_size
        self.cfg = critic_schedule(cfg)
        self.optimizer = build_adamw(model, self.cfg, device)
        self.step = 0
        self.from_policy = not cfg.critic_model_path  # copy the policy's decoder at the first RL call

    @classmethod
    def build(cls, cfg: TrainConfig, *, mesh, device: torch.device, compute_dtype: torch.dtype,
              reduce_dtype: torch.dtype, attn_implementation: str, reshard: bool,
              world_size: int) -> "Critic":
        from transformers import AutoModelForCausalLM

        path = cfg.critic_model_path or cfg.model_path
        master = torch.float32 if cfg.master_weights_fp32 else compute_dtype
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=master, attn_implementation=attn_implementation)
        lm.config.use_cache = False
        if cfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = ValueModel(lm.model, int(lm.config.hidden_size), packed_attention=cfg.attention == "packed")
        model.train()
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype if master != compute_dtype else None,
                                  reduce_dtype=reduce_dtype)
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        return cls(model, cfg, device, world_size)

    @torch.no_grad()
    def start_from(self, policy_decoder: nn.Module) -> None:
        """Copy the policy's decoder into the critic's (once, before the first RL step; collective).

        With train.lora the policy's adapted linears are peft wrappers (`q_proj.base_layer.weight`
        plus lora_A / lora_B): the critic, a dense model, starts from their merge
        W + (alpha / rank) * B @ A, the weights the engines serve (equal to the base while B is
        peft's initial zero, not after a LoRA SFT warm-start). Unadapted parameters are sharded
        the same way over the same mesh, so each rank copies its own shards."""
        if not self.from_policy:
            return
        from miles.backends.lora import merged_hf_parameters

        mine = dict(self.model.decoder.named_parameters())
        copied = set()
        for name, src in merged_hf_parameters(policy_decoder):  # every rank iterates to the end
            dst = mine.get(name)
            if dst is None:
                continue
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"critic: the policy's decoder parameter {name!r} has shape "
                                 f"{tuple(src.shape)}; the critic's has {tuple(dst.shape)}")
            _copy_into(dst, src)
            copied.add(name)
        missing = sorted(set(mine) - copied)
        if missing:
            raise ValueError(f"critic: the policy's decoder has no parameter {missing[0]!r} of shape "
                             f"{tuple(mine[missing[0]].shape)} to start from ({len(missing)} missing)")
        self.from_policy = False

    @torch.no_grad()
    def values(self, mbs: list[PackedMicroBatch]) -> list[torch.Tensor]:
        """The pre-update values of every micro-batch (dummies included: they keep ranks in step)."""
        out = [self.model.run(mb.inputs) for mb in mbs]
        _reshard(self.model)
        return out

    def train_step(self, mbs: list[PackedMicroBatch], old_values: list[torch.Tensor],
                   returns: list[torch.Tensor], denominators: dict[int, float],
                   loss_cfg: LossConfig) -> dict[str, torch.Tensor | float]:
        """One critic optimizer step over this rank's micro-batches of one policy step.

        Returns metric partial sums (value_loss, value_clipfrac) to all-reduce with the policy's,
        and this rank's critic_grad_norm / critic_lr (the same on every rank)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for mb, old, ret in zip(mbs, old_values, returns):
            values = self.model.run(mb.inputs)
            den = torch.tensor([denominators[i] for i in mb.sample_indices] or [1.0], dtype=torch.float64,
                               device=self.device)
            loss, metrics = compute_value_loss(values, old_values=old, returns=ret, loss_mask=mb.loss_mask,
                                               sample_denominators=den, cfg=loss_cfg,
                                               cu_seqlens=mb.response_cu_seqlens)
            (loss * self.world_size).backward()  # FSDP averages gradients over ranks: make it a sum
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach().double()
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = lr_at(self.step, self.cfg)
        if np.isfinite(norm):  # as the policy: a non-finite gradient is skipped, not applied
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "critic_grad_norm": norm, "critic_lr": lr,
                "critic_skipped_steps": float(not np.isfinite(norm))}

    def save(self, path: str | Path) -> None:
        _reshard(self.model)
        save_checkpoint(Path(path) / CRITIC_DIR, self.model, self.optimizer, step=self.step)

    def load(self, path: str | Path) -> None:
        root = Path(path) / CRITIC_DIR
        if not (root / "COMPLETE").exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} has no complete critic/ directory: it was "
                                    "saved without algo.advantage_estimator = 'ppo'; a PPO run cannot resume "
                                    "from it with a fresh critic silently")
        _reshard(self.model)
        self.step = int(load_checkpoint(root, self.model, self.optimizer)["step"])
        self.from_policy = False

    def device_tensors(self) -> Iterator[torch.Tensor]:
        """What sleep() moves off the device: parameters, gradients, buffers and Adam state."""
        _reshard(self.model)  # the shards are what stays registered; unsharded copies would be missed
        for p in self.model.parameters():
            yield _local(p)
            if p.grad is not None:
                yield _local(p.grad)
        yield from self.model.buffers()
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield _local(value)


def explained_variance(values: list[torch.Tensor], returns: list[torch.Tensor], masks: list[torch.Tensor],
                       device: torch.device) -> float:
    """1 - Var(R - V) / Var(R) over every rank's trained tokens (one all-reduce); 0 when Var(R) = 0."""
    moments = torch.zeros(5, dtype=torch.float64, device=device)
    for v, r, m in zip(values, returns, masks):
        keep = m != 0
        rk, dk = r[keep].double(), (r[keep] - v[keep]).double()
        moments += torch.stack([keep.sum().double(), rk.sum(), (rk * rk).sum(), dk.sum(), (dk * dk).sum()])
    dist.all_reduce(moments)
    n, sr, srr, sd, sdd = moments.tolist()
    if n < 2:
        return 0.0
    var_r = srr / n - (sr / n) ** 2
    var_d = sdd / n - (sd / n) ** 2
    return 0.0 if var_r <= 1e-12 else 1.0 - var_d / var_r


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (a shard laid out as `dst`, or a whole tensor) into the parameter `dst`."""
    if hasattr(src, "to_local") and hasattr(dst, "to_local") and (src.device_mesh, src.placements) == (
            dst.device_mesh, dst.placements):
        dst.to_local().copy_(src.to_local())
    elif hasattr(dst, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        full = src.full_tensor() if hasattr(src, "full_tensor") else src
        # every rank holds the same whole tensor, so each keeps its own rows without communication
        dst.to_local().copy_(distribute_tensor(full.to(dst.dtype), dst.device_mesh, dst.placements,
                                               src_data_rank=None).to_local())
    else:
        dst.copy_(src.full_tensor() if hasattr(src, "full_tensor") else src)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
