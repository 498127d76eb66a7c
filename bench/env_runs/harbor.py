"""Harbor episodes through the real stack: the tiny qwen3 on an embedded engine, the session server
(with a token, as in the fleet), a subprocess sandbox per episode, Harbor's trial server.

    python bench/envs.py --only harbor --episodes 8

Episodes run one after another, so the times add up: `llm_s` is the session server's time
(`session_stats`: the engine's `engine_s` plus the server's own `server_s`), `env_s` Harbor's
trial time less that, `sandbox_s` the sandboxes' create and destroy (Miles' cost, counted as overhead).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time


async def _run(episodes: int) -> dict:
    from aiohttp import web

    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.procs import free_port
    from miles.envs import harbor_env
    from miles.envs.agent import run_agent
    from miles.sandboxes import SandboxSpec, get_backend
    from miles.sandboxes.hostfs import default_base_dir
    from miles.tiny import build_tiny_model
    from miles.tito.client import SessionServerClient
    from miles.tito.server import ServerConfig, SessionServer

    model = build_tiny_model(arch="qwen3")
    logs = tempfile.mkdtemp(prefix="bench-harbor-")
    engine = await launch_embedded_engine(model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=os.path.join(logs, "engine.log"))
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine.url, tokenizer=str(model), family="qwen3",
                                                      token="bench")).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    base = tempfile.mkdtemp(prefix="bench-harbor-sb-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend("subprocess", base_dir=base)
    tasks = harbor_env.write_example_tasks(os.path.join(logs, "tasks"), n=episodes)
    out = {"episodes": episodes, "env_s": 0.0, "llm_s": 0.0, "sandbox_s": 0.0, "failed": 0, "reward_sum": 0.0}
    try:
        async with SessionServerClient(f"http://127.0.0.1:{port}", token="bench") as client:
            await harbor_env._PROCESS.ready()   # the server's start-up is not an episode's cost
            t0 = time.perf_counter()
            for i in range(episodes):
                ts = time.perf_counter()
                sandbox = await backend.create(SandboxSpec(labels={"miles.bench": "harbor"}, ttl_s=600))
                out["sandbox_s"] += time.perf_counter() - ts
                try:
                    run = await run_agent(harbor_env.agent, {
                        "harbor_task": str(tasks / f"echo-{i:03d}"), "sandbox": sandbox,
                        "limits": {"max_turns": 2}, "sampling": {"temperature": 1.0, "max_tokens": 16}},
                        client, group_id=f"b{i}", rollout_id=f"b{i}/0")
                finally:
                    ts = time.perf_counter()
                    await sandbox.destroy()
                    out["sandbox_s"] += time.perf_counter() - ts
                stats = run.samples[0].metadata.get("session_stats") or {}
                llm = float(stats.get("engine_s", 0.0)) + float(stats.get("server_s", 0.0))
                out["llm_s"] += llm
                out["env_s"] += max(run.metrics.get("harbor_trial_s", 0.0) - llm, 0.0)
                out["failed"] += bool(run.error)
                out["reward_sum"] += float(run.reward["reward"]) if isinstance(run.reward, dict) else 0.0
            out["wall_s"] = time.perf_counter() - t0
    finally:
        await harbor_env.close()
        backend.spawner.close()
        await runner.cleanup()
        await engine.stop_async(grace_s=5)
        shutil.rmtree(base, ignore_errors=True)
    out["sandbox_s_per_episode"] = round(out.pop("sandbox_s") / max(episodes, 1), 4)
    return out


def run(episodes: int) -> dict:
    return asyncio.run(_run(episodes))
