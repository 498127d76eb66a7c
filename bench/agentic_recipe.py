"""The agentic recipes end to end: episodes per second of a recipe's own task set, harness, sandboxes
and verifier, where an episode's time goes, and how busy the engine was.

    python bench/agentic.py --recipe swe [--episodes 32] [--concurrency 4] [--agents harness,oracle]
    python bench/agentic.py --recipe swe --device cuda --model-config qwen2.5-0.5b      (one GPU)
    python bench/agentic.py --recipe terminal ...

Prints one JSON line: {"bench": "agentic_recipe", "recipe", "results": [one per agent: episodes_per_s,
sandbox_share, engine_busy_frac, time split per episode, reward], "machine", ...}.

Design decisions:
- The same parts as a training run: the recipe's held-out rows (`data.task`), its harness as a
  `rollout.agent` through `miles.envs.agent.run_agent` (session created, collected, closed), a
  fresh sandbox per episode with the task's files, the verifier after the agent, destroy. The
  stack is bench/agentic.py's: embedded engine -> smg -> TITO session server, each a real process.
- Two agents per recipe: `harness`, the model-driven agent (with a random model it mostly answers
  in prose after one turn: the floor of an episode's cost), and `oracle`, the scripted agent that
  makes one model call and then the task's known fix through the harness's tools (every tool path
  and the verifier run; its reward must be 1.0, which the bench checks).
- Time split per episode: `sandbox` = create + file upload + the tools' time inside the agent +
  verifier + destroy; `llm` = the agent's time in model calls; `session` = the rest of the agent's
  run (session create/collect, the harness's own work). `sandbox_share` = sandbox / episode.
- `engine_busy_frac`: the engine's own account, sampled every `POLL_S` from its `/metrics` gauges
  (running + queued requests > 0), over the timed window: the share of the run in which the engine
  had work. On a 2-core CPU the tools and the engine compete for the same cores.
- Each recipe is one function of `RECIPES` returning its rows, agents and verifier; the episode
  loop is shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

POLL_S = 0.05


class EngineBusy:
    """Samples the engine's running + queued request gauges until stopped."""

    def __init__(self, url: str):
        self.url, self.samples, self.busy = url.rstrip("/") + "/metrics", 0, 0
        self._task: asyncio.Task | None = None

    async def _poll(self, http) -> None:
        pattern = re.compile(r"^sglang:num_(?:running|queue)_reqs\{[^}]*\} (\S+)$", re.M)
        while True:
            async with http.get(self.url) as r:
                text = await r.text()
            self.samples += 1
            self.busy += sum(float(v) for v in pattern.findall(text)) > 0
            await asyncio.sleep(POLL_S)

    def start(self, http) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(http))

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.busy / max(self.samples, 1)


async def one_episode(row: dict, agent_fn, verify_fn, backend, client, index: int, limits: dict) -> dict:
    from miles.envs.agent import run_agent
    from miles.sandboxes import SandboxSpec

    meta = row["metadata"]
    t0 = time.monotonic()
    sandbox = await backend.create(SandboxSpec(labels={"miles.bench": "agentic-recipe"}, ttl_s=900))
    try:
        files = {k: v.encode() for k, v in (meta.get("files") or {}).items()}
        if files:
            await sandbox.upload_dir(sandbox.workdir, files)
        setup_s = time.monotonic() - t0
        task = {**meta, "prompt": row["prompt"], "label": row["label"], "sandbox": sandbox, "limits": limits,
                "sampling": {"temperature": 1.0, "seed": index}}
        t = time.monotonic()
        run = await run_agent(agent_fn, task, client, group_id=f"bench-{index}", rollout_id=f"bench-{index}",
                              agent_timeout_s=limits["episode_timeout_s"])
        agent_s = time.monotonic() - t
        if run.error:
            raise RuntimeError(f"episode {index} ({meta.get('task_id')}): {run.error}")
        t = time.monotonic()
        reward = await verify_fn(type("Episode", (), {"metadata": meta, "label": row["label"]})(), sandbox=sandbox)
        verify_s = time.monotonic() - t
    finally:
        t = time.monotonic()
        await sandbox.destroy()
        destroy_s = time.monotonic() - t
    total = time.monotonic() - t0
    llm_s, tool_s = run.metrics.get("chat_s", 0.0), run.metrics.get("tool_s", 0.0)
    return {"total_s": total, "llm_s": llm_s, "sandbox_s": setup_s + tool_s + verify_s + destroy_s,
            "session_s": max(agent_s - llm_s - tool_s, 0.0), "verify_s": verify_s,
            "create_destroy_s": setup_s + destroy_s, "turns": run.metrics.get("turns", 0.0),
            "reward": reward if not isinstance(reward, dict)
            else reward.get("resolved", reward.get("reward", 0.0))}


