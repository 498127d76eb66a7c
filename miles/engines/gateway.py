"""Launch and drive the `smg` model gateway (pinned 1.13.0) in front of the rollout engines.

The rollout side sends `/generate` to `Gateway.url` with an `X-SMG-Routing-Key` header (one key
per session); control calls (pause, weight updates) go to each engine directly through
`Gateway.engine_urls`, or through smg's RL fan-out (`Gateway.fanout`).

    engines = [await launch_sglang(SGLangServerArgs(model_path=m, port=p)) for p in ports]
    gateway = await launch_gateway(GatewayConfig(port=free_port(),
                                                 prometheus_port=free_port()),
                                   [e.url for e in engines])
    ...  # EngineClient(gateway.url).generate(ids, params, routing_key=session_id)
    await gateway.add_worker(url); await gateway.remove_worker(url)
    gateway.stop(); [e.stop() for e in engines]

Design decisions:
- The real `smg` binary (`python -m smg launch`), not a Python proxy: it forwards every
  top-level `/generate` field (`return_routed_experts`, `session_id`, ...) and is what
  production runs. `procs.ServerProcess` gives it its own process group and a log file.
- Session affinity: `--policy manual` pins each routing key to one worker, and
  `--assignment-mode min_load` sends a *new* key to the worker with the fewest requests
  (smg's default for `manual` is random). `consistent_hashing` is available as a policy too.
- DP attention (`--attn-dp-size N` engines): `dp_aware=True` makes smg read the engine's DP
  width from `/server_info`, register virtual workers `url@0 .. url@N-1` and inject
  `data_parallel_rank` into each forwarded body. Workers are therefore matched by URL
  prefix, never by the worker id that `POST /workers` returns (the virtual ones differ).
- Retries are off by default (`max_retries=0` -> `--disable-retries`): smg would silently
  re-run a request whose engine died on another engine. The rollout worker owns the retry
  decision (it knows the sample, its weight version, and whether partial output exists), so
  a dead engine surfaces at once as a 5xx with smg's upstream error.
- Health checks probe `/model_info`, not SGLang's `/health`: `/health` runs a 1-token
  generate and `/ready` answers 503 while generation is paused, so during every weight
  update smg would mark all engines unhealthy and refuse requests instead of queueing them.
  `/model_info` answers whenever the HTTP server is up, which is what routing needs; a
  wedged scheduler is the node supervisor's job. Probes are frequent (every 2 s, two failures)
  so a killed engine leaves routing within ~5 s even if nobody calls `remove_worker`.
- Worker overload protection is off: RL rollouts keep engines saturated on purpose, and
  smg's protection would move sticky sessions off their engine (losing the prefix cache).
- Always an explicit prometheus host/port (smg's default binds 0.0.0.0:29000) and a short
  shutdown grace period (default 180 s, during which the old gateway keeps its ports).
- smg's tokenizer autoload is off: Miles sends token ids, and autoload would try a model hub.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from miles.engines.procs import ServerProcess, ServerStartError, table_to_flags

logger = logging.getLogger(__name__)

SMG_VERSION = "1.13.0"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
POLICIES = ("manual", "consistent_hashing", "round_robin", "random", "cache_aware",
            "power_of_two", "least_load", "prefix_hash")
ASSIGNMENT_MODES = ("random", "min_load", "min_group", "delegate")

_OWNED_KEYS = {
    "host": "host", "port": "port", "worker_urls": "worker_urls (launch argument)",
    "policy": "policy", "assignment_mode": "assignment_mode", "dp_aware": "dp_aware",
    "enable_rl": "enable_rl", "prometheus_host": "host", "prometheus_port": "prometheus_port",
    "shutdown_grace_period_secs": "shutdown_grace_period_s", "disable_retries": "max_retries",
    "retry_max_retries": "max_retries", "health_check_interval_secs": "health_check_interval_s",
    "health_failure_threshold": "health_failure_threshold",
    "health_check_endpoint": "health_check_endpoint",
    "request_timeout_secs": "request_timeout_s", "log_level": "log_level",
    "disable_tokenizer_autoload": "(always set)",
}


class GatewayError(RuntimeError):
    """A gateway control call failed (the message carries smg's answer)."""


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What Miles decides about the gateway; `extra_args` passes other smg flags through."""

    port: int
    prometheus_port: int
    host: str = "127.0.0.1"
    policy: str = "manual"
    assignment_mode: str | None = "min_load"  # how a new routing key picks its worker
    dp_aware: bool = False
    enable_rl: bool = True  # mount /v1/rl (worker discovery and control fan-out)
    max_retries: int = 0
    health_check_interval_s: int = 2
    health_failure_threshold: int = 2  # one slow probe must not move sticky sessions
    health_check_endpoint: str = "/model_info"
    request_timeout_s: int = 1800
    shutdown_grace_period_s: int = 2
    log_level: str = "warn"
    extra_args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"gateway.policy: expected one of {POLICIES}, got {self.policy!r}")
        if self.assignment_mode is not None and self.assignment_mode not in ASSIGNMENT_MODES:
            raise ValueError(f"gateway.assignment_mode: expected one of {ASSIGNMENT_MODES} or "
                             f"null, got {self.assignment_mode!r}")
        for name in ("port", "prometheus_port", "health_check_interval_s",
                     "health_failure_threshold", "request_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"gateway.{name}: expected an integer >= 1, got "
                                 f"{getattr(self, name)!r}")
        if self.port == self.prometheus_port:
            raise ValueError(f"gateway.prometheus_port: must differ from gateway.port "
                             f"({self.port})")
        if self.max_retries < 0 or self.shutdown_grace_period_s < 0:
            raise ValueError("gateway.max_retries and gateway.shutdown_grace_period_s: expected "
                             f">= 0, got {self.max_retries!r} and {self.shutdown_grace_period_s!r}")
        table_to_flags(self.extra_args, section="gateway.smg", owned=_OWNED_KEYS)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_command(config: GatewayConfig, worker_urls: Sequence[str] = (), *,
                  python: str = sys.executable) -> list[str]:
    """The `python -m smg launch ...` command line."""
    cmd = [python, "-m", "smg", "launch", "--host", config.host, "--port", str(config.port),
           "--policy", config.policy,
           "--prometheus-host", config.host, "--prometheus-port", str(config.prometheus_port),
           "--shutdown-grace-period-secs", str(config.shutdown_grace_period_s),
           "--health-check-interval-secs", str(config.health_check_interval_s),
           "--health-failure-threshold", str(config.health_failure_threshold),
           "--health-check-endpoint", config.health_check_endpoint,
           "--request-timeout-secs", str(config.request_timeout_s),
           "--log-level", config.log_level,
           "--disable-worker-overload-protection", "--disable-tokenizer-autoload"]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if config.assignment_mode is not None:
        cmd += ["--assignment-mode", config.assignment_mode]
    if config.dp_aware:
        cmd.append("--dp-aware")
    if config.enable_rl:
        cmd.append("--enable-rl")
    if config.max_retries == 0:
        cmd.append("--disable-retries")
    else:
        cmd += ["--retry-max-retries", str(config.max_retries)]
    return cmd + table_to_flags(config.extra_args, section="gateway.smg", owned=_OWNED_KEYS)


def _is_entry_of(entry: Mapping[str, Any], engine_url: str) -> bool:
    """A /workers entry belongs to an engine URL (dp-aware entries are `url@rank`)."""
    url = entry.get("url", "")
    return url == engine_url or url.startswith(engine_url + "@")


class Gateway:
    """One smg process in front of a set of engines.

    `url` is what the rollout side talks to; `engine_urls` are the engines behind it, for
    control calls that must reach every engine (pause, weight updates).
    """

    def __init__(self, config: GatewayConfig, worker_urls: Sequence[str] = (), *,
                 log_path: str | Path | None = None, python: str = sys.executable):
        self.config = config
        self._engine_urls = [u.rstrip("/") for u in worker_urls]
        self.process = ServerProcess(f"smg-{config.port}",
                                     build_command(config, self._engine_urls, python=python),
                                     log_path=log_path)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def engine_urls(self) -> list[str]:
        return list(self._engine_urls)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Gateway:
        try:
            installed = importlib.metadata.version("smg")
        except importlib.metadata.PackageNotFoundError:
            raise ServerStartError(f"smg is not installed (pip install smg=={SMG_VERSION})")
        if installed != SMG_VERSION:
            logger.warning("smg %s is installed; Miles is tested with smg==%s", installed,
                           SMG_VERSION)
        self.process.start()
        return self

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until the gateway answers and every engine is registered and healthy."""
        deadline = time.monotonic() + timeout_s
        await self.process.wait_healthy(self.url, timeout_s=timeout_s, path="/liveness")
        await self._wait_workers(self._engine_urls, healthy=True,
                                 timeout_s=max(0.0, deadline - time.monotonic()))

    def stop(self, grace_s: float | None = None) -> int | None:
        # smg drains for shutdown_grace_period_s after SIGTERM; allow that plus a margin.
        return self.process.stop(self.config.shutdown_grace_period_s + 5.0
                                 if grace_s is None else grace_s)

    async def stop_async(self, grace_s: float | None = None) -> int | None:
        return await asyncio.to_thread(self.stop, grace_s)

    # ---- workers ---------------------------------------------------------------------------
    async def workers(self) -> list[dict[str, Any]]:
        """smg's `GET /workers` entries (id, url, is_healthy, status, load, labels...)."""
        return (await self._request("GET", "/workers")).get("workers", [])

    async def add_worker(self, engine_url: str, *, timeout_s: float = 60.0) -> None:
        """Register an engine at runtime and wait until smg routes to it."""
        engine_url = engine_url.rstrip("/")
        await self._request("POST", "/workers", json={"url": engine_url}, expect=(200, 201, 202))
        if engine_url not in self._engine_urls:
            self._engine_urls.append(engine_url)
        await self._wait_workers([engine_url], healthy=True, timeout_s=timeout_s)

    async def remove_worker(self, engine_url: str, *, timeout_s: float = 30.0) -> None:
        """Stop routing to an engine (all its DP ranks); returns once smg routes nothing new to
        it. smg keeps the entry as `draining` for ~5 s so requests in flight can finish."""
        engine_url = engine_url.rstrip("/")
        entries = [w for w in await self.workers() if _is_entry_of(w, engine_url)]
        if not entries and engine_url not in self._engine_urls:
            raise GatewayError(f"remove_worker: engine_url={engine_url!r} is not registered "
                               f"with the gateway at {self.url}")
        for entry in entries:
            await self._request("DELETE", f"/workers/{entry['id']}", expect=(200, 202, 204, 404))
        if engine_url in self._engine_urls:
            self._engine_urls.remove(engine_url)
        await self._wait_workers([engine_url], healthy=False, timeout_s=timeout_s)

    async def _wait_workers(self, engine_urls: Sequence[str], *, healthy: bool,
                            timeout_s: float) -> None:
        """Wait until each engine is routable (all its entries healthy) or, with
        healthy=False, until none of its entries is routable any more (gone or draining)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.process.alive:
                raise self.process.exit_error("while waiting for its workers")
            entries = await self.workers()
            pending = []
            for u in engine_urls:
                mine = [w for w in entries if _is_entry_of(w, u)]
                routable = [w for w in mine if w.get("status", "ready") == "ready"
                            and w.get("is_healthy")]
                if healthy and (not mine or len(routable) < len(mine)):
                    pending.append(f"{u} ({[w.get('status') for w in mine] or 'not registered'})")
                elif not healthy and routable:
                    pending.append(f"{u} (still routable)")
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"gateway {self.url}: workers not in the expected state after "
                    f"timeout_s={timeout_s}: {', '.join(pending)}\nlast lines of "
                    f"{self.process.log_path}:\n{self.process.log_tail()}")
            await asyncio.sleep(0.1)

    # ---- RL control fan-out ----------------------------------------------------------------
    async def fanout(self, engine_path: str, body: Mapping[str, Any] | None = None, *,
                     selector: str = "engine=sglang", allow_partial: bool = False,
                     timeout_s: float = 600.0) -> dict[str, Any]:
        """POST `body` to `engine_path` on every engine through `/v1/rl/engine/...` (once per
        engine, not per DP rank). Returns smg's `{results, failed, total, succeeded}`; raises
        if any engine failed unless `allow_partial`."""
        if not self.config.enable_rl:
            raise GatewayError("fanout: the gateway runs without enable_rl; call the engines "
                               "directly through engine_urls")
        path = f"/v1/rl/engine/{engine_path.lstrip('/')}"
        # SGLang rejects a bodyless POST on pause/continue, so an absent body is `{}`.
        result = await self._request("POST", path, json=dict(body or {}), params={
            "selector": selector}, expect=(200, 207), timeout_s=timeout_s)
        if result.get("failed") and not allow_partial:
            failures = "; ".join(f"{f.get('url')}: {f.get('error')} {f.get('message', '')}"
                                 for f in result["failed"])
            raise GatewayError(f"fanout {engine_path}: {len(result['failed'])} of "
                               f"{result.get('total')} engines failed: {failures}")
        return result

    async def _request(self, method: str, path: str, *, json: Any = None,
                       params: Mapping[str, str] | None = None, expect: Sequence[int] = (200,),
                       timeout_s: float = 30.0) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.request(method, self.url + path, json=json,
                                           params=params) as resp:
                    text = await resp.text()
                    if resp.status not in expect:
                        raise GatewayError(f"{method} {self.url}{path} -> HTTP {resp.status}: "
                                           f"{text[:500]}")
                    if not text:
                        return {}
                    try:
                        return msgspec.json.decode(text)
                    except msgspec.DecodeError:
                        return {"text": text}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise GatewayError(f"{method} {self.url}{path} failed: {type(e).__name__}: {e}"
                               ) from e


async def launch_gateway(config: GatewayConfig, worker_urls: Sequence[str] = (), *,
                         timeout_s: float = 120.0, **kwargs: Any) -> Gateway:
    """Start smg in front of `worker_urls` and wait until every engine is routable.

    On failure nothing is left running.
    """
    gateway = Gateway(config, worker_urls, **kwargs).start()
    try:
        await gateway.wait_ready(timeout_s)
    except BaseException:
        await gateway.stop_async(grace_s=5.0)
        raise
    return gateway
