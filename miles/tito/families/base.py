"""The model-family contract: render appended messages, close an engine turn, parse a reply.

Design decisions:
- A family renders *text*; the server tokenizes it. Every family we ship puts a special token at
  each message boundary, so tokenizing the appended messages alone gives the same ids as
  tokenizing the whole conversation (BPE never merges across an added token). The verifier
  (`miles.tito.verify`) checks exactly this per family, against the family's Jinja template.
- `render(messages, tools, start)` renders `messages[start:]` given that `messages[:start]` are
  already on the token sequence and end with an assistant turn (or `start == 0`). It may look
  back at earlier messages (O(1)), never re-render them: the per-turn cost depends on what was
  appended, not on the history.
- The engine's output ids are never re-tokenized. Whatever the template puts after an assistant
  turn that the model did not generate (Qwen's `\n` after `<|im_end|>`, or the whole end token
  after a length cut) is the family's `bridge`; it is spliced in with loss mask 0.
- `generation_text` is the text a model that follows the template exactly would emit for an
  assistant message (used by the verifier to stand in for an engine).
- Each family also ships its Jinja `chat_template`, the full re-render the verifier checks against.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from miles.tito.messages import ChatMessage, ToolCall


class Reply(msgspec.Struct, kw_only=True):
    """An engine turn parsed for the client. The stored tokens stay the engine's."""
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []

    def to_message(self) -> ChatMessage:
        return ChatMessage(role="assistant", content=self.content, reasoning=self.reasoning,
                           tool_calls=list(self.tool_calls))


class Family:
    name: ClassVar[str] = ""
    chat_template: ClassVar[str] = ""
    end_of_turn: ClassVar[str] = ""              # the token that closes an assistant turn
    stop_tokens: ClassVar[tuple[str, ...]] = ()  # tokens that end generation
    structural_tokens: ClassVar[tuple[str, ...]] = ()  # split points for the verifier
    template_kwargs: ClassVar[dict[str, Any]] = {}     # extra variables the Jinja template reads

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, start: int,
               add_generation_prompt: bool = True, options: dict[str, Any] | None = None) -> str:
        raise NotImplementedError

    def bridge(self, ended_with_stop_token: bool) -> str:
        """Text after an engine turn, before the next rendered message."""
        raise NotImplementedError

    def generation_text(self, message: ChatMessage) -> str:
        raise NotImplementedError

    def parse_reply(self, text: str) -> Reply:
        raise NotImplementedError

    def parse_reply_without_tools(self, text: str) -> Reply:
        """The reply of a `tool_choice: none` turn: call markup stays content, as generated. The
        default keeps the whole text as content whenever `parse_reply` found calls; families with a
        reasoning channel override it to keep reasoning split out."""
        reply = self.parse_reply(text)
        return Reply(content=text) if reply.tool_calls else reply
