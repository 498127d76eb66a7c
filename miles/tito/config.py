"""`[session]`: the TITO session server. Mounted into `miles.config.Recipe`."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from miles.sections import Count, Seconds, Section


class SessionConfig(Section):
    """`[session]`: the TITO session server, a supervised process in front of the gateway."""
    enabled: Literal["auto", "on", "off"] = "auto"  # auto: on when rollout.agent is set
    family: str = "qwen3"             # chat template + tool parser: qwen3 | llama3 | module:Class
    max_context_tokens: Count = 0     # 0: the model's context length
    session_ttl_s: Seconds = 3600.0   # idle sessions are dropped after this
    # how a turn's messages are matched to the session's history (prefix reuse): default, or
    # module:function
    message_matcher: str = "default"
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 << 20  # larger requests get a 413 before they are read
