"""The agent quickstart, shortened, in a real `miles run`: its warm start stops at the held-out
target (or its cap, saying which), RL then raises held-out pass@1 over the run's own step-0
evaluation, every trained sample is what the agent's conversation renders to, the trainer logs
its KL to the warm start, and nothing is left open.

Where the warm start lands is not a step count: the copy of the digits is learnt at a step that
differs from CPU to CPU and seed to seed (a fixed 170 steps gave greedy held-out 0.75 on Intel and
0.97 on AMD), so the recipe stops it at a held-out target (`sft.until_heldout`) and the bounds
below are relative to that stop, with room for any CPU. Learning's size (3 seeds, RL against
the warm start alone) is measured by bench/agentic_learning.py, not here.
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
# RL steps after the warm start, and the share of the headroom (1 - step-0 pass@1) they must gain.
# Measured (2026-12-07, 2-core CPU at load ~16): the warm start stopped at step 240 at 0.54, then
# held-out 0.63 / 0.73 at RL steps 20 / 40 (+0.18, twice the 0.1 x 0.46 asked here; the noise of
# one difference of two 64 x 4-sample evaluations is ~0.05). This test's own run, the same day:
# stop at step 240 (0.543), 0.668 at RL step 40 (+0.125 against the 0.046 asked); 23 min at load 11-28.
RL_STEPS, HEADROOM_SHARE = 40, 0.1


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


# What it asserts holds on any CPU with room to spare (two runs gained +0.125 and +0.18 where
# +0.046 is asked). It keeps the suite's one rerun of a failed slow test (tests/conftest.py, named
# in the summary) until that rerun goes for every test at once: one evaluation difference has
# ~0.05 of noise, and a failed CI lands nothing.
@pytest.mark.slow
@pytest.mark.timeout(1800)   # a deadline, not a speed bound: ~25 min at load 24-28 on 2 cores
def test_agent_quickstart_learns_from_its_warm_start_and_its_samples_are_exact(tmp_path):
    import asyncio

    from miles.config import load_recipe
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    recipe = load_recipe(ROOT / "recipes" / "agent_quickstart.toml")
    steps = RL_STEPS
    out = tmp_path / f"agent-qs-{int(time.time())}"
    # the flight recorder keeps steps 1-2, whose samples are checked token by token below
    code, log = run_quickstart(out, [f"loop.num_steps={steps}", f"loop.eval_every={steps}",
                                     "logging.record_wire=true", "logging.record_steps=[1, 2]"],
                               timeout_s=1700)
    assert code == 0, why_it_failed(log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    # The warm start stopped at its first check that reached the target, or at its cap, and said so.
    sft = [r for r in rows if r["kind"] == "sft"]
    checks = [(r["step"], r["sft/heldout_pass@1"]) for r in sft if "sft/heldout_pass@1" in r]
    end = sft[-1]
    target = recipe.sft.until_heldout
    assert all(s >= recipe.sft.check_from and s % recipe.sft.check_every == 0 for s, _ in checks), checks
    assert all(p < target for _, p in checks[:-1]), checks
    if checks and checks[-1][1] >= target:
        assert end["sft/stop"].endswith(">= sft.until_heldout") and end["sft/steps"] == checks[-1][0], end
    else:
        assert end["sft/stop"] == f"sft.steps = {recipe.sft.steps}" and end["sft/steps"] == recipe.sft.steps, end
    assert f"warm start step {checks[-1][0]}" in log if checks else True

    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [0, steps], evals
    for e in evals.values():   # pass@1 of 4 samples per prompt at the rollout's temperature
        assert e["eval/k"] == recipe.eval.samples_per_prompt >= 4 and e["eval/n"] == recipe.eval.n_prompts, e
    start, final = evals[0]["eval/pass@1"], evals[steps]["eval/pass@1"]
    if end["sft/stop"].endswith(">= sft.until_heldout"):
        assert final >= start + HEADROOM_SHARE * (1 - start), (start, final)
    else:   # the cap: the warm start never reached the target, so RL had little to start from
        assert final >= start - 0.1, (start, final)

    train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # The trainer's log-probs of the sampled tokens against the engine's: equal where the batch was
    # sampled by the weights it trains (staleness 0), a policy step apart where it lagged.
    diffs = [(r["batch/staleness_avg"], r["train/train_rollout_logprob_abs_diff"]) for r in train]
    fresh = [d for lag, d in diffs if lag == 0]
    assert fresh and max(fresh) < 1e-3 and max(d for _, d in diffs) < 0.2, diffs
    # KL to the warm start (train.use_ref_model): ~0 before the first update, then RL moves away
    # from it; entropy is logged beside it.
    assert abs(train[0]["train/ref_kl"]) < 1e-4 and train[-1]["train/ref_kl"] > 0, train
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
    assert any(len(s.metadata.get("agent", {}).get("answer") or "") == 3 for s in samples)

    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert set(trained) <= {e["prompt_index"] for e in episodes if e["decision"] == "keep"}
    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if line.startswith("[rollout] episodes closed:")]
    assert closing and "live at close 0" in closing[0] and "swept 0" in closing[0], closing
    assert (out / "reward_curve.png").stat().st_size > 1000
