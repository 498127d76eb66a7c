"""What the fleet keeps per engine position and per server restarted on its own port."""

from __future__ import annotations

from dataclasses import dataclass

from miles.supervise import RestartBudget

# A session server that failed every /health probe for this long is wedged and restarted. Long on
# purpose: a restart loses every open session, and a huge render can hold its loop for seconds.
SESSION_WEDGED_S = 30.0


@dataclass
class EngineSlot:
    """One engine position: the running engine (None while down) and its restart budget."""
    index: int
    engine: object | None = None
    ready_at: float = 0.0
    budget: RestartBudget | None = None
    last_error: str = ""     # why it is down (its last death or failed start), first line
    gave_up: bool = False    # another node's engine that will not come back
    restarting: bool = False
    pending_since: int = -1  # generation at which it became pending (-1: serving or down)
    node: int = -1           # the node whose fleet launched it, on the head (-1: this fleet)
    remote_index: int = -1   # its index in that node's fleet


@dataclass
class CrashLoop:
    """A server restarted on its own port (the gateway, the session server): its crash-loop count."""
    ready_at: float = 0.0
    quick_deaths: int = 0
    restarts: int = 0
