"""Hash-chained message prefixes: find the deepest stored checkpoint a request extends, in O(1) lookups.

Design decisions:
- `h[0]` hashes the tools (they change the rendered system header, so a different tool set is a
  different root); `h[i] = blake2b(h[i-1] || key(messages[i-1]))`. A checkpoint is stored under
  the hash of the messages it covers, so "is messages[:i] a stored prefix?" is one dict lookup and
  the deepest match is found by scanning i downwards from the end (usually one or two steps).
  Hashing touches each message once per request (bytes at hash speed); nothing is re-tokenized.
- The per-message key decides when a replayed message "is" the stored one (Miles' message
  matchers). `default` compares role, content and tool calls (name + parsed arguments, key order
  ignored) and ignores reasoning, tool-call ids and names: harnesses often drop
  `reasoning_content` or renumber call ids, and the stored tokens are the engine's either way.
  `strict` also compares reasoning; `role_content` compares role and content only.
  A matcher can also be given as an import path `module:function` taking a `ChatMessage`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable

import msgspec

from miles.tito.messages import ChatMessage

_sorted = msgspec.json.Encoder(order="sorted")
DIGEST_BYTES = 16


def _calls(m: ChatMessage) -> list:
    return [[c.name, c.arguments] for c in m.tool_calls]


def key_default(m: ChatMessage) -> bytes:
    return _sorted.encode([m.role, m.content, _calls(m)])


def key_strict(m: ChatMessage) -> bytes:
    return _sorted.encode([m.role, m.content, _calls(m), m.reasoning])


def key_role_content(m: ChatMessage) -> bytes:
    return _sorted.encode([m.role, m.content])


MATCHERS: dict[str, Callable[[ChatMessage], bytes]] = {
    "default": key_default, "strict": key_strict, "role_content": key_role_content}


def get_matcher(name: str) -> Callable[[ChatMessage], bytes]:
    if name in MATCHERS:
        return MATCHERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise KeyError(f"message matcher: unknown matcher {name!r}; expected one of {sorted(MATCHERS)} "
                   f"or an import path 'module:function'")


def root_hash(tools: list[dict] | None) -> bytes:
    body = json.dumps(tools, ensure_ascii=False).encode() if tools else b""
    return hashlib.blake2b(b"tools:" + body, digest_size=DIGEST_BYTES).digest()


def extend(h: bytes, message: ChatMessage, key: Callable[[ChatMessage], bytes]) -> bytes:
    return hashlib.blake2b(h + key(message), digest_size=DIGEST_BYTES).digest()


def chain(messages: list[ChatMessage], tools: list[dict] | None,
          key: Callable[[ChatMessage], bytes]) -> list[bytes]:
    """`out[i]` identifies `messages[:i]` under `tools`; len(out) == len(messages) + 1."""
    out = [root_hash(tools)]
    for m in messages:
        out.append(extend(out[-1], m, key))
    return out
