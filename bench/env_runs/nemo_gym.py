"""NeMo Gym episodes through the real stack: the tiny qwen3 on an embedded engine, the session server
(with a token, as in the fleet), NeMo Gym's SimpleAgent and its example multi-reward resources server.

    python bench/envs.py --only nemo_gym --episodes 8

Episodes run one after another, so the times add up: `llm_s` is the session server's time
(`session_stats`: the engine's `engine_s` plus the server's own `server_s`), `env_s` the
`/run` time less that (NeMo Gym's agent loop, seed_session, tools, verify).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time


async def _run(episodes: int) -> dict:
    from aiohttp import web

    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.procs import free_port
    from miles.envs import nemo_gym_env
    from miles.envs.agent import run_agent
    from miles.tiny import build_tiny_model
    from miles.tito.client import SessionServerClient
    from miles.tito.server import ServerConfig, SessionServer

    model = build_tiny_model(arch="qwen3")
    logs = tempfile.mkdtemp(prefix="bench-nemo-gym-")
    engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=os.path.join(logs, "engine.log"))
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(model), family="qwen3",
                                                      token="bench")).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    splits = nemo_gym_env.example_tasks(seed=0)
    rows = splits["train"] + splits["test"]
    out = {"episodes": episodes, "env_s": 0.0, "llm_s": 0.0, "failed": 0, "reward_sum": 0.0}
    try:
        async with SessionServerClient(f"http://127.0.0.1:{port}", token="bench") as client:
            await nemo_gym_env._PROCESS.ready()   # the server's start-up is not an episode's cost
            t0 = time.perf_counter()
            for i in range(episodes):
                run = await run_agent(nemo_gym_env.agent, {
                    "nemo_gym": rows[i % len(rows)]["metadata"]["nemo_gym"],
                    "sampling": {"temperature": 1.0, "max_tokens": 24}},
                    client, group_id=f"b{i}", rollout_id=f"b{i}/0")
                stats = run.samples[0].metadata.get("session_stats") or {}
                llm = float(stats.get("engine_s", 0.0)) + float(stats.get("server_s", 0.0))
                out["llm_s"] += llm
                out["env_s"] += max(run.metrics.get("nemo_gym_run_s", 0.0) - llm, 0.0)
                out["failed"] += bool(run.error)
                out["reward_sum"] += float(run.reward["reward"]) if isinstance(run.reward, dict) else \
                    float(run.reward or 0.0)
            out["wall_s"] = time.perf_counter() - t0
    finally:
        await nemo_gym_env.close()
        await runner.cleanup()
        await engine.stop_async(grace_s=5)
    return out


def run(episodes: int) -> dict:
    return asyncio.run(_run(episodes))
