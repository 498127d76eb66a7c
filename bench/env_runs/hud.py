"""HUD rollouts through the real stack: the tiny qwen3 on an embedded engine, the session server
(with a token, as in the fleet), HUD's LocalRuntime serving the digits env template and Miles'
agent driving HUD's run, in this process (`hud_openai_agent.py`: the same with HUD's own
OpenAIChatAgent, `metadata.hud.agent = "hud"`, the baseline for the agent's cost).

    python bench/envs.py --only hud --episodes 8

Episodes run one after another, so the times add up: `llm_s` is the session server's time
(`session_stats`: the engine's time plus the server's own), `env_s` is HUD's rollout time less
that (LocalRuntime's env load and serve, HUD's control channel, the template, the agent loop, the
grade). The rest is Miles' cost: the agent layer and the session bookkeeping.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time


async def _run(episodes: int, agent: str = "miles") -> dict:
    from aiohttp import web

    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.procs import free_port
    from miles.envs import hud_env
    from miles.envs.agent import run_agent
    from miles.tiny import build_tiny_model
    from miles.tito.client import SessionServerClient
    from miles.tito.server import ServerConfig, SessionServer

    model = build_tiny_model(arch="qwen3")
    logs = tempfile.mkdtemp(prefix="bench-hud-")
    engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=os.path.join(logs, "engine.log"))
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(model), family="qwen3",
                                                      token="bench")).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rows = hud_env.example_rows(episodes, seed=0, agent=agent)
    out = {"episodes": episodes, "env_s": 0.0, "llm_s": 0.0, "failed": 0, "reward_sum": 0.0}
    try:
        hud_env.load_task(rows[0]["metadata"]["hud"])   # importing HUD is not an episode's cost
        async with SessionServerClient(f"http://127.0.0.1:{port}", token="bench") as client:
            t0 = time.perf_counter()
            for i, row in enumerate(rows):
                run = await run_agent(hud_env.agent, {
                    **row["metadata"], "prompt": row["prompt"], "limits": {"max_turns": 1},
                    "sampling": {"temperature": 1.0, "max_tokens": 12}},
                    client, group_id=f"b{i}", rollout_id=f"b{i}/0")
                llm = llm_time(run)
                out["llm_s"] += llm
                out["env_s"] += max(run.metrics.get("hud_rollout_s", 0.0) - llm, 0.0)
                out["failed"] += bool(run.error)
                out["reward_sum"] += float(run.reward or 0.0)
            out["wall_s"] = time.perf_counter() - t0
    finally:
        await runner.cleanup()
        await engine.stop_async(grace_s=5)
    return out


def llm_time(run) -> float:
    """The session server's account of the episode: engine time plus its own (template, tokens)."""
    stats = run.samples[0].metadata.get("session_stats") or {}
    return float(stats.get("engine_s", 0.0)) + float(stats.get("server_s", 0.0))


def run(episodes: int, agent: str = "miles") -> dict:
    return asyncio.run(_run(episodes, agent))
