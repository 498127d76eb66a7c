"""The agent quickstart, shortened, in a real `miles run`: its warm start stops at its first
held-out check that reaches the target, RL steps run on it with every trained sample exactly what
the agent's conversation renders to, the trainer logs its KL to the warm start, each prompt is
trained once, and nothing is left open.

How much it learns is a figure, not a test: the full recipe's warm start runs ~240 steps (12 min
on 2 cores) before RL has something to improve, and 3 seeds of RL against the warm start alone
are bench/agentic_learning.py's job (docs/figures.md). Here the target is 0 (the first check
stops it) and the filter keeps every group, so the run takes a few minutes on any CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.envs.tool_agent import PARSE_ERROR, ToolRunner, tool_specs
from miles.sandboxes.base import DEFAULT_WORKDIR, sandbox_path
from tests.envs.token_checks import model_spans, model_turns
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
RL_STEPS = 4
# the recipe, shortened: a warm start of at most 20 steps, checked at 10 and 20 against a low
# target, a small evaluation, every group trained (a barely warmed model's groups are mostly all
# one reward)
SFT_CAP = 20
SHORT = [f"sft.steps={SFT_CAP}", "sft.until_heldout=0.01", "sft.check_from=10", "sft.check_every=10",
         "eval.n_prompts=8",
         'buffer.filter="none"', f"loop.num_steps={RL_STEPS}", f"loop.eval_every={RL_STEPS}",
         "logging.record_wire=true", "logging.record_steps=[1, 2]"]


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
@pytest.mark.timeout(600)   # a deadline, not a speed bound: ~3 min on an idle 2-core box
def test_agent_quickstart_runs_from_its_warm_start_and_its_samples_are_exact(tmp_path):
    import asyncio

    from miles.config import load_recipe
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    recipe = load_recipe(ROOT / "recipes" / "agent_quickstart.toml")
    steps = RL_STEPS
    out = tmp_path / f"agent-qs-{int(time.time())}"
    code, log = run_quickstart(out, SHORT, timeout_s=540)
    assert code == 0, why_it_failed(log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    # The warm start stopped at its first check that reached the target, or at its cap, saying which.
    sft = [r for r in rows if r["kind"] == "sft"]
    checks = [(r["step"], r["sft/heldout_pass@1"]) for r in sft if "sft/heldout_pass@1" in r]
    end = sft[-1]
    target = 0.01
    assert [s for s, _ in checks] in ([10], [10, 20]), checks
    assert all(p < target for _, p in checks[:-1]), checks
    if checks[-1][1] >= target:
        assert end["sft/stop"].endswith(">= sft.until_heldout") and end["sft/steps"] == checks[-1][0], end
    else:
        assert end["sft/stop"] == f"sft.steps = {SFT_CAP}" and end["sft/steps"] == SFT_CAP, end

    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, steps], evals
    for e in evals.values():   # pass@1 of the recipe's 4 samples per prompt
        assert e["eval/k"] == recipe.eval.samples_per_prompt >= 4 and e["eval/n"] == 8, e
        assert 0.0 <= e["eval/pass@1"] <= 1.0

    train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # The trainer's log-probs of the sampled tokens against the engine's: equal where the batch was
    # sampled by the weights it trains (staleness 0), a policy step apart where it lagged.
    diffs = [(r["batch/staleness_avg"], r["train/train_rollout_logprob_abs_diff"]) for r in train]
    fresh = [d for lag, d in diffs if lag == 0]
    assert fresh and max(fresh) < 1e-3 and max(d for _, d in diffs) < 0.2, diffs
    # KL to the warm start (train.use_ref_model): ~0 before the first update; after it, > 0 where
    # an update moved the policy (a group with rewards that differ) and ~0 where none did (a
    # barely warmed model's groups may all score 0); entropy is logged beside it.
    kl = [r["train/ref_kl"] for r in train]
    moved = [r["train/grad_norm"] > 1e-3 for r in train]
    assert abs(kl[0]) < 1e-4 and all(k > -1e-6 for k in kl), kl
    for k in range(1, steps):
        assert (kl[k] > 1e-7) if any(moved[:k]) else (abs(kl[k]) < 1e-6), (k, kl, moved)
    assert all("train/entropy" in r and "train/ppo_kl" in r for r in train)
    # each prompt index is trained once (the buffer's ledger: nothing trained twice)
    trained = [i for r in train for i in r["batch/prompt_indices"]]
    assert len(trained) == len(set(trained)) == steps * recipe.loop.groups_per_step, trained

    resolved = json.loads(next(out.glob("recipe.resolved*.json")).read_text())
    tokenizer = load_tokenizer(resolved["model"]["path"])
    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) == 2 * recipe.loop.groups_per_step * recipe.rollout.n_samples_per_prompt, len(samples)
    for s in samples:
        asyncio.run(check_sample(s, tokenizer))
    assert all(len(model_spans(s)) >= 1 for s in samples)   # every episode had a model turn

    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert set(trained) <= {e["prompt_index"] for e in episodes if e["decision"] == "keep"}
    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if line.startswith("[rollout] episodes closed:")]
    assert closing and "live at close 0" in closing[0] and "swept 0" in closing[0], closing
    assert (out / "reward_curve.png").stat().st_size > 1000
