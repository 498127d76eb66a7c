"""Verifiers episodes through the real stack: the tiny qwen3 on an embedded engine, the session server
(with a token, as in the fleet), the tests' echo environment served by Verifiers' own env server
(its venv, made by scripts/envs/setup_verifiers.sh) and our adapter's served mode.

    python bench/envs.py --only verifiers --episodes 8

Episodes run one after another, so the times add up: `llm_s` is the session's model time
(`session_stats`: the engine's `engine_s` plus the server's own `server_s`), `env_s` is the time of the env
server's `run` request (harness, interception proxy, rubric) less that `llm_s`. The rest is Miles'
cost: session create/collect, the ZeroMQ round trip, the reward dict. The server's start-up
(importing verifiers, loading the env) is not an episode's cost: `server_start_s` reports it. A
second pass runs the same episodes all at once (`concurrent_episodes_per_s`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def _run(episodes: int, python: str) -> dict:
    from aiohttp import web

    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.procs import free_port
    from miles.envs.agent import run_agent
    from miles.envs.verifiers_env import VerifiersEnv
    from miles.tiny import build_tiny_model
    from miles.tito.client import SessionServerClient
    from miles.tito.server import ServerConfig, SessionServer

    model = build_tiny_model(arch="qwen3")
    logs = tempfile.mkdtemp(prefix="bench-verifiers-")
    engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=os.path.join(logs, "engine.log"))
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(model), family="qwen3",
                                                      token="bench")).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    echo = VerifiersEnv({"taskset": {"id": "miles_vf_echo", "num_tasks": max(episodes, 2)},
                         "agent": {"runtime": {"type": "subprocess"}}}, python=python)
    rows = echo.tasks(seed=0, test_frac=0.0001)["train"]
    rows = (rows * (episodes // len(rows) + 1))[:episodes]
    out = {"episodes": episodes, "env_s": 0.0, "llm_s": 0.0, "failed": 0, "reward_sum": 0.0, "mode": "served"}

    def task(row: dict) -> dict:
        return {**row["metadata"], "prompt": row["prompt"], "sampling": {"temperature": 1.0, "max_tokens": 12}}

    try:
        async with SessionServerClient(f"http://127.0.0.1:{port}", token="bench") as client:
            t0 = time.perf_counter()
            await echo._get("_server", lambda: echo._open_server("bench"))
            out["server_start_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            for i, row in enumerate(rows):
                run = await run_agent(echo.served, task(row), client, group_id=f"b{i}", rollout_id=f"b{i}/0")
                stats = run.samples[0].metadata.get("session_stats", {})
                llm = float(stats.get("engine_s", 0.0)) + float(stats.get("server_s", 0.0))
                out["llm_s"] += llm
                out["env_s"] += max(run.metrics.get("verifiers_s", 0.0) - llm, 0.0)
                out["failed"] += bool(run.error)
                out["reward_sum"] += float((run.reward or {}).get("reward", 0.0))
            out["wall_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(run_agent(echo.served, task(row), client, group_id=f"c{i}",
                                                    rollout_id=f"c{i}/0") for i, row in enumerate(rows)))
            out["concurrent_episodes_per_s"] = round(episodes / (time.perf_counter() - t0), 3)
            out["failed"] += sum(bool(r.error) for r in runs)
            out["sessions_left"] = len(await client.list_sessions())
    finally:
        await echo.close()
        await runner.cleanup()
        await engine.stop_async(grace_s=5)
    return out


def run(episodes: int) -> dict:
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "envs" / "setup_verifiers.sh")], capture_output=True,
                           text=True, timeout=900, cwd=ROOT)
    if setup.returncode != 0:
        raise RuntimeError(f"setup_verifiers.sh failed: {setup.stderr[-2000:]}")
    python = str(ROOT / setup.stdout.strip().splitlines()[-1])
    path = str(ROOT / "tests" / "envs" / "verifiers_envs")   # the echo env, found by the env server
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    return asyncio.run(_run(episodes, python))
