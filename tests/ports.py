"""`cluster.head_port` for a test's `miles run`: a port below the kernel's ephemeral range.

A run derives its other ports from cluster.head_port (the trainer group's MASTER_PORT is
head_port + 10 + role index, the metrics ports head_port + 1 + rank, ...). A port the kernel
hands out for `bind(0)` lies in its ephemeral range, where every outgoing connection of every
process on the box also takes its local port; with two test streams side by side one of them
held head_port + 10 at the moment a trainer's TCP store bound it (EADDRINUSE, CI here). Below the
range only explicit binds compete, so the port is drawn at random there, with the whole span
after it free at the moment of the draw.
"""

from __future__ import annotations

import random
import socket

from miles.node import ephemeral_port_range

SPAN = 64   # head_port .. head_port + SPAN - 1 are checked free


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port(span: int = SPAN) -> int:
    """A head port p with p .. p + span - 1 all free now, below the ephemeral range."""
    high = min(ephemeral_port_range()[0], 65536) - span
    low = 10_000 if high > 12_000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        if all(_free(port + k) for k in range(span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports found in [{low}, {high + span})")
