"""Shared by the weight tests: launching embedded engines and the trainer-rank worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from miles.engines.embedded import EmbeddedEngine, launch_embedded_engine

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("weights_worker.py")
ENGINE_ARGS = ["--torch-threads", "1", "--log-level", "warning", "--random-seed", "0",
               "--max-total-tokens", "4096"]


async def start_engines(model_path, n: int, log_dir: Path, *extra: str,
                        ports: list[int] | None = None) -> list[EmbeddedEngine]:
    """n embedded engines on free loopback ports (or `ports`), started in parallel."""
    ports = ports or [free_port() for _ in range(n)]
    return list(await asyncio.gather(*[
        launch_embedded_engine(model_path, port=ports[i], extra_args=[*ENGINE_ARGS, *extra],
                               log_path=log_dir / f"engine-{i}.log") for i in range(n)]))


async def with_engines(model_path, n: int, log_dir: Path, run):
    """Start n engines and, at the same time, `run(urls)` in a thread (the trainer's start-up
    overlaps the engines'; the worker waits for /health itself); stop the engines after."""
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    starting = asyncio.ensure_future(start_engines(model_path, n, log_dir, ports=ports))
    try:
        return await asyncio.to_thread(run, urls)
    finally:
        engines = await starting
        await stop_engines(engines)


async def stop_engines(engines: list[EmbeddedEngine]) -> None:
    await asyncio.gather(*[e.stop_async(grace_s=5) for e in engines])


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out_dir: Path, *, world_size: int, env: dict[str, str],
              timeout_s: float = 180) -> list[dict]:
    """Run weights_worker.py as `world_size` trainer ranks; return each rank's JSON."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        penv = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                    PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    CUDA_VISIBLE_DEVICES="", **env)
        out = out_dir / f"{scenario}-rank{rank}.json"
        log = open(out_dir / f"{scenario}-rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)], env=penv,
                                       stdout=log, stderr=subprocess.STDOUT), out, log))
    try:
        for proc, _, _ in procs:
            proc.wait(timeout=timeout_s)
    finally:
        for proc, _, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    results = []
    for rank, (proc, out, log) in enumerate(procs):
        if proc.returncode != 0:
            text = Path(log.name).read_text()
            raise AssertionError(f"rank {rank} of {scenario!r} exited {proc.returncode}:\n{text[-6000:]}")
        results.append(json.loads(out.read_text()))
    return results
