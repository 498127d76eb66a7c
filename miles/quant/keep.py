"""Which tensors stay in high precision: exact names, module prefixes or fnmatch globs.

Design decisions:
- Never substring matching: verl shipped 56 Qwen3 parameters in the wrong precision because the
  exclusion `mlp.gate` (the MoE router) substring-matched `mlp.gate_up_proj`. Here a pattern
  without glob characters matches a name exactly or as a module prefix ending at a dot
  (`model.layers.1.mlp` covers `model.layers.1.mlp.up_proj.weight`, not `model.layers.11.mlp...`);
  a pattern with `*?[` is an fnmatch glob over the whole name, case-sensitive.
- The defaults keep what every low-precision recipe keeps: embeddings, lm_head, MoE routers
  (`mlp.gate`, Qwen2-MoE's `shared_expert_gate`) and norms. Only 2-D `.weight` tensors are ever
  candidates (biases, norms and scales pass through whatever the list says).
- `KeepList.unused()` names the user patterns that matched nothing in a publish: a typo in
  the list would otherwise silently quantize what the user meant to keep.
"""

from __future__ import annotations

import fnmatch

import torch

DEFAULT_KEEP = ("model.embed_tokens.weight", "lm_head.weight", "*.mlp.gate.weight",
                "*.mlp.shared_expert_gate.weight", "*norm.weight")
_GLOB = set("*?[")


def matches(name: str, pattern: str) -> bool:
    if _GLOB & set(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


class KeepList:
    def __init__(self, user_patterns: list[str] | tuple[str, ...] = (), defaults=DEFAULT_KEEP):
        self.user = tuple(user_patterns)
        self.patterns = tuple(defaults) + self.user
        self.hits: dict[str, int] = dict.fromkeys(self.user, 0)

    def keeps(self, name: str) -> bool:
        hit = False
        for p in self.patterns:
            if matches(name, p):
                hit = True
                if p in self.hits:
                    self.hits[p] += 1
        return hit

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        """True for a 2-D floating `.weight` that no pattern keeps."""
        kept = self.keeps(name)  # first, so a user pattern's hits count on any tensor
        return not kept and name.endswith(".weight") and tensor.dim() == 2 \
            and tensor.is_floating_point()

    def unused(self) -> list[str]:
        return [p for p, n in self.hits.items() if n == 0]

    def reset(self) -> None:
        self.hits = dict.fromkeys(self.user, 0)
