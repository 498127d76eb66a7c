"""R3 routing replay for the Megatron backend: megatron-core's `RouterReplay`, one per MoE layer.

    replay = MegatronReplay.install(chunks)      # None for a dense model
    replay.set_micro_batch(indices, length, stage=TRAIN)   # per forward_step: int64 [T, L, k]
    ... megatron's schedule (forward, recompute, backward) ...
    replay.clear(); replay.reduce_metrics(device)   # routing_agreement, ... (every rank, same dict)

Design decisions:
- megatron-core 0.16.1's own hook: `TopKRouter.routing` hands every top-k to
  `router.router_replay.get_replay_topk(scores, k, ..., default_compute_topk)`, which in the replay
  actions returns `scores.gather(1, recorded)`: the weights come from the DENSE scores (the
  logits, for Qwen3's top-k-then-softmax = renormalised softmax), so gradients still reach the
  router. Our `MilesRouterReplay` subclasses it: sentinel rows (-1: a sample's last token,
  padding, a sample without routing) keep the native top-k instead of reading index -1, and it
  counts agreement where the indices leave the router (the routing map the dispatcher uses).
- Instances are ours, per model: `install` attaches one to each MoE router of the given chunks
  and takes it straight back out of upstream's class-global `global_router_replay_instances`
  (that list leaks the routers of every model a process builds: a reference model, a temporary
  one in a test). `moe_enable_routing_replay` is therefore not needed in the TransformerConfig.
- Layers: each router reads `[:, layer_number - 1]` of the micro-batch's [T, L, k] indices;
  megatron's `TransformerLayer.layer_number` is global (1-based, the PP offset included), so a
  pipeline stage picks its own layers with no offset arithmetic here. Rows follow the tokens: the
  row is padded with sentinel rows to the length the schedule runs it at, and sliced per TP rank
  under sequence parallelism; under context parallelism the rank's tokens are picked first
  (`local_index`, megatron_cp.py's row chunks).
- Stages (upstream's actions): no-grad passes (old / ref log-probs) = REPLAY_FORWARD, the current
  target only; the training pass = REPLAY_BACKWARD: a checkpointed layer's first forward runs
  under no_grad and queues its target, its recompute (grad on, queue not empty) pops the oldest,
  which is the right one because megatron's schedules run backwards in forward order (1F1B
  included). A layer that is not checkpointed never queues and always reads the current target.
  Not replaying (`train.router_replay` off) but samples carry routing: action None, native
  routing, only measured (queued the same way, so a recompute never compares with another
  micro-batch's rows).
- Metrics as FSDP's (`routing_agreement`, `routing_native_agreement`,
  `routing_replay_sentinel_rows`), counted once per micro-batch and layer in the training pass
  (not the no-grad passes, not a recompute). Counters stay on the device until `reduce_metrics`,
  which sums them over all ranks once per train call; TP ranks see the same tokens without
  sequence parallelism, so only TP rank 0 contributes then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from miles.algo.routing import topk_set_matches
from miles.backends.router_replay import COUNTERS, RouterReplay as HFRouterReplay

OFF, NO_GRAD, TRAIN = None, RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD


class MilesRouterReplay(RouterReplay):
    """One MoE layer's replay: upstream's class with sentinel rows and agreement counters."""

    def __init__(self, state: MegatronReplay, layer: int):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)   # ours, per model (see docstring)
        self.state, self.layer = state, layer
        self.measure = False     # count the next call (the first of a micro-batch's training pass)
        self.calls = 0           # router calls (tests read them)
        self.last_recompute = False

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        self.calls += 1
        target = self.target_topk_idx
        if target is None:
            self.last_recompute = False
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        queued = self.router_replay_action in (TRAIN, OFF)   # a pass with a backward
        recompute = queued and torch.is_grad_enabled() and bool(self.replay_backward_list)
        self.last_recompute = recompute
        if recompute:
            target = self.replay_backward_list.pop(0)
        elif queued and not torch.is_grad_enabled():
            self.replay_backward_list.append(target)   # a checkpointed layer: its recompute pops it
        target = target.to(scores.device, non_blocking=True)
        if target.shape != (scores.shape[0], topk):
            raise ValueError(f"router replay: layer {self.layer} routes {scores.shape[0]} tokens to "
                             f"{topk} experts, but its replay indices have shape {tuple(target.shape)}")
        values, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.router_replay_action is OFF:
            used, missing = native, None
        else:
            missing = (target < 0).any(dim=-1, keepdim=True)
            used = torch.where(missing, native, target)
            values = scores.gather(1, used)   # dense scores: a flipped index still gets a gradient
        if self.measure and not recompute:
            self.measure = False
            st = self.state
            matches, rows = topk_set_matches(native, target)
            st.add("routing_native_matches", matches)
            st.add("routing_rows", rows)
            st.add("routing_used_matches", topk_set_matches(used, target)[0])
            if missing is not None:
                st.add("routing_sentinel_rows", missing.sum())
        return values, used


class MegatronReplay:
    def __init__(self, replays: list[MilesRouterReplay], num_layers: int, top_k: int, sequence_parallel: bool,
                 device: torch.device):
        self.replays, self.num_layers, self.top_k, self.device = replays, num_layers, top_k, device
        self.sequence_parallel = sequence_parallel
        self._counts: dict[str, torch.Tensor] = {}

    @classmethod
    def install(cls, chunks: Sequence[torch.nn.Module]) -> MegatronReplay | None:
        """Attach a replay to every MoE router of `chunks` (GPTModel, DDP-wrapped or not); None
        when there is none. Must run on every rank (every rank builds its own model)."""
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self = None
        replays = []
        for chunk in chunks:
            config = chunk.config
            if self is None:
                self = cls(replays, int(config.num_layers), int(config.moe_router_topk or 0),
                           bool(config.sequence_parallel), next(chunk.parameters()).device)
            for module in chunk.modules():
                if not isinstance(module, TransformerLayer):
                    continue
                router = getattr(module.mlp, "router", None)
                if router is None:
                    continue
                if not isinstance(router, TopKRouter):
                    raise NotImplementedError(f"router replay: layer {module.layer_number} has a "
                                              f"{type(router).__name__}; only TopKRouter is supported")
                if config.moe_router_fusion:
                    raise NotImplementedError("router replay with moe_router_fusion (TE's fused top-k "
                                              "bypasses the replay hook)")
                router.router_replay = MilesRouterReplay(self, int(module.layer_number) - 1)
                replays.append(router.router_replay)
        return self if replays else None

    def set_micro_batch(self, indices: torch.Tensor | None, length: int, *, stage,
                        local_index: torch.Tensor | None = None) -> None:
        """Route the coming forward of one micro-batch (row padded to `length`) by `indices`
        [T, L, k] (None: native, nothing measured). `stage`: OFF (measure only), NO_GRAD, TRAIN.
        `local_index`: the row positions this context-parallel rank holds (megatron_cp.py)."""
        from megatron.core import parallel_state as ps

        if indices is None:
            for r in self.replays:
                r.target_topk_idx, r.measure = None, False
                r.set_router_replay_action(stage)
            return
        if indices.dim() != 3 or indices.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"router replay: indices of shape {tuple(indices.shape)}, expected "
                             f"[tokens, {self.num_layers}, {self.top_k}]")
        # one copy per micro-batch, not one per layer
        tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()) \
            if self.sequence_parallel else (0, 1)
        rows = rows_for(indices, length, *tp, local_index=local_index).to(self.device, non_blocking=True)
        for r in self.replays:
            r.target_topk_idx = rows[:, r.layer]
            r.measure = stage is TRAIN or stage is OFF
            r.set_router_replay_action(stage)

    def clear(self) -> None:
        """After a pass: no target, no queued recompute, native routing."""
        for r in self.replays:
            r.clear_indices()
            r.clear_router_replay_action()
            r.measure = False

    def add(self, name: str, value: torch.Tensor) -> None:
        prev = self._counts.get(name)
        self._counts[name] = value.detach().double() if prev is None else prev + value.detach().double()

    def reduce_metrics(self, device: torch.device) -> dict[str, float]:
        """The agreement metrics since the last call, summed over every rank (collective)."""
        from megatron.core import parallel_state as ps

        contributes = self.sequence_parallel or ps.get_tensor_model_parallel_rank() == 0
        vec = torch.stack([self._counts.get(n, torch.zeros((), dtype=torch.float64)).to(device)
                           if contributes else torch.zeros((), dtype=torch.float64, device=device)
                           for n in COUNTERS])
        self._counts = {}
        dist.all_reduce(vec)
        return HFRouterReplay.metrics_from_sums(dict(zip(COUNTERS, vec.tolist())))


def rows_for(indices: torch.Tensor, length: int, tp_rank: int = 0, tp_size: int = 1,
             local_index: torch.Tensor | None = None) -> torch.Tensor:
    """The replay rows of this rank's tokens: padded with sentinel rows to the scheduled row
    length (megatron_step.padded_row pads the tokens so), then this CP rank's tokens
    (`local_index`, megatron_cp.py) in their local order, then TP rank `tp_rank`'s contiguous
    sequence slice under sequence parallelism (tp_size > 1), as megatron scatters the tokens."""
    extra = length - indices.shape[0]
    if extra < 0:
        raise ValueError(f"router replay: {indices.shape[0]} routing rows for a row of {length} tokens")
    if extra:
        indices = torch.cat([indices, indices.new_full((extra, *indices.shape[1:]), -1)])
    if local_index is not None:
        indices = indices.index_select(0, local_index.to(indices.device))
        length = indices.shape[0]
    if tp_size > 1:
        if length % tp_size:
            raise ValueError(f"router replay: row of {length} tokens is not a multiple of TP = {tp_size}")
        n = length // tp_size
        indices = indices[tp_rank * n:(tp_rank + 1) * n]
    return indices
