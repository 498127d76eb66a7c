"""Tokenize large renders in worker processes, so one big tool result never stalls other sessions.

Design decisions:
- Processes, not threads: `tokenizers.Tokenizer.encode` holds the GIL for the whole call, so a
  thread frees nothing (a 3 MB tool result is about a second of encoding on one core).
- Each worker loads the same tokenizer source once, in its initializer (`load_tokenizer` is the
  in-process path too), so the ids are exactly the ones the server's own tokenizer gives.
- Workers are spawned, never forked: the server process holds an event loop and the Rust
  tokenizer's thread pool, neither of which survives a fork. The pool starts on first use (most
  turns are small and servers in tests come and go) and is shut down with the server.
- Ids come back as raw int32 bytes: one copy, no per-token objects crossing the pipe.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from miles.tito.tokenizer import load_tokenizer

_worker_tokenizer = None


def _init(source: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(source)


def _encode(text: str) -> bytes:
    return np.asarray(_worker_tokenizer.encode(text), np.int32).tobytes()


class TokenizePool:
    def __init__(self, source: str, workers: int = 1):
        if workers < 1:
            raise ValueError(f"tokenize workers: expected at least 1, got {workers}")
        self.source, self.workers = source, workers
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init, initargs=(self.source,))
        return self._pool

    async def encode(self, text: str) -> np.ndarray:
        raw = await asyncio.get_running_loop().run_in_executor(self._executor(), _encode, text)
        return np.frombuffer(raw, np.int32).copy()   # writable, like the in-process path

    async def warm(self) -> None:
        """Start every worker and load its tokenizer (the first big turn then pays nothing)."""
        await asyncio.gather(*(self.encode("warm") for _ in range(self.workers)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
