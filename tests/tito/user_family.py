"""A user-style family in one file: plain ChatML, no reasoning, Hermes-style tool calls.

Loaded in tests as `--family user_family:ChatMLFamily`; it reuses Qwen3's renderer for the parts
that are the same and changes only what differs, which is how a user adds a family.
"""

from miles.tito.families.base import Reply
from miles.tito.families.qwen3 import Qwen3Family

NOT_A_FAMILY = object()


class ChatMLFamily(Qwen3Family):
    name = "chatml-user"

    def parse_reply(self, text: str) -> Reply:
        reply = super().parse_reply(text)
        return Reply(content=reply.content, tool_calls=reply.tool_calls)   # no reasoning channel
