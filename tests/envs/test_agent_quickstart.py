"""The agent quickstart, shortened, in a real `miles run`: RL raises the tool agent's sampled
and held-out rewards, every trained sample is what the agent's conversation
renders to, and nothing is left open.

Measured on the 2-core CPU (SFT 170 steps, as the recipe ships, then RL): held-out 0.75 -> 0.97 and
0.98 at step 60 in two runs, sampled reward 0.32 (step 10) -> 0.67 (step 60). With 190 SFT steps
the warm-start alone gave 0.94-0.97 held-out and RL had little to show; with 150 (the recipe before)
RL started at a sampled reward of ~0.01: runs learned to 0.2-0.7 held-out, or starved
(buffer.filter dropped every group) until loop.timeout_s, as CI's did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from miles.envs.tool_agent import PARSE_ERROR, ToolRunner, tool_specs
from miles.sandboxes.base import DEFAULT_WORKDIR, sandbox_path
from tests.envs.token_checks import model_spans, model_turns
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]


def run_quickstart(out: Path, overrides: list[str], timeout_s: float) -> tuple[int, str]:
    port = cluster_port()
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "agent_quickstart.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={port}"]
    for o in overrides:
        args += ["--set", o]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, log.decode(errors="replace")


def why_it_failed(log: str) -> str:
    """What a failed run's console says about why: the lines naming a failure (the node daemon's
    "actor X failed" and the errors before the shutdown's own noise), then the tail."""
    marks = ("failed:", "Traceback", "Error:", "lost", "gave up", "giving up", "exited with")
    lines = [ln for ln in log.splitlines() if any(m in ln for m in marks)
             and "destroying sandbox" not in ln]
    return "\n".join(lines[:40]) + "\n...\n" + log[-2000:]


class FilesSandbox:
    """The task's files as a sandbox for `ToolRunner`: what the agent's tools answered in the run."""

    def __init__(self, files: dict[str, str]):
        self.files = {sandbox_path(k, DEFAULT_WORKDIR): v.encode() for k, v in files.items()}

    async def download(self, path: str) -> bytes:   # paths checked and resolved as a sandbox does
        path = sandbox_path(path, DEFAULT_WORKDIR)
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    async def upload(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[sandbox_path(path, DEFAULT_WORKDIR)] = data


async def conversation(sample, tokenizer) -> list[dict]:
    """The messages the agent sent for this sample: the model's turns parsed from its tokens, the
    tool results re-run on the task's files."""
    from miles.tito.families import get_family
    qwen3 = get_family("qwen3")
    turns = model_spans(sample)
    meta = sample.metadata
    runner = ToolRunner(FilesSandbox(meta["files"]), set(meta["tools"]), 10.0, 2048)
    messages = [{"role": "user", "content": sample.prompt}]
    for k, (a, b) in enumerate(turns):
        ids = sample.tokens[a:b].tolist()
        if tokenizer.id_to_token(ids[-1]) in qwen3.stop_tokens:
            ids = ids[:-1]
        reply = qwen3.parse_reply(tokenizer.decode(ids))
        messages.append({"role": "assistant", "content": reply.content,
                         "tool_calls": [{"id": f"c{k}{j}", "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments_json()}}
                                        for j, c in enumerate(reply.tool_calls)]})
        if k + 1 == len(turns):
            break
        if not reply.tool_calls:
            messages.append({"role": "user", "content": PARSE_ERROR})
        for j, c in enumerate(reply.tool_calls):
            text, _ = await runner.run(c.name, c.arguments_json())
            messages.append({"role": "tool", "tool_call_id": f"c{k}{j}", "content": text})
    return messages


async def check_sample(sample, tokenizer) -> None:
    """Non-model tokens = the chat template's text for the conversation, tokenized; the loss mask is
    exactly the model's turns; rollout log-probs sit on the model's tokens only."""
    from miles.tito.families import get_family
    from miles.tito.messages import parse_openai_messages, parse_openai_tools
    qwen3 = get_family("qwen3")
    msgs = parse_openai_messages(await conversation(sample, tokenizer))
    tools = parse_openai_tools(tool_specs(sample.metadata["tools"])) if sample.metadata["declare_tools"] else None
    turns = [qwen3.parse_reply(tokenizer.decode(ids)).content for ids in model_turns(sample, tokenizer, msgs, tools)]
    assert turns == [m.content for m in msgs if m.role == "assistant"], turns


@pytest.mark.slow
@pytest.mark.timeout(1500)   # ~3.5 min here; CI's 2 cores ran past 5 min
def test_agent_quickstart_learns_and_its_samples_are_exact(tmp_path):
    import asyncio

    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    out = tmp_path / f"agent-qs-{int(time.time())}"
    # every step recorded (the flight recorder): each trained sample is checked below
    code, log = run_quickstart(out, ["loop.num_steps=60", "loop.eval_every=20", "logging.record_wire=true"],
                               timeout_s=1400)
    assert code == 0, why_it_failed(log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/reward"] for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, 20, 40, 60], evals
    # Held-out is greedy. Where the 170-step warm-start lands is CPU-dependent: 0.75 on the Intel
    # boxes it was tuned on, 0.97 on an AMD one (the same code before and after this check was
    # written). RL must lift it by 0.05 when there is room, and never collapse it; the sampled
    # reward below (temperature 1: 0.31 -> 0.65 on the AMD box, 0.32 -> 0.75 on Intel) is where
    # RL's learning shows either way. From the AMD box's 0.97, 13 runs of this command (2026-12-06,
    # one in CI, 6 each at lr 5e-4 and 3e-4: no better) went as low as 0.80-0.88 at some eval in 4
    # and ended at 0.81-0.98: a few of 64 greedy answers flip as RL moves a policy that is already
    # right. Bounds of -0.05 at the end and -0.1 midway failed those 4; -0.2 still catches a collapse.
    if evals[0] < 0.9:
        assert evals[60] >= evals[0] + 0.05, evals              # measured: 0.75 -> 0.97, 0.98
    assert min(evals[20], evals[40], evals[60]) >= evals[0] - 0.2, evals
    sampled = [r["rollout/reward_recent"] for r in rows if r["kind"] == "actors" and "rollout/reward_recent" in r]
    assert len(sampled) >= 40 and np.mean(sampled[-10:]) >= np.mean(sampled[:10]) + 0.1, sampled  # 0.32 -> 0.67
    train = [r for r in rows if r["kind"] == "train"]
    # The trainer's log-probs of the sampled tokens against the engine's: equal where the batch was
    # sampled by the weights it trains (staleness 0), a policy step apart where it lagged.
    diffs = [(r["batch/staleness_avg"], r["train/train_rollout_logprob_abs_diff"]) for r in train]
    fresh = [d for lag, d in diffs if lag == 0]
    assert fresh and max(fresh) < 1e-3 and max(d for _, d in diffs) < 0.2, diffs

    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) == 60 * 4 * 8, len(samples)
    for s in samples:
        asyncio.run(check_sample(s, tokenizer))
    assert any(len(s.metadata.get("agent", {}).get("answer") or "") == 3 for s in samples)

    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if line.startswith("[rollout] episodes closed:")]
    assert closing and "live at close 0" in closing[0] and "swept 0" in closing[0], closing
