"""The shape of a chat history: every tool call answered, every tool result answering one.

Design decisions:
- Checked on the normalized `ChatMessage` list, so OpenAI chat, Anthropic messages and the
  Responses API share one rule set; each message carries a `Source` (its path in the request, the
  path of its id field, the paths of its tool calls) so a refusal names the request's own index
  and field, in the API's own words (`tool_call_id` / `tool_use_id` / `call_id`).
- Rules: a tool result must follow an assistant turn with tool calls and answer one of them (by
  id; a result without an id takes the next unanswered call, since several harnesses omit ids);
  a call is answered once; every call is answered before the next non-tool message and before
  the end of the history; an assistant turn has content or tool calls.
- The last rule is waived for assistant turns the session recorded itself (`known`: the messages
  before the deepest stored checkpoint): a model may end a turn with nothing but reasoning, or
  nothing at all, and the harness echoing that turn back is not malformed.
- The check runs before anything is added to the session, so a refusal leaves it untouched.
"""

from __future__ import annotations

import msgspec

from miles.tito.messages import ChatMessage, RequestError


class Source(msgspec.Struct, frozen=True):
    path: str                        # "messages[3]", "messages[2].content[1]", "input[4]"
    id_path: str = ""                # a tool result's id field
    call_paths: tuple[str, ...] = ()  # an assistant turn's tool calls


class Terms(msgspec.Struct, frozen=True):
    result: str                      # what the API calls a tool result
    call: str                        # ... and a tool call
    id: str                          # ... and the result's reference to its call


OPENAI = Terms(result="tool message", call="tool call", id="tool_call_id")
ANTHROPIC = Terms(result="tool_result block", call="tool_use block", id="tool_use_id")
RESPONSES = Terms(result="function_call_output item", call="function_call item", id="call_id")


def openai_sources(n: int) -> list[Source]:
    return [Source(f"messages[{i}]", f"messages[{i}].tool_call_id") for i in range(n)]


def check_history(messages: list[ChatMessage], sources: list[Source], terms: Terms, known: int = 0) -> None:
    """Raise `RequestError` (400) at the first malformed place; `known`: messages the session recorded."""
    if len(sources) != len(messages):   # a decoder without sources: name plain indices
        sources = [Source(f"messages[{i}]") for i in range(len(messages))]
    pending: list[tuple[str, str]] = []   # (call id, call path) of the open assistant turn
    opener = -1                           # index of that assistant turn
    answered: set[str] = set()
    for i, m in enumerate(messages):
        src = sources[i]
        if m.role == "tool":
            _answer(m, src, terms, pending, answered, opener >= 0)
            continue
        if pending:
            _unanswered(pending, src.path, terms)
        if m.role == "assistant":
            if not m.tool_calls and not m.content and i >= known:
                raise RequestError(f"{src.path}: an assistant turn needs content or {terms.call}s, got neither",
                                   f"{src.path}.content")
            paths = src.call_paths or tuple(f"{src.path}.tool_calls[{k}]" for k in range(len(m.tool_calls)))
            pending = [(c.id, p) for c, p in zip(m.tool_calls, paths)]
            opener = i if m.tool_calls else -1
            answered = set()
        else:
            opener = -1
    if pending:
        _unanswered(pending, "the end of the history", terms)


def _answer(m: ChatMessage, src: Source, terms: Terms, pending: list[tuple[str, str]],
            answered: set[str], after_calls: bool) -> None:
    id_path = src.id_path or f"{src.path}.{terms.id}"
    if not after_calls:
        raise RequestError(f"{src.path}: a {terms.result} with no matching {terms.call} (it does not follow an "
                           f"assistant turn with {terms.call}s)", id_path)
    if not pending:
        raise RequestError(f"{src.path}: a {terms.result} with no matching {terms.call}: every "
                           f"{terms.call} of the assistant turn is already answered", id_path)
    if not m.tool_call_id or all(not cid for cid, _ in pending):
        pending.pop(0)   # positional: harnesses that omit ids answer in call order
        return
    for k, (cid, _) in enumerate(pending):
        if cid == m.tool_call_id:
            answered.add(cid)
            del pending[k]
            return
    why = "already answered" if m.tool_call_id in answered else \
        f"open ids: {[cid for cid, _ in pending]}"
    raise RequestError(f"{id_path}: {m.tool_call_id!r} matches no unanswered {terms.call} ({why})", id_path)


def _unanswered(pending: list[tuple[str, str]], where: str, terms: Terms) -> None:
    cid, path = pending[0]
    more = f" (and {len(pending) - 1} more)" if len(pending) > 1 else ""
    raise RequestError(f"{path}: {terms.call} {cid!r} is never answered{more}: a {terms.result} for each "
                       f"{terms.call} must come before {where}", path)
