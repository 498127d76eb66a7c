"""R3 routing replay for HF MoE models under FSDP: train on the experts the rollout engine used.

    replay = RouterReplay.install(lm)          # None for a dense model
    with replay.micro_batch(indices, replay=True):   # int64 [T, L, k] (miles.algo.routing layout)
        logp = policy.run(mb.inputs); loss.backward()
    replay.take_metrics()  # routing_agreement, routing_native_agreement, routing_replay_sentinel_rows

Design decisions:
- The patched router (transformers 5's `Qwen3MoeTopKRouter` / `Qwen2MoeTopKRouter`, one instance
  forward per MoE layer) computes the scores as usual (softmax of the router logits in fp32), then
  takes the top-k indices from the rollout and gathers the weights from the DENSE scores, so
  gradients still reach the router weight (gathering from top-k-masked probabilities would read
  exact zeros at every flipped index), and renormalises as the model does (`norm_topk_prob`).
- The indices are the whole micro-batch's, set for the duration of a context, and each router
  reads its own layer `[:, layer]`: no cursor to pop. The training pass keeps the context open
  through backward, so activation recompute (gradient checkpointing) re-runs the router with the
  very same indices; the no-grad old-logprob pass opens its own context. The stages are: off (no
  context, or `replay=False`: native routing, only measured), replay for the old-logprob pass and
  replay for the training pass (with the backward inside).
- Sentinel rows (the last token of each sample, samples or layers the rollout did not record)
  keep the model's native top-k: such a token is then computed exactly as without replay instead
  of being sent to arbitrary experts; they are counted (`routing_replay_sentinel_rows`).
- Metrics are measured where the experts are called (a pre-hook on `mlp.experts`: the indices
  the expert computation actually receives), once per micro-batch and layer (a recompute is not
  counted twice): `routing_agreement` (used vs rollout top-k sets; 1.0 when replaying) and
  `routing_native_agreement` (the trainer's own top-k vs the rollout's: the flips R3 removes).
  Counters stay on the device until `take_metrics`, so the forward never synchronises.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles.algo.routing import micro_batch_indices, routing_problem, topk_set_matches
from miles.backends.batch import sample_name
from miles.backends.packing import PackedMicroBatch
from miles.wire.messages import Sample

ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")
COUNTERS = ("routing_rows", "routing_native_matches", "routing_used_matches", "routing_sentinel_rows")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RouterReplay:
    def __init__(self, routers: dict[int, nn.Module], num_layers: int, top_k: int, num_experts: int):
        self.routers, self.num_layers, self.top_k, self.num_experts = routers, num_layers, top_k, num_experts
        self.indices: torch.Tensor | None = None   # [T, L, k] of the open micro-batch
        self.replay = False
        self._counted: set[int] = set()
        self._counts: dict[str, torch.Tensor] = {}
        self.router_calls = 0                        # forwards of any router (tests read it)

    @classmethod
    def install(cls, lm: nn.Module) -> RouterReplay | None:
        """Patch every MoE router of `lm`; None when it has none. An MoE model whose router
        class is not one of ROUTERS is refused (replaying it silently natively would be a lie)."""
        routers: dict[int, nn.Module] = {}
        for name, module in lm.named_modules():
            m = _LAYER.search(name)
            if m is None or not hasattr(module, "top_k"):
                continue
            if type(module).__name__ not in ROUTERS:
                raise NotImplementedError(f"router replay: {name} is a {type(module).__name__}; "
                                          f"supported routers: {', '.join(ROUTERS)}")
            routers[int(m.group(1))] = module
        if not routers:
            return None
        cfg = lm.config
        first = next(iter(routers.values()))
        self = cls(routers, int(cfg.num_hidden_layers), int(first.top_k), int(first.num_experts))
        for layer, router in routers.items():
            router.forward = types.MethodType(_make_forward(self, layer), router)
            experts = _experts_of(lm, layer)
            experts.register_forward_pre_hook(_make_counter(self, layer))
        return self

    @contextlib.contextmanager
    def micro_batch(self, indices: torch.Tensor | None, *, replay: bool, measure: bool = True) -> Iterator[None]:
        """Route the forwards (and recomputes) inside by `indices` [T, L, k] when `replay`, and
        measure agreement with them unless `measure=False` (the no-grad passes: only the training
        pass is counted). `indices=None`: native routing, nothing measured."""
        if indices is not None and (indices.dim() != 3 or indices.shape[1:] != (self.num_layers, self.top_k)):
            raise ValueError(f"router replay: indices of shape {tuple(indices.shape)}, expected "
                             f"[tokens, {self.num_layers}, {self.top_k}]")
        if replay and indices is None:
            raise ValueError("router replay: replay=True needs the micro-batch's routed experts")
        self.indices, self.replay = indices, replay
        self._counted = set() if measure else set(self.routers)
        try:
            yield
        finally:
            self.indices, self.replay, self._counted = None, False, set()

    def layer_indices(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer`'s recorded rows [T, k] on `device`. The micro-batch's indices cross to the
        device once (pinned, asynchronously), not once per router call: a pageable copy per layer
        synchronised the stream each time (+28% on a replayed H200 step of a 16-layer MoE)."""
        if self.indices.device != device:
            src = self.indices.pin_memory() if device.type == "cuda" else self.indices
            self.indices = src.to(device, non_blocking=True)
        return self.indices[:, layer]

    def _add(self, name: str, value: torch.Tensor) -> None:
        prev = self._counts.get(name)
        self._counts[name] = value.detach().double() if prev is None else prev + value.detach().double()

    def take_sums(self) -> dict[str, torch.Tensor]:
        """The raw counters since the last call (for summing across ranks), then reset. Every
        counter is present (zero when nothing was measured): ranks all-reduce the same keys."""
        out = {name: self._counts.get(name, torch.zeros((), dtype=torch.float64)) for name in COUNTERS}
        self._counts = {}
        return out

    @staticmethod
    def metrics_from_sums(sums: dict[str, float]) -> dict[str, float]:
        out = {}
        if sums.get("routing_rows", 0) > 0:
            out["routing_agreement"] = sums["routing_used_matches"] / sums["routing_rows"]
            out["routing_native_agreement"] = sums["routing_native_matches"] / sums["routing_rows"]
        if sums.get("routing_sentinel_rows", 0) > 0:
            out["routing_replay_sentinel_rows"] = sums["routing_sentinel_rows"]
        return out

    def take_metrics(self) -> dict[str, float]:
        return self.metrics_from_sums({k: float(v) for k, v in self.take_sums().items()})


