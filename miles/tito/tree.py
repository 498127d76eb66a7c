"""The trajectory tree of one session: token segments on nodes, one training sample per kept leaf.

Design decisions:
- Nodes alternate: a *prompt* node holds tokens we rendered (bridge + appended messages +
  generation prompt; loss mask 0), a *completion* node holds the engine's output ids verbatim
  (loss mask 1) with their logprobs, weight versions and routed experts. A node stores only its own
  segment; a path's ids are the concatenation root -> node, so nothing is ever copied per turn.
- Every divergence is a branch: a retry of a turn is a second completion under the same prompt
  node, a fork or an edited history attaches deeper or shallower in the tree, a subagent or a
  compaction restart (new first messages) hangs off the root. Nothing is rejected for diverging.
- A leaf is a completion node with no completion below it. Collection returns one sample per
  kept leaf: `keep="all"`, or `keep="drop_retries"` (the default), which drops a leaf when a later
  completion exists under the same prompt node (the client retried that turn and moved on).
- Routed experts (R3) are stored per completion node for the path positions its request
  returned; a later turn asks the engine only for positions after its attach point, and assembly
  stitches the pieces. If the pieces do not tile the path (an earlier turn did not ask), the
  sample has no routed experts and says why in its metadata.
- Weight-version spans are kept per node in the engine's own strings and mapped to response
  positions at assembly; spans of one version merge across the non-generated tokens between turns.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from miles.tito.messages import ChatMessage

_ids = itertools.count(1)


class Node:
    __slots__ = ("id", "kind", "parent", "children", "ids", "path_len", "logprobs", "finish",
                 "versions", "routed", "routed_start", "routed_complete", "reply", "bridge", "key", "prompt_children",
                 "inflight", "meta", "n_messages")

    def __init__(self, kind: str, parent: "Node | None", ids: np.ndarray):
        self.id = next(_ids)
        self.kind = kind                      # root | prompt | completion
        self.parent = parent
        self.children: list[Node] = []
        self.ids = ids
        self.path_len = (parent.path_len if parent else 0) + len(ids)
        self.logprobs: np.ndarray | None = None
        self.finish: dict[str, Any] = {}
        self.versions: list[tuple[str, int, int]] = []   # (version, start, end) over self.ids
        self.routed: np.ndarray | None = None           # rows for path positions routed_start...
        self.routed_start = 0
        self.routed_complete = False                    # routing of the whole path [0, routed_end) is stored
        self.reply: ChatMessage | None = None
        self.bridge = ""
        self.key = b""
        self.prompt_children: dict[bytes, Node] = {}
        self.inflight = 0
        self.meta: dict[str, Any] = {}
        self.n_messages = 0

    @property
    def routed_end(self) -> int:
        return self.routed_start + (len(self.routed) if self.routed is not None else 0)


class TrajectoryTree:
    def __init__(self):
        self.root = Node("root", None, np.zeros(0, np.int32))
        self.checkpoints: dict[bytes, Node] = {}   # completion nodes by hash of the messages they end
        self.n_nodes = 1

    # -- building ----------------------------------------------------------------------------

    def add_prompt(self, parent: Node, key: bytes, ids: np.ndarray, n_messages: int) -> Node:
        node = Node("prompt", parent, ids)
        node.n_messages = n_messages
        parent.children.append(node)
        parent.prompt_children[key] = node
        node.key = key
        self.n_nodes += 1
        return node

    def add_completion(self, prompt: Node, ids: np.ndarray, logprobs: np.ndarray, key: bytes,
                       reply: ChatMessage, bridge: str, finish: dict, n_messages: int) -> Node:
        if len(logprobs) != len(ids):
            raise ValueError(f"completion: {len(logprobs)} logprobs for {len(ids)} output ids")
        node = Node("completion", prompt, ids)
        node.logprobs, node.key, node.reply, node.bridge, node.finish = logprobs, key, reply, bridge, finish
        node.n_messages = n_messages
        prompt.children.append(node)
        # A checkpoint that was cut by length or aborted can still be extended: its bridge closes the turn.
        self.checkpoints[key] = node
        self.n_nodes += 1
        return node

    def discard_prompt(self, node: Node) -> None:
        """Drop a prompt node nothing was generated from (a failed or refused turn)."""
        if node.kind != "prompt" or node.children or node.inflight:
            return
        parent = node.parent
        parent.children.remove(node)
        if parent.prompt_children.get(node.key) is node:
            del parent.prompt_children[node.key]
        self.n_nodes -= 1

    # -- reading -----------------------------------------------------------------------------

    @staticmethod
    def path(node: Node) -> list[Node]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def path_ids(self, node: Node) -> np.ndarray:
        segments = [n.ids for n in self.path(node)]
        return np.concatenate(segments) if segments else np.zeros(0, np.int32)

    def completions(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.kind == "completion":
                out.append(node)
            stack.extend(node.children)
        return sorted(out, key=lambda n: n.id)

    def leaves(self, keep: str = "drop_retries") -> list[Node]:
        if keep not in ("all", "drop_retries"):
            raise ValueError(f"keep: {keep!r} is not one of ['all', 'drop_retries']")
        nodes, stack = [], [self.root]
        while stack:                       # iterative: a long session can be thousands of turns deep
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children)
        has_below: dict[int, bool] = {n.id: False for n in nodes}
        for node in sorted(nodes, key=lambda n: n.id, reverse=True):   # children before parents
            if node.parent is not None and (has_below[node.id] or node.kind == "completion"):
                has_below[node.parent.id] = True
        leaves = [n for n in self.completions() if not has_below[n.id]]
        if keep == "drop_retries":
            leaves = [n for n in leaves
                      if not any(s.kind == "completion" and s.id > n.id for s in n.parent.children)]
        return leaves

    # -- assembly ----------------------------------------------------------------------------

    def assemble(self, leaf: Node, with_routed_experts: bool = False) -> dict[str, Any]:
        """Tokens, loss mask, logprobs, version spans (response positions) and routing of a leaf."""
        path = self.path(leaf)
        tokens = np.concatenate([n.ids for n in path]).astype(np.int32)
        prompt_len = len(path[0].ids)
        mask = np.concatenate([np.full(len(n.ids), n.kind == "completion", np.uint8) for n in path])
        logprobs = np.concatenate([n.logprobs if n.kind == "completion" else np.zeros(len(n.ids), np.float32)
                                   for n in path]).astype(np.float32)
        spans: list[list] = []
        offset = 0
        for n in path:
            for version, start, end in n.versions:
                s, e = offset + start - prompt_len, offset + end - prompt_len
                if spans and spans[-1][0] == version:
                    spans[-1][2] = e
                else:
                    spans.append([version, s, e])
            offset += len(n.ids)
        out: dict[str, Any] = {
            "tokens": tokens, "response_length": len(tokens) - prompt_len,
            "loss_mask": mask[prompt_len:], "rollout_logprobs": logprobs[prompt_len:],
            "weight_versions": spans,
            "turns": sum(n.kind == "completion" for n in path),
            "finish_reason": leaf.finish, "routed_experts": None}
        if with_routed_experts:
            out["routed_experts"], why = self._stitch_routing(path, len(tokens))
            if why:
                out["routed_experts_missing"] = why
        return out

    @staticmethod
    def _stitch_routing(path: list[Node], n_tokens: int) -> tuple[np.ndarray | None, str]:
        need_end = n_tokens - 1          # routing covers positions [0, len(tokens) - 1)
        pieces: list[np.ndarray] = []
        for node in reversed(path):
            if node.kind != "completion" or need_end == 0:
                continue
            if node.routed is None or not node.routed_start <= need_end <= node.routed_end:
                return None, f"turn ending at token {node.path_len} has no routed experts for position {need_end - 1}"
            pieces.append(node.routed[: need_end - node.routed_start])
            need_end = node.routed_start
        if need_end != 0:
            return None, f"no routed experts for positions [0, {need_end})"
        return np.concatenate(pieces[::-1]), ""
