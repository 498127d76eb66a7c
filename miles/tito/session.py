"""One TITO session: turn messages into engine input ids by splicing, record what the engine made.

Design decisions:
- A turn is `locate` (hash the request's messages, find the deepest checkpoint they extend),
  `tokenize` (only the bridge + appended messages + generation prompt), `commit_prompt` (hang the
  new prompt segment in the tree, or reuse an identical one: a retry shares its prompt node) and,
  after the engine answered, `complete`. Everything but `tokenize` is O(appended) plus one hash
  per message, which is why per-turn cost does not grow with the history (bench/tito.py).
- The steps are synchronous and never await in between, so concurrent turns of one session (a
  harness running subagents in parallel) need no lock: asyncio runs each step atomically.
- The newest checkpoint's path is also kept as a Python list (one per session), so the usual next
  turn builds its input ids by one list copy instead of converting the whole history again.
- Context limits are checked before anything is added to the tree: a refused turn leaves the
  session exactly as it was. `max_tokens` beyond the remaining context is clipped, not refused.
- The reply is parsed from the engine's output ids (decoded with special tokens kept); the stored
  ids are the engine's, never a re-tokenization of that text.
- `stats` (turns, engine and server seconds, prompt/output/cached tokens) is the session's cost
  account; every collected sample carries it as `session_stats`, for the rollout's metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from miles.tito.families.base import Family, Reply
from miles.tito.messages import ChatMessage, RequestError
from miles.tito.prefix import DIGEST_BYTES, chain, extend, get_matcher
from miles.tito.tokenizer import ChatTokenizer
from miles.tito.tree import Node, TrajectoryTree


class Located(msgspec.Struct, kw_only=True):
    attach: Any                    # Node: checkpoint the request extends (or the root)
    start: int                     # messages[start:] are new
    prompt_key: bytes
    n_messages: int
    existing: Any = None           # an identical prompt node already in the tree
    text: str = ""                 # bridge + rendered new messages + generation prompt


class TurnPlan(msgspec.Struct, kw_only=True):
    prompt: Any                    # Node
    input_ids: list[int]
    max_new_tokens: int
    routed_experts_start: int
    reused_prompt: bool
    appended_tokens: int
    options: dict[str, Any] = {}


class EngineTurn(msgspec.Struct, kw_only=True):
    """What the engine returned for one turn, in the shapes the tree stores."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_versions: list[tuple[str, int, int]] = []   # (version, start, end) over output_ids
    routed_experts: Any = None                         # np.ndarray (rows, layers, top_k) or None
    meta: dict[str, Any] = {}
    top_logprobs: list[list[tuple[float, int]]] | None = None   # (logprob, id) alternatives per position


