"""Agentic episodes per second, and where an episode's time goes: the LLM, or everything around it.

    python bench/agentic.py [--episodes 16] [--turns 3] [--backends subprocess,bwrap] [--concurrency 1]
    python bench/agentic.py --device cuda --model-config qwen2.5-0.5b      (one GPU)
    python bench/agentic.py --kv       (also runs bench/agentic_kv.py and includes its JSON line)
    python bench/agentic.py --recipe swe|terminal   (a recipe's harness, tasks and verifier: bench/agentic_recipe.py)

Prints one JSON line: {"bench": "agentic", "results": [per backend x mode], "session_overhead_share",
"sandbox_create_destroy_share", "targets", "machine", ...}.

Design decisions:
- An episode is a scripted tool agent in a real sandbox: a fresh sandbox per episode (backends
  `subprocess`, `bwrap` from `miles.sandboxes`), task files uploaded, then `--turns` rounds of
  (model call, one fixed shell tool call: ls / cat / grep over the task files), then `submit`
  (a write into the sandbox) and the verifier (reads the sandbox's state back), then destroy. The
  tool calls are fixed, so both modes do the same work whatever a random model says; the model's
  tokens are real (the embedded engine samples them, `--max-tokens` per turn, forced by
  `min_tokens` so every turn has the same length, the same seed per episode and turn in both modes).
- Two modes in the same run, interleaved round by round (alternating which goes first) so drift of
  a shared machine hits both alike:
    session  the agent speaks OpenAI chat completions to its session's URL on the TITO session
             server (a separate process) -> smg -> embedded engine; the session is created before and
             collected + closed after, and the collected sample is checked: its trained tokens are
             exactly the turns' completion tokens.
    direct   no session server: the agent renders the history with the model's chat template itself,
             tokenizes it and sends token ids to `/generate` (through the same smg, with the same
             routing key, so the difference is the session server alone; `--direct-via engine`
             skips smg too).
  `session_overhead_share.share` = median over episodes of (session - direct) for the same episode
  (same seeds and commands, run back to back) / the median session episode: TITO's whole cost per
  episode (target < 5%), also in ms per episode and per model call, which do not depend on how slow
  the model is. `mean_share` +- `noise_share` is the unpaired difference of means and its standard
  error: on a busy machine the pairing is what makes the figure usable. `server_cpu_ms_per_turn`
  and `server_cpu_share` (the session server process's CPU time from /proc over the session-mode
  rounds, per model call and over the episodes' time) do not depend on the machine's load at all.
  Every share depends on how slow the model is: the tiny CPU model's turn is ~20-100 ms, the GPU
  run's 0.5B model makes a turn of 32 tokens in ~120 ms. (`--model-config small`, ~0.2B, exists
  for CPU too, but it prefills ~1.4k tokens per turn on one thread: seconds per turn.)
- With `--concurrency N` the episodes of a round share the agent's one event loop: the direct
  agent's templating and tokenizing block it (the session server does that work in its own
  process), which staggers the direct mode's engine requests. That is a cost a single-process
  harness pays without the session server; the per-episode figures include it.
- Scripted, not the built-in tool agent (`miles.envs.tool_agent`): a random model rarely emits a
  tool call, and that agent ends an episode at the first reply without one. When a reply does
  carry tool calls, the script answers each one (a `tool` message with the command's output), as
  the server requires; otherwise the output goes back as a user message.
- The episode's time split: `llm` is time inside model calls (minus the session server's own
  `prepare_ms`, which it reports per turn), `session` is session create + collect/close + prepare,
  `render` is the direct agent's templating and tokenizing, `sandbox` is create + destroy, `tools`
  the uploads and commands. `outside_llm_share` = (sandbox + tools + session + render) / episode;
  `sandbox_create_destroy_share` for bwrap has the target < 10%.
- GPU: `--device cuda --model-config qwen2.5-0.5b` builds a Qwen2.5-0.5B-shaped model (24 layers,
  hidden 896, 14/2 heads) with random weights and the real Qwen vocabulary (`miles.tiny`,
  `miles.tito.qwen_vocab`, both offline), bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from miles.engines.client import EngineClient  # noqa: E402
from miles.engines.gateway import GatewayConfig, launch_gateway  # noqa: E402
from miles.engines.procs import ServerProcess, free_port  # noqa: E402
from miles.sandboxes import SandboxError, SandboxSpec, get_backend  # noqa: E402
from miles.tito.client import SessionServerClient  # noqa: E402
from miles.tito.families import get_family  # noqa: E402
from miles.tito.messages import parse_openai_messages  # noqa: E402
from miles.tito.template import render_template  # noqa: E402
from miles.tito.tokenizer import load_tokenizer  # noqa: E402
from miles.hostinfo import machine

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the sandbox and return its output.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Submit the final answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}]
SCRIPT = ["ls -la", "cat notes.txt", "grep -n secret notes.txt", "cat answer.txt", "wc -l notes.txt"]
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)
QWEN3_SMALL = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=64, intermediate_size=3072)
STEP_TIMEOUT_S = 120.0  # any one call of an episode; the whole bench never waits without a deadline


@dataclass
class Episode:
    total_s: float = 0.0
    llm_s: float = 0.0
    session_s: float = 0.0
    render_s: float = 0.0
    sandbox_s: float = 0.0
    tools_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    turn_llm_s: list[float] = field(default_factory=list)


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc), 0.0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError, IndexError):
        return 0.0


def build_model(config: str) -> Path:
    from miles.tiny import build_tiny_model
    if config == "tiny":
        return build_tiny_model(arch="qwen3")
    if config == "small":  # bench/engine.py's ~0.2B Qwen3, the tiny tokenizer: CPU turns of a real-ish cost
        return build_tiny_model(arch="qwen3", **QWEN3_SMALL)
    if config == "qwen2.5-0.5b":
        from miles.tito.qwen_vocab import build_qwen_tokenizer
        return build_tiny_model(arch="qwen2", tokenizer_dir=build_qwen_tokenizer(), **QWEN25_05B)
    raise SystemExit(f"--model-config: {config!r} is not one of tiny, small, qwen2.5-0.5b")


class Stack:
    """embedded engine -> smg -> TITO session server, each a real process; stopped on exit."""

    def __init__(self, model: Path, device: str, logs: Path):
        self.model, self.device, self.logs = model, device, logs
        self.engine = self.gateway = self.server = None

    async def __aenter__(self) -> "Stack":
        from miles.engines.embedded import launch_embedded_engine
        args = ["--device", self.device, "--random-seed", "0"]
        args += ["--dtype", "bfloat16"] if self.device.startswith("cuda") else ["--torch-threads", "1"]
        self.engine = await launch_embedded_engine(self.model, extra_args=args, log_path=self.logs / "engine.log",
                                                   ready_timeout_s=600)
        self.gateway = await launch_gateway(GatewayConfig(port=free_port(), prometheus_port=free_port()),
                                            [self.engine.url], log_path=self.logs / "smg.log")
        port = free_port()
        self.server = ServerProcess("tito", [sys.executable, "-m", "miles.tito.server", "--engine-url",
                                             self.gateway.url, "--model-path", str(self.model), "--family",
                                             "qwen3", "--port", str(port)], log_path=self.logs / "tito.log").start()
        self.session_url = f"http://127.0.0.1:{port}"
        await self.server.wait_healthy(self.session_url, timeout_s=120)
        return self

    async def __aexit__(self, *exc) -> None:
        stops = [p.stop_async(grace_s=5) for p in (self.server, self.gateway, self.engine) if p is not None]
        await asyncio.gather(*stops, return_exceptions=True)


class SessionAgent:
    """Model calls through the session server (OpenAI chat completions on the session's URL)."""

    def __init__(self, stack: Stack, http: aiohttp.ClientSession, client: SessionServerClient, max_tokens: int):
        self.stack, self.http, self.client, self.max_tokens = stack, http, client, max_tokens

    async def start(self, ep: Episode, rollout_id: str) -> dict:
        t0 = time.perf_counter()
        created = await self.client.create_session(rollout_id=rollout_id)
        ep.session_s += time.perf_counter() - t0
        return created

    async def turn(self, ep: Episode, created: dict, messages: list[dict], seed: int) -> dict:
        body = {"messages": messages, "tools": TOOLS, "max_tokens": self.max_tokens, "min_tokens": self.max_tokens,
                "temperature": 1.0, "seed": seed}
        t0 = time.perf_counter()
        async with self.http.post(created["openai_base_url"] + "/chat/completions", json=body) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError(f"session server answered HTTP {r.status}: {answer}")
        dt = time.perf_counter() - t0
        prepare_s = answer["miles"]["prepare_ms"] / 1e3
        ep.llm_s += dt - prepare_s
        ep.session_s += prepare_s
        ep.turn_llm_s.append(dt)
        ep.completion_tokens += answer["usage"]["completion_tokens"]
        ep.prompt_tokens = answer["usage"]["prompt_tokens"]
        return answer["choices"][0]["message"]

    async def finish(self, ep: Episode, created: dict) -> None:
        t0 = time.perf_counter()
        samples = await self.client.collect(created["session_id"], close=True)
        ep.session_s += time.perf_counter() - t0
        trained = sum(int(s.loss_mask.sum()) for s in samples)
        if trained != ep.completion_tokens:  # the bench measures a TITO that keeps every token
            raise AssertionError(f"session {created['session_id']}: {trained} trained tokens collected, "
                                 f"{ep.completion_tokens} generated")


class DirectAgent:
    """No session server: render the chat template, tokenize, token ids to `/generate`."""

    def __init__(self, engine: EngineClient, tokenizer, family, max_tokens: int):
        self.engine, self.tokenizer, self.family, self.max_tokens = engine, tokenizer, family, max_tokens
        self.stop_ids = [tokenizer.token_id(t) for t in family.stop_tokens if t in tokenizer.added_ids]

    async def start(self, ep: Episode, rollout_id: str) -> str:
        return rollout_id  # the routing key: all turns of an episode on one engine, as in a session

    async def turn(self, ep: Episode, key: str, messages: list[dict], seed: int) -> dict:
        t0 = time.perf_counter()
        msgs = parse_openai_messages(messages)
        text = render_template(self.family.chat_template, [m.to_template_dict() for m in msgs], TOOLS, True)
        ids = self.tokenizer.encode(text)
        t1 = time.perf_counter()
        params = {"max_new_tokens": self.max_tokens, "min_new_tokens": self.max_tokens, "temperature": 1.0,
                  "sampling_seed": seed, "stop_token_ids": self.stop_ids}
        out = await self.engine.generate(ids, params, return_logprob=True, routing_key=key,
                                         session_id=key, timeout_s=STEP_TIMEOUT_S)
        t2 = time.perf_counter()
        reply = self.tokenizer.decode([t for t in out.output_ids if t not in self.stop_ids])
        ep.render_s += t1 - t0
        ep.llm_s += t2 - t1
        ep.turn_llm_s.append(t2 - t1)
        ep.completion_tokens += len(out.output_ids)
        ep.prompt_tokens = len(ids)
        return {"role": "assistant", "content": reply}

    async def finish(self, ep: Episode, key: str) -> None:
        return None


async def tool(ep: Episode, coro):
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(coro, STEP_TIMEOUT_S)
    finally:
        ep.tools_s += time.perf_counter() - t0


async def run_episode(agent, backend, spec: SandboxSpec, index: int, turns: int) -> Episode:
    ep = Episode()
    t_start = time.perf_counter()
    secret = f"{(index * 7919) % 10000:04d}"
    t0 = time.perf_counter()
    sandbox = await asyncio.wait_for(backend.create(spec), STEP_TIMEOUT_S)
    ep.sandbox_s += time.perf_counter() - t0
    try:
        await tool(ep, sandbox.upload_dir(".", {
            "notes.txt": "".join(f"line {i}: nothing here\n" for i in range(40)).encode() + b"the secret is in answer.txt\n",
            "answer.txt": f"{secret}\n".encode()}))
        handle = await asyncio.wait_for(agent.start(ep, f"bench-{index}-{uuid.uuid4().hex[:8]}"), STEP_TIMEOUT_S)
        messages = [{"role": "system", "content": "You are an agent with a bash tool in a sandbox."},
                    {"role": "user", "content": "Find the secret number in the files and submit it."}]
        for t in range(turns):
            reply = await asyncio.wait_for(agent.turn(ep, handle, messages, seed=index * 1000 + t), STEP_TIMEOUT_S)
            messages.append(reply)
            cmd = SCRIPT[t % len(SCRIPT)]
            result = await tool(ep, sandbox.exec(cmd, timeout_s=30))
            output = (result.stdout + result.stderr)[-2000:]
            calls = reply.get("tool_calls") or []
            if calls:  # the model did emit a call: answer each one (the script chose the command)
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": output} for c in calls]
            else:
                messages.append({"role": "user", "content": f"$ {cmd}\n{output}"})
        await tool(ep, sandbox.exec(f"printf %s {secret} > submitted.txt", timeout_s=30))   # submit
        verdict = await tool(ep, sandbox.download("submitted.txt"))                         # verifier
        if verdict.decode() != secret:
            raise AssertionError(f"episode {index}: verifier read {verdict!r}, expected {secret!r}")
        await asyncio.wait_for(agent.finish(ep, handle), STEP_TIMEOUT_S)
    finally:
        t0 = time.perf_counter()
        await asyncio.shield(sandbox.destroy())
        ep.sandbox_s += time.perf_counter() - t0
    ep.total_s = time.perf_counter() - t_start
    return ep


def summarize(backend: str, mode: str, eps: list[Episode], wall_s: float) -> dict:
    total = sum(e.total_s for e in eps)
    part = {k: sum(getattr(e, f"{k}_s") for e in eps) for k in ("llm", "session", "render", "sandbox", "tools")}
    ms = lambda x: round(x / len(eps) * 1e3, 2)  # noqa: E731
    return {"backend": backend, "mode": mode, "episodes": len(eps),
            "episodes_per_s": round(len(eps) / wall_s, 3),
            "episode_ms_mean": ms(total), "episode_ms_p50": round(statistics.median(e.total_s for e in eps) * 1e3, 2),
            "ms_per_episode": {k: ms(v) for k, v in part.items()},
            "share": {k: round(v / total, 4) for k, v in part.items()},
            "outside_llm_share": round((total - part["llm"]) / total, 4),
            "llm_turn_ms_p50": round(statistics.median(t for e in eps for t in e.turn_llm_s) * 1e3, 2),
            "completion_tokens_per_episode": eps[0].completion_tokens,
            "prompt_tokens_last_turn": round(statistics.mean(e.prompt_tokens for e in eps), 1)}


def overhead(session: list[Episode], direct: list[Episode]) -> dict:
    """What the session server adds. Episode i of both modes ran back to back with the same seeds and
    commands, so the paired differences cancel most of a shared machine's drift: `share` is their
    median over the median session episode; `mean_share` +- `noise_share` (standard error) is the
    unpaired difference of means. Also in ms per episode and per model call."""
    pairs = [a.total_s - b.total_s for a, b in zip(session, direct)]
    turns = [x - y for a, b in zip(session, direct) for x, y in zip(a.turn_llm_s, b.turn_llm_s)]
    a, b = [e.total_s for e in session], [e.total_s for e in direct]
    ma, mb = statistics.mean(a), statistics.mean(b)
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5 if min(len(a), len(b)) > 1 else 0
    return {"share": round(statistics.median(pairs) / statistics.median(a), 4),
            "mean_share": round((ma - mb) / ma, 4), "noise_share": round(se / ma, 4),
            "ms_per_episode_p50": round(statistics.median(pairs) * 1e3, 2),
            "ms_per_turn_p50": round(statistics.median(turns) * 1e3, 2),
            "session_calls_ms_per_episode": round(statistics.mean(e.session_s for e in session) * 1e3, 2)}


async def bench_backend(name: str, agents: dict, args, base_dir: str,
                        server_pid: int | None) -> tuple[list[dict], dict[str, list[Episode]], float]:
    backend = get_backend(name, base_dir=base_dir)
    spec = SandboxSpec(ttl_s=600)
    episodes: dict[str, list[Episode]] = {m: [] for m in agents}
    wall = dict.fromkeys(agents, 0.0)
    rounds = -(-args.episodes // args.concurrency)
    server_cpu = 0.0
    try:
        for r in range(rounds + 1):  # round 0 warms up every path (spawner, connections, engine graphs)
            order = list(agents) if r % 2 == 0 else list(agents)[::-1]
            for mode in order:
                t0, c0 = time.perf_counter(), cpu_s(server_pid)
                base = r * args.concurrency
                eps = await asyncio.gather(*(run_episode(agents[mode], backend, spec, base + i, args.turns)
                                             for i in range(args.concurrency)))
                if r > 0:
                    wall[mode] += time.perf_counter() - t0
                    if mode == "session":
                        server_cpu += cpu_s(server_pid) - c0
                    episodes[mode].extend(eps)
    finally:
        await backend.close()
    return [summarize(name, m, episodes[m], wall[m]) for m in agents], episodes, server_cpu


def run_kv(args) -> dict | None:
    script = Path(__file__).with_name("agentic_kv.py")
    if not script.exists():
        return {"skipped": "bench/agentic_kv.py is not in this checkout"}
    cmd = [sys.executable, str(script), "--device", args.device]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.kv_timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"bench/agentic_kv.py did not finish within {args.kv_timeout_s} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"skipped": f"bench/agentic_kv.py exited {out.returncode}: {out.stderr[-400:]}"}
    return json.loads(lines[-1])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="timed episodes per backend and mode")
    ap.add_argument("--turns", type=int, default=3, help="model calls per episode (each followed by a tool call)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens the model generates per turn")
    ap.add_argument("--concurrency", type=int, default=1, help="episodes in flight at once")
    ap.add_argument("--backends", default="subprocess,bwrap")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-config", default=None, help="tiny (CPU default) | small (~0.2B) | qwen2.5-0.5b (CUDA default)")
    ap.add_argument("--direct-via", choices=("gateway", "engine"), default="gateway",
                    help="where the direct agent sends /generate: smg (default) or the engine itself")
    ap.add_argument("--kv", action="store_true", help="also run bench/agentic_kv.py and include its JSON")
    ap.add_argument("--kv-timeout-s", type=float, default=1800)
    ap.add_argument("--recipe", choices=("swe", "terminal"), default=None,
                    help="bench an agentic recipe end to end instead (bench/agentic_recipe.py)")
    ap.add_argument("--agents", default="harness,oracle", help="with --recipe: which agents to run")
    args = ap.parse_args()
    for name in ("episodes", "turns", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be >= 1")
    if args.recipe:
        import agentic_recipe
        return await agentic_recipe.main(args)
    config = args.model_config or ("qwen2.5-0.5b" if args.device.startswith("cuda") else "tiny")
    model = build_model(config)
    tokenizer, family = load_tokenizer(str(model)), get_family("qwen3")
    from miles.sandboxes.hostfs import default_base_dir
    base_dir = tempfile.mkdtemp(prefix="miles-agentic-bench-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base_dir, 0o711)
    logs = Path(tempfile.mkdtemp(prefix="miles-agentic-logs-"))
    results, shares, sandbox_shares, skipped = [], {}, {}, {}
    try:
        async with Stack(model, args.device, logs) as stack, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=STEP_TIMEOUT_S)) as http, \
                SessionServerClient(stack.session_url, timeout_s=STEP_TIMEOUT_S) as client:
            direct_url = stack.gateway.url if args.direct_via == "gateway" else stack.engine.url
            engine = EngineClient(direct_url, generate_timeout_s=STEP_TIMEOUT_S)
            try:
                agents = {"session": SessionAgent(stack, http, client, args.max_tokens),
                          "direct": DirectAgent(engine, tokenizer, family, args.max_tokens)}
                for name in args.backends.split(","):
                    try:
                        rows, eps, server_cpu = await bench_backend(name, agents, args, base_dir, stack.server.pid)
                    except SandboxError as exc:  # e.g. no user namespaces for bwrap on this machine
                        skipped[name] = f"{type(exc).__name__}: {exc}"
                        print(f"skip {name}: {skipped[name]}", file=sys.stderr)
                        continue
                    results += rows
                    shares[name] = overhead(eps["session"], eps["direct"])
                    n_turns = sum(len(e.turn_llm_s) for e in eps["session"])
                    shares[name]["server_cpu_ms_per_turn"] = round(server_cpu / n_turns * 1e3, 2)
                    shares[name]["server_cpu_share"] = round(
                        server_cpu / sum(e.total_s for e in eps["session"]), 4)
                    sandbox_shares[name] = {m: r["share"]["sandbox"] for m, r in zip(agents, rows)}
                    async with http.get(stack.session_url + "/stats") as r:
                        stats = await r.json()
                    if stats.get("sessions"):
                        raise AssertionError(f"{stats['sessions']} sessions left open in the session server")
            finally:
                await engine.close()
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    out = {"bench": "agentic", "model": config, "device": args.device, "episodes": args.episodes,
           "turns": args.turns, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
           "direct_via": args.direct_via, "results": results,
           "session_overhead_share": shares, "sandbox_create_destroy_share": sandbox_shares,
           "skipped_backends": skipped}
    targets = {}
    if shares:
        targets["session_overhead_lt_5pct"] = all(v["share"] < 0.05 for v in shares.values())
    if "bwrap" in sandbox_shares:
        targets["bwrap_sandbox_lt_10pct"] = sandbox_shares["bwrap"]["session"] < 0.10
    out["targets"] = targets
    if args.kv:
        out["kv"] = run_kv(args)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    out["machine"] = machine(args.device)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
