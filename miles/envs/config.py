"""`[agent]`: the limits of one episode. Mounted into `miles.config.Recipe`."""

from __future__ import annotations

from typing import Literal

from miles.sections import Positive, Seconds, Section


class AgentConfig(Section):
    """Limits of one episode (an agent run or a multi-turn generate), enforced by the framework
    and handed to agents as `task["limits"]`. A sample that hits one is marked "truncated"."""
    max_turns: Positive = 16          # model calls per episode
    max_episode_tokens: Positive = 8192  # tokens the model may generate in one episode
    turn_timeout_s: Seconds = 120.0   # one model call
    episode_timeout_s: Seconds = 600.0  # the whole episode, tools and verifier excluded
    tool_timeout_s: Seconds = 60.0    # one tool call in the sandbox
    keep: Literal["drop_retries", "all", "last"] = "drop_retries"  # which session samples to train