async def run_agent_bench(name: str, rows: list[dict], agent_fn, verify_fn, stack, args, limits: dict) -> dict:
    import aiohttp

    from miles.sandboxes import get_backend
    from miles.sandboxes.hostfs import default_base_dir
    from miles.tito.client import SessionServerClient

    base = tempfile.mkdtemp(prefix="miles-recipe-bench-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend(args.backends.split(",")[0], base_dir=base)
    gate = asyncio.Semaphore(args.concurrency)
    try:
        async with SessionServerClient(stack.session_url, timeout_s=300) as client, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30)) as http:
            async def episode(i: int) -> dict:
                async with gate:
                    return await one_episode(rows[i % len(rows)], agent_fn, verify_fn, backend, client, i, limits)
            await episode(10_000)   # warm-up: first sandbox, first engine call
            busy = EngineBusy(stack.engine.url)
            busy.start(http)
            t0 = time.monotonic()
            eps = await asyncio.gather(*(episode(i) for i in range(args.episodes)))
            wall = time.monotonic() - t0
            busy_frac = await busy.stop()
    finally:
        left = await backend.sweep({"miles.bench": "agentic-recipe"})
        await backend.close()
        if getattr(backend, "spawner", None) is not None:   # the host backends' fork server
            backend.spawner.close()
        shutil.rmtree(base, ignore_errors=True)
    if left:
        raise AssertionError(f"{left} sandboxes outlived the bench")
    total = sum(e["total_s"] for e in eps)
    med = {k: round(statistics.median(e[k] for e in eps) * 1e3, 1)
           for k in ("total_s", "llm_s", "sandbox_s", "session_s", "verify_s", "create_destroy_s")}
    return {"agent": name, "episodes": len(eps), "wall_s": round(wall, 2),
            "episodes_per_s": round(len(eps) / wall, 3),
            "sandbox_share": round(sum(e["sandbox_s"] for e in eps) / total, 4),
            "llm_share": round(sum(e["llm_s"] for e in eps) / total, 4),
            "engine_busy_frac": round(busy_frac, 4), "engine_busy_samples": busy.samples,
            "median_ms": {k.removesuffix("_s"): v for k, v in med.items()},
            "turns_mean": round(statistics.mean(e["turns"] for e in eps), 2),
            "reward_mean": round(statistics.mean(e["reward"] for e in eps), 4)}


def swe(args) -> tuple[list[dict], dict[str, Callable], Callable, dict]:
    from miles.agentic.swe.harness import agent
    from miles.agentic.swe.scripted import oracle_agent
    from miles.agentic.swe.tasks import tasks
    from miles.agentic.swe.verify import verify
    limits = {"max_turns": 4, "max_episode_tokens": 512, "turn_timeout_s": 120.0, "episode_timeout_s": 300.0,
              "tool_timeout_s": 10.0}   # recipes/swe_cpu.toml's [agent]
    return tasks(seed=0)["test"], {"harness": agent, "oracle": oracle_agent}, verify, limits


def terminal(args) -> tuple[list[dict], dict[str, Callable], Callable, dict]:
    """The terminal recipe's held-out tasks: compact prompts on CPU (recipes/terminal_cpu.toml), the
    tool schemas sent on CUDA (recipes/terminal_h200.toml); its agent, oracle and Harbor verifier."""
    from miles.agentic.terminal.agent import agent, oracle_agent, verify
    from miles.agentic.terminal.tasks import terminal_tasks
    limits = {"max_turns": 4, "max_episode_tokens": 512, "turn_timeout_s": 60.0, "episode_timeout_s": 180.0,
              "tool_timeout_s": 10.0}   # recipes/terminal_cpu.toml's [agent]
    rows = terminal_tasks(seed=0, declare_tools=args.device.startswith("cuda"))["test"]
    return rows, {"harness": agent, "oracle": oracle_agent}, verify, limits


RECIPES = {"swe": swe, "terminal": terminal}


async def main(args) -> None:
    """Called by bench/agentic.py with its parsed arguments when `--recipe` is given."""
    from agentic import Stack, build_model, machine

    rows, agents, verify_fn, limits = RECIPES[args.recipe](args)
    wanted = args.agents.split(",")
    unknown = [a for a in wanted if a not in agents]
    if unknown:
        raise SystemExit(f"--agents: {unknown} not among {sorted(agents)}")
    config = args.model_config or ("qwen2.5-0.5b" if args.device.startswith("cuda") else "tiny")
    model = build_model(config)
    logs = Path(tempfile.mkdtemp(prefix="miles-recipe-bench-logs-"))
    results = []
    async with Stack(model, args.device, logs) as stack:
        for name in wanted:
            results.append(await run_agent_bench(name, rows, agents[name], verify_fn, stack, args, limits))
    oracle = next((r for r in results if r["agent"] == "oracle"), None)
    out = {"bench": "agentic_recipe", "recipe": args.recipe, "model": config, "device": args.device,
           "concurrency": args.concurrency, "backend": args.backends.split(",")[0], "results": results,
           "targets": {"oracle_reward_is_1": oracle["reward_mean"] == 1.0} if oracle else {},
           "loadavg_1m": round(os.getloadavg()[0], 2), "machine": machine(args.device)}
    print(json.dumps(out), flush=True)
