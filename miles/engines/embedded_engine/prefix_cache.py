"""The prefix cache: a radix tree over token ids whose nodes own KV slots, like SGLang's radix cache.

Design decisions:
- What is cached, when: a request's prompt goes into the tree right after its prefill (it stays
  referenced by the request), and its whole KV when it *finishes* (stop, length, or an abort
  between steps): the tokens whose K/V are in its slots, i.e. prompt + output minus the last
  sampled token (never forwarded). A multi-turn session's next turn, whose input is exactly the
  previous input + output + new messages, then matches all but one token of its history. The
  samples of one prompt prefilled together (an RL group) each compute it, but keep one copy: the
  others' duplicate slots are freed and their `req_to_token` rows point at the tree's copy. A
  later request with that prompt, while the group still decodes, hits.
- Sharing: `match` returns the longest cached prefix (split at the match end, so the returned node
  covers it exactly) and the request `lock`s it: every node on its path to the root gets a
  reference; a referenced node is never evicted or freed. The request's slots are the prefix's
  (owned by the tree) + its own; freeing the request frees only its own and `unlock`s the path.
  At finish, `insert` hands the request's own slots to the tree; the part another request cached
  meanwhile is a duplicate, and the request's copy of it is freed.
- Eviction: LRU over unreferenced leaves (a heap by last use, rebuilt per call: O(nodes), nodes are
  few). The tree holds at most `max_tokens` slots (`--prefix-cache-max-share` of the pool, default
  0.5) after every insert; admission and decode evict what they need before retracting anything.
- Weight updates: cached KV was computed with the old weights, so every update and /flush_cache
  `reset`s the tree (SGLang flushes), rather than salting keys with the weight version (stale
  entries would only waste the pool until evicted). Referenced nodes cannot be freed at a reset:
  they are marked dead, and freed by the last `unlock`. `epoch` counts resets; a request admitted
  in an older epoch (it crossed an update, its KV mixes versions) is never inserted.
- Routed experts (R3): a node keeps the routing recorded when its positions were forwarded, if the
  inserting request captured it (`routing`, [tokens, layers, top_k]); a request that asks for routed
  experts matches only nodes that have it (`need_routing`), so its array is full either way.
- Keys are Python lists (the session's ids arrive as lists); a node's key is compared with one
  slice comparison, and only a mismatch is searched element by element (numpy).
- Numerics: a hit's new tokens attend over keys read back from the pool with a mask (model.py
  `_extend_attention`), and the cached K/V came from forwards of other shapes, so results agree
  with a cache-less run to rounding, not bitwise: in fp32 on CPU, log-probs within 1e-5 and the
  same tokens (tests/engines/test_prefix_cache.py; all 64 turns of the benchmark); in bf16 greedy
  outputs drift apart within a turn or two, as any change of kernel shapes does in bf16.
- Measured (bench/agentic_kv.py: one 64-turn session, history 1k -> 32k, 440 new + 64 output
  tokens a turn; engine time per turn at 1k / 8k / 16k / 32k of history; last of 2-3 runs each):
  0.5B Qwen2 shape, bf16, one H200: cache 0.20 / 0.22 / 0.26 / 0.38 s, without 0.23 / 0.24 /
  0.31 / 0.56 s (32k/1k: 1.86 against 2.44; another run 1.63 against 2.61), hit rate 0.974.
  Tiny Qwen3, fp32, 2 torch threads on an otherwise idle 16-core CPU: cache 0.16 / 0.28 / 0.45 /
  0.79 s, without 0.15 / 0.61 / 1.47 / 4.94 s (32k/1k: 4.9 against 33; other runs 4.2 and 7.6
  with the cache). The cache turns a turn's prefill from O(history^2) into O(new x history): at
  the runner, 440 new tokens after 32k cost 221 ms on that CPU against 4.3 s for the whole
  sequence (H200: 62 against 247 ms). The 2x target is met on the GPU, not for the tiny model on
  CPU, where what is left is attention over the history in every decode step (1.85 ms a step at
  1k, 10.0 at 32k, with or without the cache): a 128-wide model's step at 32k is almost all
  attention.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import numpy as np

from miles.engines.embedded_engine.kv_cache import KVPool

_EMPTY = np.zeros(0, dtype=np.int64)


class Node:
    __slots__ = ("key", "slots", "routing", "children", "parent", "refs", "last_used", "dead")

    def __init__(self, key: list[int], slots: np.ndarray, routing: np.ndarray | None, parent: Node | None):
        self.key, self.slots, self.routing, self.parent = key, slots, routing, parent
        self.children: dict[int, Node] = {}
        self.refs = 0
        self.last_used = time.monotonic()
        self.dead = False


@dataclass
class Match:
    node: Node               # deepest node of the match (the root if none); lock/unlock this
    length: int              # cached tokens
    slots: np.ndarray        # [length] their KV slots
    routing: np.ndarray | None  # [length, layers, top_k] when asked for (need_routing)


NO_HIT = Match(None, 0, _EMPTY, None)  # what a request gets with the cache off


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


class PrefixCache:
    def __init__(self, pool: KVPool, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens: {max_tokens} must be >= 0")
        self.pool = pool
        self.max_tokens = max_tokens
        self.epoch = 0
        self._order = itertools.count()  # heap tie-breaker
        self._new_root()

    def _new_root(self) -> None:
        self.root = Node([], _EMPTY, None, None)
        self.root.refs = 1  # never evicted
        self.tokens = 0     # slots the live tree holds

    # ---- lookup and references ---------------------------------------------------------------

    def match(self, tokens: list[int], limit: int, need_routing: bool = False) -> Match:
        """The longest cached prefix of `tokens[:limit]` (with routing, if `need_routing`)."""
        node, pos = self.root, 0
        slots, routing = [], []
        now = time.monotonic()
        node.last_used = now
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or (need_routing and child.routing is None):
                break
            c = _common(child.key, tokens[pos:min(pos + len(child.key), limit)])
            if c < len(child.key):
                child = self._split(child, c)
            child.last_used = now
            slots.append(child.slots)
            if need_routing:
                routing.append(child.routing)
            node, pos = child, pos + c
        return Match(node, pos, np.concatenate(slots) if slots else _EMPTY,
                     np.concatenate(routing) if need_routing and routing else None)

    def lock(self, node: Node) -> None:
        while node is not None:
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.refs -= 1
            if node.dead and node.refs == 0:  # flushed while referenced: its last user is done
                self.pool.free(node.slots)
                node.slots = _EMPTY
            node = node.parent

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` after `at` tokens; returns the new upper part (same refs and age)."""
        upper = Node(child.key[:at], child.slots[:at],
                     None if child.routing is None else child.routing[:at], child.parent)
        upper.refs, upper.last_used, upper.dead = child.refs, child.last_used, child.dead
        upper.children = {child.key[at]: child}
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], upper
        if child.routing is not None:
            child.routing = child.routing[at:]
        return upper

    # ---- insertion and eviction --------------------------------------------------------------

    def insert(self, tokens: list[int], slots: np.ndarray, owned: int,
               routing: np.ndarray | None = None, lock: bool = False) -> tuple[Node, np.ndarray]:
        """Cache `tokens` whose K/V are at `slots`; the first `owned` slots are already the tree's
        (the request's locked match). The tree takes the rest, except duplicates of what it holds
        already, which are freed. Evicts down to `max_tokens` afterwards (after locking the
        inserted path if `lock`). Returns the deepest node and the slots the tree holds `tokens`
        at (a running request's duplicates are replaced by these)."""
        node, pos, n = self.root, 0, len(tokens)
        held = []
        now = time.monotonic()
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                if pos < owned:
                    raise RuntimeError(f"prefix cache: {owned} owned slots but the tree holds only {pos}")
                leaf = Node(tokens[pos:], slots[pos:].copy(),
                            None if routing is None else routing[pos:n].copy(), node)
                node.children[tokens[pos]] = leaf
                leaf.last_used = now
                self.tokens += n - pos
                held.append(leaf.slots)
                node = leaf
                break
            c = _common(child.key, tokens[pos:pos + len(child.key)])
            if c < len(child.key):
                child = self._split(child, c)
            if pos + c > owned:  # the request computed these too: keep the tree's, free its copy
                self.pool.free(slots[max(pos, owned):pos + c])
            if child.routing is None and routing is not None:
                child.routing = routing[pos:pos + c].copy()
            child.last_used = now
            held.append(child.slots)
            node, pos = child, pos + c
        if lock:
            self.lock(node)
        self.trim()
        return node, np.concatenate(held) if held else _EMPTY

    def trim(self) -> None:
        """Evict down to `max_tokens`, as far as unreferenced entries allow."""
        if self.tokens > self.max_tokens:
            self.evict(self.tokens - self.max_tokens)

    def evict(self, n: int) -> int:
        """Free at least `n` slots from unreferenced leaves, least recently used first (fewer if
        the rest is referenced); returns how many were freed."""
        if n <= 0:
            return 0
        heap = [(leaf.last_used, next(self._order), leaf) for leaf in self._leaves() if leaf.refs == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, leaf = heapq.heappop(heap)
            self.pool.free(leaf.slots)
            freed += len(leaf.slots)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, next(self._order), parent))
        self.tokens -= freed
        return freed

    def reset(self) -> None:
        """Drop everything (weights changed): unreferenced slots are freed now, referenced ones
        at their last `unlock`."""
        for node in self._nodes():
            if node.refs == 0:
                self.pool.free(node.slots)
            else:
                node.dead = True
        self.epoch += 1
        self._new_root()

    # ---- inspection --------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _leaves(self):
        return (node for node in self._nodes() if not node.children)

    def evictable_tokens(self) -> int:
        return sum(len(node.slots) for node in self._nodes() if node.refs == 0)
