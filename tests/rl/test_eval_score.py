"""The evaluator: bounded concurrency, rollout's tokenization, the reward by `train.reward_key`,
the served version from the responses' spans, the HF snapshot directory as it is (fleet mode), and
an external command killed with its process group on timeout or cancellation."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import psutil
from aiohttp import web

from miles.actors.evaluator import Evaluator
from miles.backends import TrainConfig
from miles.config import Recipe, RunConfig
from miles.rl.config import DataConfig, EvalConfig, ModelConfig
from miles.rl.data import Prompt
from miles.tiny import build_tiny_model
from miles.wire.messages import Evaluate


class ChatTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1, 2] + [ord(c) for c in messages[-1]["content"]]

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """/generate that records concurrency and prompts; later answers report a crossed update."""

    def __init__(self):
        self.inflight = self.max_inflight = self.calls = 0
        self.prompts: list[list[int]] = []

    async def generate(self, request: web.Request):
        body = await request.json()
        self.prompts.append(body["input_ids"])
        self.calls += 1
        crossed = self.calls > 10
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        await asyncio.sleep(0.02)
        self.inflight -= 1
        spans = ([{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
                 if crossed else [{"version": "3", "start": 0, "end": 2}])
        return web.json_response({"output_ids": [ord("o"), ord("k")], "meta_info": {
            "finish_reason": {"type": "length", "length": 2}, "weight_version": spans[-1]["version"],
            "weight_versions": spans}})


def _evaluator(tmp_path, chat: bool = True, **eval_cfg) -> Evaluator:
    ev = Evaluator()
    ev.recipe = Recipe(run=RunConfig(output_dir=str(tmp_path / "run")),
                       data=DataConfig(apply_chat_template=chat),
                       train=TrainConfig(reward_key="correct"), eval=EvalConfig(**eval_cfg))
    ev.cfg = ev.recipe.eval
    return ev


async def test_score_is_bounded_tokenized_like_rollout_and_reports_served_versions(tmp_path):
    fake = FakeEngine()
    app = web.Application()
    app.router.add_post("/generate", fake.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        ev = _evaluator(tmp_path, max_concurrency=4)
        ev.tokenizer = ChatTokenizer()
        ev.prompts = [Prompt(index=i, prompt=f"q{i}", label="ok") for i in range(20)]
        # A dict reward: "correct" is the entry trained on; the first entry is something else.
        ev.reward_fn = lambda s: {"length": 9.0, "correct": 1.0 if s.response == s.label else 0.0}
        metrics, served = await ev._score(url)
    finally:
        await runner.cleanup()
    assert fake.calls == 20 and fake.max_inflight == 4
    assert sorted(fake.prompts)[0][:2] == [1, 2], "the chat template rollout applies"
    assert metrics["eval/reward"] == 1.0
    assert served == (3, 4) and metrics["eval/version_min"] == 3 and metrics["eval/version_max"] == 4


async def test_fleet_mode_loads_the_snapshot_directory_itself(tmp_path):
    ev = _evaluator(tmp_path, chat=False, mode="fleet", max_new_tokens=2, timeout_s=120)
    ev.runtime = None
    model = build_tiny_model(arch="qwen3")
    from miles.rl.sources import tokenizer_for
    ev.tokenizer = tokenizer_for(str(model))
    ev.reward_fn = lambda s: {"correct": 0.5}
    ev.prompts = [Prompt(index=i, prompt="sort 321 =", label="123") for i in range(3)]
    result = await ev.on_evaluate(Evaluate(step=4, version=4, checkpoint_dir=str(model)))
    assert result.ok, result.error
    assert result.metrics["eval/n"] == 3 and result.metrics["eval/reward"] == 0.5
    assert result.version == 0 == result.version_max  # the snapshot's engine serves "default"


def _spawn_command(tmp_path) -> str:
    pids = tmp_path / "pids"
    script = tmp_path / "slow_eval.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(300)\n")
    return f"{sys.executable} {script} {{checkpoint}} {{step}}"


def _pids(tmp_path) -> list[int]:
    deadline = time.monotonic() + 30
    while not (tmp_path / "pids").exists() or not (tmp_path / "pids").read_text():
        assert time.monotonic() < deadline, "the eval command never started"
        time.sleep(0.05)
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.05)
    return False


async def test_external_command_that_times_out_is_killed_with_its_children(tmp_path):
    ev = _evaluator(tmp_path, mode="external", command=_spawn_command(tmp_path), timeout_s=2.0)
    t0 = time.monotonic()
    result = await ev.on_evaluate(Evaluate(step=3, version=3, checkpoint_dir=str(tmp_path)))
    assert not result.ok and "did not finish" in result.error and time.monotonic() - t0 < 15
    assert _gone(_pids(tmp_path)), "the command or its child outlived the timeout"


async def test_external_command_is_killed_when_the_evaluation_is_cancelled(tmp_path):
    ev = _evaluator(tmp_path, mode="external", command=_spawn_command(tmp_path), timeout_s=300.0)
    task = asyncio.ensure_future(ev.on_evaluate(Evaluate(step=3, version=3, checkpoint_dir="x")))
    pids = await asyncio.to_thread(_pids, tmp_path)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert _gone(pids), "the command or its child outlived the cancellation"
    assert os.path.exists(tmp_path / "run" / "logs" / "eval-step3.log")
