"""PPO's critic on Megatron: a GPTModel with a scalar value head, the policy's layout, its own AdamW.

Design decisions:
- The value model is a GPTModel built like the policy (`train.critic_model_path`, or the policy's
  own checkpoint; the same TP / PP / EP layout, DDP and `calculate_per_token_loss`), whose output
  layer is replaced by `ValueHead` after the HF weights are loaded: the LM head is dropped and
  the last stage maps the final hidden state of each response-predicting row (the state before
  the token, as the FSDP critic reads it) to one value. The head is zero-initialised: every value
  is 0 before the first update, as in critic.py.
- Under TP the head is replicated: its input (the final norm's output) is the same on every TP
  rank, every TP rank computes the same value loss, and the decoder's own TP mappings make the
  backward exact. Sequence parallelism would shard that input; it is refused (the local spec
  cannot run it anyway).
- Forward and backward go through the backend's `_run` (megatron's schedule, PP included) with
  an output function that reads values instead of log-probs; the value loss is
  `miles.algo.compute_value_loss` with the policy step's denominators, so one step's critic
  loss is the FSDP critic's on the same batch.
- Own optimizer (megatron's on CUDA, LocalAdamW on CPU) with the FSDP critic's schedule fields
  (`critic.critic_schedule`); its step count is its own and checkpointed beside the policy's
  (`<ckpt>/critic/dist`, dist_checkpointing, so it reshards like the policy).
- Without `train.critic_model_path` the critic's decoder is copied from the policy at the first RL
  call (`start_from`), like the FSDP critic; the layouts are equal, so each rank copies its shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.algo import LossConfig, compute_value_loss
from miles.backends import megatron_checkpoint, megatron_step
from miles.backends.config import TrainConfig
from miles.backends.critic import CRITIC_DIR, critic_schedule
from miles.backends.optim import lr_at
from miles.backends.packing import PackedMicroBatch


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: [T, 1, H] -> ([R, 1, 1] values, None) at the rows given."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 rows: Callable[[], torch.Tensor | None]):
        super().__init__()
        # weight/bias directly on the module: megatron's sharded_state_dict looks up `output_layer.weight`
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self._rows = rows

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None, **kwargs):
        rows = self._rows()
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


class MegatronCritic:
    """The value model's chunks, optimizer and step count on one trainer rank (calls are collectives)."""

    def __init__(self, backend, cfg: TrainConfig):
        if backend.cp > 1:
            raise ValueError(f"algo.advantage_estimator = 'ppo' on Megatron: the critic's value head "
                             f"needs whole rows; train.megatron.cp={backend.cp} must be 1")
        if backend.chunks[0].config.sequence_parallel:
            raise ValueError("algo.advantage_estimator = 'ppo' on Megatron: the critic's value head needs "
                             "train.megatron.sequence_parallel = false")
        self.backend = backend
        self.cfg = critic_schedule(cfg)
        self.chunks = backend._build(cfg.critic_model_path or cfg.model_path, trainable=True,
                                     prepare=self._swap_head)
        # the policy's rule: megatron's optimizer on CUDA, LocalAdamW on a CPU host or with offload
        self.optimizer = megatron_step.make_optimizer(self.chunks, self.cfg, backend.device, backend.dtype)
        self.step = 0
        self.from_policy = not cfg.critic_model_path

    def _swap_head(self, model) -> None:
        model.share_embeddings_and_output_weights = False   # the value head ties to nothing
        if model.post_process:
            model.output_layer = ValueHead(model.config.hidden_size, model.config.params_dtype,
                                           next(model.parameters()).device, lambda: self.backend._rows)

    @staticmethod
    def values_of(output: torch.Tensor, mb: PackedMicroBatch) -> tuple[torch.Tensor, None]:
        return output[0, :, 0].float(), None   # [1, R, 1] after GPTModel's [s b h] -> [b s h]

    @torch.no_grad()
    def start_from(self, policy_chunks) -> None:
        """Copy the policy's decoder and embedding into the critic's (once, before the first RL step)."""
        if not self.from_policy:
            return
        for mine_chunk, their_chunk in zip(self.chunks, policy_chunks):
            theirs = dict(their_chunk.module.named_parameters())
            for name, p in mine_chunk.module.named_parameters():
                if name.startswith("output_layer."):
                    continue
                src = theirs.get(name)
                if src is None or src.shape != p.shape:
                    raise ValueError(f"critic: the policy has no parameter {name!r} of shape {tuple(p.shape)} "
                                     "to start from")
                p.copy_(src)
        self.optimizer.reload_from_model()
        self.from_policy = False

    def values(self, items) -> list[torch.Tensor] | None:
        """Pre-update values of every (k, micro-batch, length) item; None off the last stage."""
        from megatron.core import parallel_state as ps

        with torch.no_grad():
            out = self.backend._run(self.chunks, items, output_fn=self.values_of)
        return out if ps.is_pipeline_last_stage() else None

    def train_step(self, items, old_values, returns, denominators: dict[int, float], loss_cfg: LossConfig,
                   grad_clip: float) -> dict[str, Any]:
        """One critic optimizer step over this rank's micro-batches of one policy step. Returns the
        value-loss partial sums (to share like the policy's) and critic_grad_norm / critic_lr."""
        sums: dict[str, torch.Tensor] = {}
        device = self.backend.device

        def loss_for(k, mb, values, _):
            den = torch.tensor([denominators[i] for i in mb.sample_indices] or [1.0], dtype=torch.float64,
                               device=device)
            loss, metrics = compute_value_loss(values, old_values=old_values[k], returns=returns[k],
                                               loss_mask=mb.loss_mask, sample_denominators=den, cfg=loss_cfg,
                                               cu_seqlens=mb.response_cu_seqlens)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach().double()
            return loss

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.backend._run(self.chunks, items, loss_for=loss_for, output_fn=self.values_of)
        lr = lr_at(self.step, self.cfg)
        norm, skipped = self.optimizer.step(lr, grad_clip)
        if not skipped:
            self.step += 1
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        return {"sums": sums, "critic_grad_norm": norm, "critic_lr": lr, "critic_skipped_steps": float(skipped)}

    def save(self, root: str | Path) -> None:
        folder = Path(root) / CRITIC_DIR
        if dist.get_rank() == 0:
            import shutil
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        megatron_checkpoint.save(self.chunks, self.optimizer, folder / "dist")
        if dist.get_rank() == 0:
            (folder / "critic_state.json").write_text(json.dumps({"step": self.step}))
        dist.barrier()

    def load(self, root: str | Path) -> None:
        folder = Path(root) / CRITIC_DIR
        if not (folder / "critic_state.json").exists():
            raise FileNotFoundError(f"checkpoint {str(root)!r} has no critic/ directory: it was saved without "
                                    "algo.advantage_estimator = 'ppo'; a PPO run cannot resume from it with a "
                                    "fresh critic silently")
        megatron_checkpoint.load(self.chunks, self.optimizer, folder / "dist")
        self.step = int(json.loads((folder / "critic_state.json").read_text())["step"])
        self.from_policy = False

    def device_tensors(self) -> Iterator[torch.Tensor]:
        for chunk in self.chunks:
            for p in chunk.parameters():
                yield p
                if getattr(p, "main_grad", None) is not None:
                    yield p.main_grad
        for _, t in megatron_step.optimizer_tensors(self.optimizer):
            yield t
