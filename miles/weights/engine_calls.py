"""Engine HTTP calls from synchronous transport code: one private event loop on a daemon thread.

Design decisions:
- Transports run in the trainer's worker thread next to blocking torch collectives, and some calls
  must be in flight *while* a collective blocks (an engine's `/update_weights_from_distributed`
  returns only once the broadcast it waits for has arrived). So calls are submitted to a loop of
  their own and return `concurrent.futures.Future`s; the caller blocks on them when it chooses.
- The loop belongs to the transport, not to the publisher: a transport works the same whether
  the publisher's loop, a test, or a bare script drives it.
- Every call to every engine goes out concurrently; `wait` raises the first failure naming the
  engine URL and what it said, after a deadline at the latest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from typing import Any

from miles.engines.client import EngineClient, EngineError


_NO_TIMEOUT_S = 24 * 3600.0


class EngineCallError(RuntimeError):
    """An engine refused or failed a control call; the message names the engine and the call."""


class EngineCalls:
    def __init__(self, engine_urls: list[str], *, timeout_s: float = 60.0, name: str = "weights"):
        self.engine_urls = list(engine_urls)
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-http", daemon=True)
        self._thread.start()
        self._clients: list[EngineClient] = self.run(self._make_clients())

    async def _make_clients(self) -> list[EngineClient]:
        # Created on the private loop: aiohttp sessions belong to the loop that made them. Their
        # own timeouts are out of the way; every call is bounded by its caller's `timeout_s`.
        return [EngineClient(u, timeout_s=_NO_TIMEOUT_S, weight_update_timeout_s=_NO_TIMEOUT_S,
                             max_retries=0) for u in self.engine_urls]

    def run(self, coro, timeout_s: float | None = None) -> Any:
        """Run one coroutine on the private loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def submit(self, index: int, method: str, *args, timeout_s: float | None = None,
               **kwargs) -> cf.Future:
        """Start `EngineClient.<method>(*args, **kwargs)` on engine `index`; returns its Future."""
        client = self._clients[index]

        async def call():
            coro = getattr(client, method)(*args, **kwargs)
            return await asyncio.wait_for(coro, timeout_s or self.timeout_s)

        return asyncio.run_coroutine_threadsafe(call(), self._loop)

    def submit_all(self, method: str, *args, indices: list[int] | None = None,
                   timeout_s: float | None = None, **kwargs) -> list[cf.Future]:
        idx = range(len(self._clients)) if indices is None else indices
        return [self.submit(i, method, *args, timeout_s=timeout_s, **kwargs) for i in idx]

    def wait(self, futures: list[cf.Future], what: str, timeout_s: float | None = None,
             indices: list[int] | None = None) -> list[Any]:
        """Results of `futures` (one per engine); the first failure raises EngineCallError."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        idx = list(range(len(futures))) if indices is None else indices
        results = []
        for i, fut in zip(idx, futures):
            try:
                results.append(fut.result(max(deadline - time.monotonic(), 0.0)))
            except (cf.TimeoutError, asyncio.TimeoutError, TimeoutError):
                raise EngineCallError(f"{what}: engine {self.engine_urls[i]} did not answer within "
                                      f"{timeout_s or self.timeout_s} s") from None
            except EngineError as e:
                raise EngineCallError(f"{what}: engine {self.engine_urls[i]} failed: {e.message}") from e
            except Exception as e:  # noqa: BLE001 - name the engine whatever went wrong
                raise EngineCallError(f"{what}: engine {self.engine_urls[i]} failed: "
                                      f"{type(e).__name__}: {e}") from e
            _check_success(results[-1], what, self.engine_urls[i])
        return results

    def call_all(self, method: str, *args, what: str | None = None, timeout_s: float | None = None,
                 indices: list[int] | None = None, **kwargs) -> list[Any]:
        futures = self.submit_all(method, *args, indices=indices, timeout_s=timeout_s, **kwargs)
        return self.wait(futures, what or method, timeout_s, indices=indices)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown():
            for c in self._clients:
                await c.close()

        try:
            self.run(shutdown(), timeout_s=5.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()


def _check_success(result: Any, what: str, url: str) -> None:
    # SGLang answers some refusals with HTTP 200 and {"success": false, "message": ...}.
    if isinstance(result, dict) and result.get("success") is False:
        raise EngineCallError(f"{what}: engine {url} refused: {result.get('message', result)}")
