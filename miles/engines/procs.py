"""Server children of Miles: start one, wait until it is healthy, stop it; recipe tables as flags.

Used by the SGLang launcher, the gateway launcher and the embedded engine launcher: every
long-lived HTTP child of Miles is a `ServerProcess`, a `miles.supervise.SupervisedProcess` (log
file, own process group, PDEATHSIG shim, no orphans; the rules are in that module) with a
health wait.

Design decisions:
- Recipe passthrough tables become command-line flags by one rule set (`table_to_flags`),
  shared by the SGLang and smg launchers: both CLIs are argparse with `--dashed-names`.
- Health waiting is async (the node daemon and the rollout side run on asyncio) and fails
  early, with the exit code and the log tail, when the process dies before it becomes healthy.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from miles.supervise import LOG_TAIL_LINES, ProcessFailed, SupervisedProcess, read_log_tail

__all__ = ["LOG_TAIL_LINES", "ServerProcess", "ServerStartError", "free_port", "read_log_tail",
           "table_to_flags"]

# OS entropy, not the `random` module: tests seed that, and two seeded processes would pick
# the same ports.
_port_rng = random.SystemRandom()
_recent_ports: collections.deque[int] = collections.deque(maxlen=256)


_FLAG_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


class ServerStartError(ProcessFailed):
    """The server exited, or never became healthy, before the deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, below the kernel's ephemeral range.

    A server binds its port seconds after we pick it (an engine loads its model first). A port
    from the ephemeral range can meanwhile become the source port of some outgoing connection,
    and on a busy test machine that happens; ports below the range are never handed out that
    way (SGLang picks its internal ports the same way).
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = _port_rng.randrange(max(1024, low - 12000), low)
        if port in _recent_ports:  # handed out moments ago, probably not bound yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _recent_ports.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def table_to_flags(table: Mapping[str, Any], *, section: str,
                   owned: Mapping[str, str] | None = None) -> list[str]:
    """Turn a recipe table into argparse flags.

    `foo_bar = v` -> `--foo-bar v`; `true` -> bare `--foo-bar` (store_true); `false` or null ->
    omitted (the tool's default); a list -> `--foo-bar v1 v2` (nargs="+"); a table -> one JSON
    string. `owned` maps keys the launcher sets itself to the config field to use instead:
    two sources for one value is how a run silently uses the wrong port.
    """
    flags: list[str] = []
    for key, value in table.items():
        where = f"{section}.{key}"
        if not isinstance(key, str) or not _FLAG_NAME.match(key):
            raise ValueError(f"{where}: not a flag name (expected lower-case letters, digits, "
                             f"'_' or '-')")
        norm = key.replace("-", "_")
        if owned and norm in owned:
            raise ValueError(f"{where}: Miles sets this flag itself; use the field "
                             f"'{owned[norm]}' instead of passing it through")
        flag = "--" + norm.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{where}: empty list; omit the key to keep the default")
            if not all(_is_scalar(v) for v in value):
                raise ValueError(f"{where}: list items must be strings or numbers, got {value!r}")
            flags += [flag, *(_scalar(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        elif _is_scalar(value):
            flags += [flag, _scalar(value)]
        else:
            raise ValueError(f"{where}: unsupported value {value!r} (expected a string, number, "
                             f"bool, list or table)")
    return flags


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def _scalar(v: Any) -> str:
    return v if isinstance(v, str) else repr(v)


class ServerProcess(SupervisedProcess):
    """One server child process: `start()`, `await wait_healthy(url)`, `stop()`."""

    def exit_error(self, what: str) -> ServerStartError:
        return ServerStartError(*super().exit_error(what).args)

    async def wait_healthy(self, url: str, *, timeout_s: float, path: str = "/health",
                           interval_s: float = 0.2) -> None:
        """Poll `GET url+path` until it answers 200; fail at once if the process exits."""
        if self.proc is None:
            raise RuntimeError(f"{self.name}: wait_healthy() before start()")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        probe_timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, timeout_s)))
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while True:
                if not self.alive:
                    raise self.exit_error(f"before {url}{path} became healthy")
                try:
                    async with session.get(url + path) as resp:
                        if resp.status == 200:
                            return
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    last = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} (pid {self.pid}) not healthy at {url}{path} after "
                        f"timeout_s={timeout_s} (last probe: {last})\nlast lines of "
                        f"{self.log_path}:\n{self.log_tail()}")
                await asyncio.sleep(interval_s)
