"""Launch the TITO session server (`python -m miles.tito.server`) in front of the gateway.

    token_file = write_token_file(run_dir / "session.token")
    server = await launch_session_server(SessionServerConfig(
        engine_url=gateway.url, model_path=model, port=free_port(), token_file=str(token_file)),
        log_path=run_dir / "logs" / "session_server.log")
    ...  # agents talk to f"{server.url}/sessions/<id>/v1" with the token as their API key
    await server.health(); await server.stats(); await server.stop_async()

Design decisions:
- Like the gateway: a `procs.ServerProcess` (own process group, log file, PDEATHSIG shim) and a
  health wait with a deadline that names the URL it waited for; on a failed start nothing is left
  running. `/health` is the probe because it is the one route the server leaves open: probes carry
  no credentials.
- The per-job token lives in a file created with mode 0600 (`write_token_file`), and only its path
  is on the command line: argv is readable by every user through `ps`. The handle reads the file
  for its own calls (`/stats` needs the token) and never puts the token in a repr or an error.
- The engine URL is the gateway, never an engine: the server sends each session's routing key as
  `X-SMG-Routing-Key`, and only the gateway turns that into "every turn on one engine".
- `max_context_tokens = 0` passes no flag: the server then reads the model's own context length
  from its config.json.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from miles.engines.procs import ServerProcess


class SessionServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the fleet decides about the session server (the recipe's `[session]` plus places)."""

    engine_url: str                 # the gateway in front of the engines
    model_path: str                 # tokenizer and config.json
    port: int
    token_file: str                 # "" : open (tests only; the fleet always sets one)
    host: str = "127.0.0.1"
    family: str = "qwen3"
    max_context_tokens: int = 0     # 0: the model's
    session_ttl_s: float = 3600.0
    message_matcher: str = "default"
    max_body_bytes: int = 4 << 20
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"session server port: expected 1..65535, got {self.port!r}")
        if self.max_context_tokens < 0:
            raise ValueError(f"session.max_context_tokens: expected >= 0 (0: the model's), got "
                             f"{self.max_context_tokens!r}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session.session_ttl_s: expected > 0, got {self.session_ttl_s!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def write_token_file(path: str | Path) -> Path:
    """Write a fresh random token to `path`, readable by its owner only (0600), and return the path.

    The file is created 0600 (never world-readable, not even for a moment) and an existing one is
    narrowed to 0600 before it is overwritten.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
    finally:
        os.close(fd)
    return path


def build_command(config: SessionServerConfig, *, python: str = sys.executable) -> list[str]:
    """The `python -m miles.tito.server ...` command line (no secret on it)."""
    cmd = [python, "-m", "miles.tito.server", "--engine-url", config.engine_url,
           "--model-path", config.model_path, "--family", config.family,
           "--host", config.host, "--port", str(config.port),
           "--session-ttl-s", repr(float(config.session_ttl_s)),
           "--message-matcher", config.message_matcher, "--log-level", config.log_level,
           "--max-body-bytes", str(config.max_body_bytes)]
    if config.max_context_tokens:
        cmd += ["--max-context-tokens", str(config.max_context_tokens)]
    if config.token_file:
        cmd += ["--token-file", config.token_file]
    return cmd


class SessionServerHandle:
    """One running session server: `url`, `process`, `await health()`, `await stats()`, `stop()`."""

    def __init__(self, config: SessionServerConfig, *, log_path: str | Path | None = None,
                 python: str = sys.executable):
        self.config = config
        # The server reads its token from the file; an inherited variable must not override it.
        env = {k: v for k, v in os.environ.items() if k != "MILES_SESSION_TOKEN"}
        self.process = ServerProcess(f"session-server-{config.port}",
                                     build_command(config, python=python), env=env,
                                     log_path=log_path)

    @property
    def url(self) -> str:
        return self.config.url

    def __repr__(self) -> str:
        return f"SessionServerHandle(url={self.url!r}, pid={self.process.pid})"

    def start(self) -> SessionServerHandle:
        self.process.start()
        return self

    async def wait_ready(self, timeout_s: float) -> None:
        await self.process.wait_healthy(self.url, timeout_s=timeout_s, path="/health")

    async def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """`GET /health`; raises `aiohttp.ClientError` / `asyncio.TimeoutError` / `RuntimeError`."""
        return await self._get("/health", timeout_s, token=False)

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """`GET /stats` (turns, errors, open sessions...), sent with the job's token."""
        return await self._get("/stats", timeout_s, token=True)

    async def _get(self, path: str, timeout_s: float, *, token: bool) -> dict[str, Any]:
        headers = {}
        if token and self.config.token_file:
            headers["Authorization"] = f"Bearer {Path(self.config.token_file).read_text().strip()}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(self.url + path, headers=headers) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"session server {self.url}{path}: HTTP {resp.status}: "
                                       f"{body[:200].decode('utf-8', 'replace')}")
                return msgspec.json.decode(body)

    def stop(self, grace_s: float = 5.0) -> int | None:
        return self.process.stop(grace_s)

    async def stop_async(self, grace_s: float = 5.0) -> int | None:
        return await asyncio.to_thread(self.stop, grace_s)


async def launch_session_server(config: SessionServerConfig, log_path: str | Path | None = None,
                                *, timeout_s: float = 120.0,
                                python: str = sys.executable) -> SessionServerHandle:
    """Start the session server and wait until `/health` answers; on failure nothing is left
    running and the error names the URL, the command and the log's last lines."""
    server = SessionServerHandle(config, log_path=log_path, python=python).start()
    try:
        await server.wait_ready(timeout_s)
    except BaseException:
        await server.stop_async(grace_s=2.0)
        raise
    return server
