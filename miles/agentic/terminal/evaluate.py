"""Held-out pass@k of the terminal agent on one checkpoint, outside a run: `eval.mode = "external"`.

    [eval]
    mode = "external"
    command = "python -m miles.agentic.terminal.evaluate --checkpoint {checkpoint} --step {step} --k 4"

Starts an embedded engine on the checkpoint and a session server in front of it, runs the terminal
agent `k` times on every held-out task (a fresh sandbox each, the Harbor verifier after), and
prints one JSON line of metrics last, as the evaluator expects (it adds the `eval/` prefix): reward,
pass@1, pass@k, k, n, verifier_errors, plus timings (episodes_per_s, the sandbox's and the model's
shares of the episode time).

Design decisions:
- The episodes run exactly as the rollout worker's: `run_agent` (a session per episode, always
  collected and closed), `LazySandbox` from the `[sandbox]`-shaped config and the row's files, the
  verifier `agent.verify`. The evaluation is the training task's.
- Sample j of test row i samples with seed `miles.seeds.eval_seed(seed, i, j)` (the in-run
  evaluator's rule), so k samples at temperature > 0 are k draws; pass@k is
  `miles.actors.evaluator.pass_at_k`, averaged over tasks.
- A verifier failure (timeout, no reward) counts as a failed episode, not as reward 0, and is
  reported as `verifier_errors`; a run where every episode failed exits non-zero.
- `run_rows` takes an engine URL and is what `bench/agentic_recipe.py`'s terminal bench calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from miles.seeds import eval_seed


async def run_rows(session_url: str, rows: list[dict], *, k: int = 1, temperature: float = 0.0,
                   seed: int = 0, backend: str = "subprocess", backend_options: dict | None = None,
                   limits: dict | None = None, max_tokens: int = 192, concurrency: int = 8,
                   token: str | None = None, agent_fn=None) -> dict[str, Any]:
    """k episodes of each row against a session server; per-row rewards and the episodes' timings.
    `agent_fn`: a `rollout.agent` function (default: the terminal agent)."""
    from miles.agentic.terminal import agent as term
    from miles.envs.agent import run_agent
    from miles.envs.context import EpisodeStats, LazySandbox, sandbox_spec
    from miles.envs.config import AgentConfig
    from miles.sandboxes.config import SandboxConfig
    from miles.sandboxes import SandboxPool, get_backend
    from miles.tito.client import SessionServerClient

    lim = {**{f: getattr(AgentConfig(), f) for f in AgentConfig.__struct_fields__}, **(limits or {})}
    lim.pop("keep", None)
    cfg = SandboxConfig(backend=backend)
    pool = SandboxPool(get_backend(backend, **(backend_options or {})), max_concurrent=concurrency,
                       run_id=f"terminal-eval-{os.getpid()}", labels={"miles.role": "eval"})
    gate = asyncio.Semaphore(concurrency)
    client = SessionServerClient(session_url, token=token, timeout_s=float(lim["turn_timeout_s"]) + 60)

    async def one(i: int, j: int) -> dict[str, Any]:
        r = rows[i]
        m = r["metadata"]
        async with gate:
            stats = EpisodeStats()
            sandbox = LazySandbox(pool, sandbox_spec(cfg, m, {}), m["files"], stats, float(lim["tool_timeout_s"]))
            sampling = {"temperature": temperature, "seed": eval_seed(seed, i, j), "max_tokens": max_tokens}
            task = {**m, "prompt": r["prompt"], "label": r["label"], "limits": lim, "sampling": sampling,
                    "sandbox": sandbox}
            t0 = time.monotonic()
            reward, error = None, ""
            try:
                run = await run_agent(agent_fn or term.agent, task, client, group_id=f"{m['task_name']}-{j}",
                                      rollout_id=f"{m['task_name']}-{j}",
                                      agent_timeout_s=float(lim["episode_timeout_s"]))
                t1 = time.monotonic()
                try:
                    reward = (await term.verify(types.SimpleNamespace(metadata=m), sandbox))["reward"]
                except Exception as e:  # the verifier's failure: not a reward of 0
                    error = f"{type(e).__name__}: {e}"
                verify_s = time.monotonic() - t1
            finally:
                await sandbox.destroy()
            return {"row": i, "reward": reward, "error": error or run.error, "episode_s": time.monotonic() - t0,
                    "sandbox_s": stats.sandbox_s + stats.tool_s, "verify_s": verify_s,
                    "llm_s": float(run.metrics.get("chat_s", 0.0)), "turns": float(run.metrics.get("turns", 0.0)),
                    "tokens": sum(s.response_length for s in run.samples)}

    t0 = time.monotonic()
    try:
        episodes = await asyncio.gather(*(one(i, j) for i in range(len(rows)) for j in range(k)))
    finally:
        await client.close()
        await pool.close()
        await pool.sweep()
        await pool.backend.close()
    return {"episodes": episodes, "wall_s": time.monotonic() - t0, "k": k, "n": len(rows)}


def summary(result: dict[str, Any]) -> dict[str, float]:
    from miles.actors.evaluator import pass_at_k
    k, eps = result["k"], result["episodes"]
    passed = [0] * result["n"]
    for e in eps:
        passed[e["row"]] += e["reward"] is not None and e["reward"] >= 1.0
    scored = [e["reward"] for e in eps if e["reward"] is not None]
    busy = sum(e["episode_s"] for e in eps) or 1e-9
    return {"reward": float(np.mean(scored)) if scored else 0.0,
            "pass@1": float(np.mean([pass_at_k(k, c, 1) for c in passed])),
            "pass@k": float(np.mean([pass_at_k(k, c, k) for c in passed])),
            "k": float(k), "n": float(result["n"]),
            "verifier_errors": float(sum(e["reward"] is None for e in eps)),
            "episodes_per_s": len(eps) / max(result["wall_s"], 1e-9),
            "sandbox_share": sum(e["sandbox_s"] + e["verify_s"] for e in eps) / busy,
            "llm_share": sum(e["llm_s"] for e in eps) / busy}


async def serve_session(engine_url: str, tokenizer: str, family: str = "qwen3"):
    """A session server in this process on a free port: (url, aiohttp runner to clean up)."""
    from aiohttp import web

    from miles.engines.procs import free_port
    from miles.tito.server import ServerConfig, SessionServer
    runner = web.AppRunner(SessionServer(ServerConfig(engine_url=engine_url, tokenizer=tokenizer,
                                                      family=family)).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


async def main_async(args: argparse.Namespace) -> dict[str, float]:
    from miles.agentic.terminal.tasks import terminal_tasks, terminal_tasks_brief, terminal_tasks_cpu
    from miles.engines.embedded import launch_embedded_engine
    from miles.envs.agent import load_agent
    from miles.sandboxes.hostfs import default_base_dir

    if args.task_set in ("cpu", "brief"):   # the CPU sets (compact, their own test fraction)
        rows = (terminal_tasks_cpu if args.task_set == "cpu" else terminal_tasks_brief)(seed=args.seed)["test"]
    else:
        rows = terminal_tasks(seed=args.seed, test_frac=args.test_frac, declare_tools=not args.compact)["test"]
    rows = rows[: args.n_tasks] if args.n_tasks else rows
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="terminal-eval-"))
    logs.mkdir(parents=True, exist_ok=True)
    engine = await launch_embedded_engine(args.checkpoint, log_path=logs / f"engine-step{args.step}.log",
                                          extra_args=["--device", args.device, "--dtype", args.dtype,
                                                      "--random-seed", str(args.seed)],
                                          ready_timeout_s=args.engine_timeout_s)
    options = {}
    if args.backend in ("subprocess", "bwrap"):
        base = tempfile.mkdtemp(prefix="miles-terminal-eval-", dir=os.path.dirname(default_base_dir()))
        os.chmod(base, 0o711)   # sandboxes run under their own uids
        options["base_dir"] = base
    try:
        url, runner = await serve_session(engine.url, args.checkpoint, args.family)
        try:
            result = await run_rows(url, rows, k=args.k, temperature=args.temperature, seed=args.seed,
                                    backend=args.backend, backend_options=options,
                                    limits={"max_turns": args.max_turns, "max_episode_tokens": args.max_episode_tokens,
                                            "tool_timeout_s": args.tool_timeout_s},
                                    max_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                    agent_fn=load_agent(args.agent))
        finally:
            await runner.cleanup()
    finally:
        await engine.stop_async()
    out = summary(result)
    if out["verifier_errors"] == len(result["episodes"]):
        raise SystemExit(f"every episode's verifier failed: {result['episodes'][0]['error']}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.agentic.terminal.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="an HF model directory (the evaluator's {checkpoint})")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--k", type=int, default=4, help="episodes per task (pass@k with k = this)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0, help="the task set's seed (the recipe's run.seed)")
    p.add_argument("--test-frac", type=float, default=0.25)
    p.add_argument("--n-tasks", type=int, default=0, help="the first N held-out tasks (0: all)")
    p.add_argument("--compact", action="store_true", help="no tool schemas (terminal_tasks_compact rows)")
    p.add_argument("--task-set", choices=("all", "cpu", "brief"), default="all",
                   help="cpu: terminal_tasks_cpu's held-out rows; brief: terminal_tasks_brief's (the CPU "
                        "recipe's data.task)")
    p.add_argument("--agent", default="miles.agentic.terminal.agent:agent",
                   help="a rollout.agent import path (the oracle_agent checks the path: pass@k 1.0)")
    p.add_argument("--backend", default="subprocess")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-episode-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--tool-timeout-s", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--engine-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", default="")
    args = p.parse_args(argv)
    if args.k < 1:
        p.error(f"--k {args.k}: expected at least 1")
    if args.k > 1 and args.temperature <= 0:
        p.error(f"--k {args.k} with --temperature {args.temperature}: k > 1 needs a temperature > 0")
    if not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint!r}: no such directory")
    return args


def main(argv: list[str] | None = None) -> int:
    out = asyncio.run(main_async(parse_args(argv)))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