class Session:
    def __init__(self, session_id: str, family: Family, tokenizer: ChatTokenizer, *,
                 rollout_id: str = "", matcher: str = "default", max_context_tokens: int = 32768,
                 metadata: dict[str, Any] | None = None):
        self.id = session_id
        self.rollout_id = rollout_id or session_id
        self.family = family
        self.tokenizer = tokenizer
        self.key = get_matcher(matcher)
        self.max_context_tokens = max_context_tokens
        self.metadata = dict(metadata or {})
        self.record_routing = False      # every turn records routed experts (R3), set at creation
        self.tree = TrajectoryTree()
        self.created_s = time.time()
        self.turns = 0
        self.stats: dict[str, Any] = {"turns": 0, "engine_s": 0.0, "server_s": 0.0, "prompt_tokens": 0,
                                      "output_tokens": 0, "cached_tokens": 0}
        self._last_path: tuple[Node | None, list[int]] = (None, [])   # newest checkpoint's ids as a list
        self.stop_ids = {tokenizer.token_id(t) for t in family.stop_tokens if t in tokenizer.added_ids}

    # -- a turn ------------------------------------------------------------------------------

    def locate(self, messages: list[ChatMessage], tools: list[dict] | None,
               options: dict[str, Any] | None = None, check: Callable[[int], None] | None = None) -> Located:
        """`check(start)` runs once the recorded prefix is known and before anything is rendered."""
        hashes = chain(messages, tools, self.key)
        attach, start = self.tree.root, 0
        for i in range(len(messages), 0, -1):
            node = self.tree.checkpoints.get(hashes[i])
            if node is not None:
                attach, start = node, i
                break
        if check is not None:
            check(start)
        options = dict(options or {})
        prompt_key = hashes[-1] + msgspec.json.encode(sorted(options.items()))
        loc = Located(attach=attach, start=start, prompt_key=prompt_key, n_messages=len(messages),
                      existing=attach.prompt_children.get(prompt_key))
        if loc.existing is None:
            try:
                body = self.family.render(messages, tools, start, True, options)
            except ValueError as e:   # the family cannot express this conversation
                raise RequestError(f"messages: {e}", "messages") from None
            loc.text = attach.bridge + body
        return loc

    def prompt_tokens(self, loc: Located, ids: np.ndarray | None) -> int:
        """The prompt length a turn at `loc` would have (count_tokens), without committing anything."""
        prompt = loc.existing or loc.attach.prompt_children.get(loc.prompt_key)
        return loc.attach.path_len + (len(prompt.ids) if prompt is not None else len(ids))

    def tokenize(self, loc: Located) -> np.ndarray | None:
        return None if loc.existing is not None else np.asarray(self.tokenizer.encode(loc.text), np.int32)

    def commit_prompt(self, loc: Located, ids: np.ndarray | None, max_tokens: int | None,
                      want_routed_experts: bool = False, options: dict[str, Any] | None = None) -> TurnPlan:
        prompt = loc.existing or loc.attach.prompt_children.get(loc.prompt_key)  # a twin may have landed
        n_new = len(prompt.ids) if prompt is not None else len(ids)
        prompt_tokens = loc.attach.path_len + n_new
        room = self.max_context_tokens - prompt_tokens
        if room < 1:
            raise RequestError(f"context length: the prompt is {prompt_tokens} tokens and the limit is "
                               f"{self.max_context_tokens} (max_context_tokens); nothing is left to generate",
                               "messages", status=400, kind="context_length_exceeded")
        reused = prompt is not None
        if prompt is None:
            prompt = self.tree.add_prompt(loc.attach, loc.prompt_key, ids, loc.n_messages)
        prompt.inflight += 1
        routed_start = 0
        if want_routed_experts and loc.attach.routed_complete:
            routed_start = loc.attach.routed_end   # positions up to the attach point are already stored
        cached_node, cached_ids = self._last_path
        if cached_node is loc.attach and prompt.parent is loc.attach:
            input_ids = cached_ids + prompt.ids.tolist()      # list copy: no per-token Python work
        else:
            input_ids = self.tree.path_ids(prompt).tolist()
        return TurnPlan(prompt=prompt, input_ids=input_ids,
                        max_new_tokens=min(max_tokens or room, room), routed_experts_start=routed_start,
                        reused_prompt=reused, appended_tokens=n_new, options=dict(options or {}))

    def prepare(self, messages: list[ChatMessage], tools: list[dict] | None,
                options: dict[str, Any] | None = None, max_tokens: int | None = None,
                want_routed_experts: bool = False) -> TurnPlan:
        loc = self.locate(messages, tools, options)
        return self.commit_prompt(loc, self.tokenize(loc), max_tokens, want_routed_experts, options)

    def complete(self, plan: TurnPlan, out: EngineTurn, parse_tools: bool = True) -> tuple[Node, Reply]:
        prompt: Node = plan.prompt
        prompt.inflight -= 1
        ids = np.asarray(out.output_ids, np.int32)
        if len(out.logprobs) != len(ids):
            self.tree.discard_prompt(prompt)
            raise ValueError(f"engine: {len(out.logprobs)} logprobs for {len(ids)} output ids")
        last = self.tokenizer.id_to_token(int(ids[-1])) if len(ids) else None
        text_ids = ids[:-1] if len(ids) and int(ids[-1]) in self.stop_ids else ids
        text = self.tokenizer.decode(text_ids)
        matched = (out.finish_reason or {}).get("matched")
        if isinstance(matched, str) and matched and matched in text:
            text = text[: text.index(matched)]   # the client sees text up to the stop string
        reply = self.family.parse_reply(text) if parse_tools else self.family.parse_reply_without_tools(text)
        if plan.options.get("enable_thinking") is False and reply.reasoning is None:
            reply.reasoning = ""             # the generation prompt held an empty think block
        message = reply.to_message()
        key = extend(prompt.key[:DIGEST_BYTES], message, self.key)  # the messages part of the key
        node = self.tree.add_completion(prompt, ids, np.asarray(out.logprobs, np.float32), key, message,
                                        self.family.bridge(last), dict(out.finish_reason or {}),
                                        prompt.n_messages + 1)
        node.versions = [(str(v), int(s), int(e)) for v, s, e in out.weight_versions]
        if out.routed_experts is not None:
            node.routed, node.routed_start = np.asarray(out.routed_experts), plan.routed_experts_start
            before = prompt.parent
            node.routed_complete = node.routed_start == 0 or (
                before.kind == "completion" and before.routed_complete and before.routed_end == node.routed_start)
        node.meta = dict(out.meta)
        self._last_path = (node, plan.input_ids + list(out.output_ids))
        self.turns += 1
        self.stats["turns"] = self.turns
        self.stats["prompt_tokens"] += len(plan.input_ids)
        self.stats["output_tokens"] += len(out.output_ids)
        self.stats["cached_tokens"] += int(out.meta.get("cached_tokens") or 0)
        return node, reply

    def abandon(self, plan: TurnPlan) -> None:
        """The engine call failed: forget the prompt segment if nothing else uses it."""
        plan.prompt.inflight -= 1
        self.tree.discard_prompt(plan.prompt)

    # -- collection ----------------------------------------------------------------------------

    def collect(self, keep: str = "drop_retries", with_routed_experts: bool = False) -> list[dict[str, Any]]:
        out = []
        for leaf in self.tree.leaves(keep):
            sample = self.tree.assemble(leaf, with_routed_experts)
            finish = (leaf.finish or {}).get("type")
            sample["status"] = {"length": "truncated", "abort": "aborted"}.get(finish, "completed")
            sample["rollout_id"] = self.rollout_id
            sample["leaf"] = leaf.id
            sample["session_stats"] = self.session_stats()
            tokens = sample["tokens"]
            sample["response"] = self.tokenizer.decode(tokens[len(tokens) - sample["response_length"]:])
            out.append(sample)
        return out

    def session_stats(self) -> dict[str, Any]:
        return {**self.stats, "engine_s": round(self.stats["engine_s"], 6),
                "server_s": round(self.stats["server_s"], 6)}

    def info(self) -> dict[str, Any]:
        leaves = self.tree.leaves("all")
        return {"id": self.id, "rollout_id": self.rollout_id, "family": self.family.name,
                "turns": self.turns, "nodes": self.tree.n_nodes, "leaves": len(leaves),
                "checkpoints": len(self.tree.checkpoints),
                "max_tokens_in_path": max((n.path_len for n in leaves), default=0),
                "created_s": self.created_s, "metadata": self.metadata, "stats": self.session_stats()}