def _make_forward(state: RouterReplay, layer: int):
    def forward(self, hidden_states: torch.Tensor):
        state.router_calls += 1
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        native = torch.topk(probs, self.top_k, dim=-1).indices
        indices = native
        if state.indices is not None:
            recorded = state.layer_indices(layer, probs.device)
            if recorded.shape[0] != probs.shape[0]:
                raise ValueError(f"router replay: layer {layer} got {probs.shape[0]} tokens but the "
                                 f"micro-batch's routing has {recorded.shape[0]} rows")
            if layer not in state._counted:
                matches, rows = topk_set_matches(native, recorded)
                state._add("routing_native_matches", matches)
                state._add("routing_rows", rows)
            if state.replay:
                missing = (recorded < 0).any(dim=-1, keepdim=True)
                indices = torch.where(missing, native, recorded)
                if layer not in state._counted:
                    state._add("routing_sentinel_rows", missing.sum())
        # Weights from the dense scores: a replayed index that the trainer would not have picked
        # still gets its (small, non-zero) probability and a gradient.
        weights = probs.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), indices
    return forward


def _make_counter(state: RouterReplay, layer: int):
    def hook(module, args):
        if state.indices is None or layer in state._counted:
            return
        used = args[1]
        recorded = state.layer_indices(layer, used.device)
        matches, _ = topk_set_matches(used, recorded)
        state._add("routing_used_matches", matches)
        state._counted.add(layer)
    return hook


def _experts_of(lm: nn.Module, layer: int) -> nn.Module:
    for name, module in lm.named_modules():
        if re.search(rf"(?:^|\.)layers\.{layer}\.mlp\.experts$", name):
            return module
    raise ValueError(f"router replay: layer {layer} has a router but no mlp.experts module")


# ---- the backend's side: one rank's micro-batches -------------------------------------------

def micro_batch_routing(replay: RouterReplay | None, samples: Sequence[Sample], mbs: Sequence[PackedMicroBatch],
                        *, required: bool, rank: int) -> tuple[list[torch.Tensor | None], str | None]:
    """(Replay indices per micro-batch of this rank, None for a dummy or one without routing; the
    first problem as a message). `required` (replay on): every sample this rank trains must carry
    its routing; a missing one is refused, never trained on native routing in silence."""
    if replay is None:
        return [None] * len(mbs), None
    out: list[torch.Tensor | None] = []
    for mb in mbs:
        if mb.is_dummy:
            out.append(None)
            continue
        routed = [samples[i].routed_experts for i in mb.sample_indices]
        lengths = [len(samples[i].tokens) for i in mb.sample_indices]
        for i, r, n in zip(mb.sample_indices, routed, lengths):
            problem = routing_problem(r, n, replay.num_layers, replay.top_k)
            if problem and (required or r is not None):
                why = (f"; train.router_replay (rollout.r3) is on and trainer rank {rank} trains this "
                       "sample, so it must have the routing the rollout used" if r is None else "")
                return [], f"train batch: {sample_name(i, samples[i])}: {problem}{why}"
        has = any(r is not None for r in routed)
        out.append(micro_batch_indices(routed, lengths, replay.num_layers, replay.top_k) if has else None)
    return out, None


def agree_on_routing(error: str | None, device: torch.device) -> None:
    """All ranks raise together when any rank refused its share (the flag is all-reduced)."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag[0]):
        raise ValueError(error or "train batch refused by another trainer rank for its routed "
                                  "experts (it logged why)")


def routed(replay: RouterReplay | None, indices: torch.Tensor | None, *, replay_on: bool,
           measure: bool = True):
    """The context a forward (and its backward) runs in: replay / measure, or nothing at all."""
    if replay is None or indices is None:
        return contextlib.nullcontext()
    return replay.micro_batch(indices, replay=replay_on, measure=measure)


def finish_routing_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Replace the summed routing counters of `metrics` by the agreement fractions."""
    sums = {k: metrics.pop(k) for k in list(metrics) if k in COUNTERS}
    metrics.update(RouterReplay.metrics_from_sums(sums))
    return metrics
