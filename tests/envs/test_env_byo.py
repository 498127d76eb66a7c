"""Bring your own environment: examples/envs/my_env.py (a task set, an agent on the episode's
OpenAI endpoint, a verifier: under 30 lines of code), shown whole in docs/environments.md.

- The page's code block is the file's code, and its recipe keys are recipes/envs/byo.toml's.
- Through the episode runner (the run's code path; scripted engine, real session server): an agent
  that raises after its model calls fails its own episodes' samples, error and tokens kept, while
  the other episodes get the example's verifier's reward.
- In a real `miles run` of recipes/envs/byo.toml: the rewards in the trained samples are the
  example's verifier's, each episode's turns are what its agent says it made, and nothing of the
  run is left afterwards (processes, sessions, sandboxes).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from tests.envs.leftovers import left_behind
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("my_env", ROOT / "examples" / "envs" / "my_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_task_set_splits_by_seed_and_the_verifier_reads_the_answer():
    from types import SimpleNamespace
    my_env = load_example()
    splits = my_env.tasks(seed=0, test_frac=0.25)
    assert (len(splits["train"]), len(splits["test"])) == (75, 25)
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["test"]}
    assert my_env.tasks(seed=0, test_frac=0.25) == splits
    assert my_env.reward(SimpleNamespace(label="7", metadata={"agent": {"answer": " 7."}})) == 1.0
    assert my_env.reward(SimpleNamespace(label="7", metadata={"agent": {"answer": "8"}})) == 0.0


def test_the_docs_show_the_example_files_code_and_its_recipe_keys():
    source = (ROOT / "examples" / "envs" / "my_env.py").read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    code = "\n".join(source.splitlines()[docstring_end:]).strip("\n")
    page = (ROOT / "docs" / "environments.md").read_text()
    section = page.split("\n## Bring your own\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)\n```", section, re.S)
    [shown_code] = [body for lang, body in blocks if lang == "python"]
    assert shown_code == code, "docs/environments.md no longer shows examples/envs/my_env.py: copy it over"
    assert len(code.splitlines()) <= 30, len(code.splitlines())
    [shown_toml] = [body for lang, body in blocks if lang == "toml"]
    recipe = tomllib.loads((ROOT / "recipes" / "envs" / "byo.toml").read_text())
    for table, keys in tomllib.loads(shown_toml).items():
        assert {k: recipe[table][k] for k in keys} == keys, table


FLAKY_AGENT = """
from examples.envs import my_env


async def agent(base_url, task):
    # the example's agent, then a checker of the user's own that is down for some tasks
    out = await my_env.agent(base_url, task)
    if task.get("checker_down"):
        raise ConnectionError("the answer checker is down")
    return out
"""


async def test_an_agent_that_raises_fails_its_own_episodes_and_the_others_score(tmp_path, monkeypatch):
    """8 episodes of the example's rows through `run_episode` (what the rollout actor runs per
    sample), the agent raising after its model call in 3 of them: those samples are `failed` with
    the error, their tokens kept and unscored; the 5 others, before and after, get the example's
    verifier's reward; no session is left open."""
    from miles.config import load_recipe
    from miles.engines.client import EngineClient, SamplingParams
    from miles.envs.episode import EpisodeEnv, run_episode
    from miles.tiny import build_tokenizer
    from miles.tito.tokenizer import load_tokenizer
    from miles.wire.messages import EngineSet, Sample
    from tests.scripted_engine import scripted_session_server

    my_env = load_example()
    (tmp_path / "flaky_byo.py").write_text(FLAKY_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"byo-flaky-{int(time.time())}"
    recipe = load_recipe(ROOT / "recipes" / "envs" / "byo.toml", overrides=[
        'rollout.agent="flaky_byo:agent"', f"run.name={json.dumps(name)}",
        f"run.output_dir={json.dumps(str(tmp_path / name))}"])
    rows = my_env.tasks(seed=0, test_frac=0.25)["train"][:8]
    down = {1, 4, 6}
    async with scripted_session_server() as (engine, url):
        engines = EngineSet(gateway_url=engine.url, engine_urls=[engine.url], model_path="scripted", session_url=url)
        client = EngineClient(engine.url)
        env = await EpisodeEnv.open(recipe, engines, client, load_tokenizer(str(build_tokenizer())), role="rollout")
        try:
            for i, row in enumerate(rows):
                right = i in down or i % 2 == 0
                engine.replies[:] = [row["label"]] if right else ["no", "no"]
                sample = Sample(tokens=np.zeros(0, np.int32), group_id=f"g{i}", rollout_id=f"g{i}-0",
                                prompt=row["prompt"], label=row["label"], metadata={"checker_down": i in down})
                params = SamplingParams(max_new_tokens=recipe.rollout.max_new_tokens,
                                        temperature=recipe.rollout.temperature, sampling_seed=i)
                [s] = await run_episode(env, sample, params)
                if i in down:
                    assert s.status == "failed", s.metadata
                    assert s.metadata["agent_error"] == "ConnectionError: the answer checker is down"
                    assert s.response_length > 0 and s.loss_mask.sum() > 0   # the model's turn is kept
                    assert s.reward is None                                  # and never scored
                else:
                    assert s.status == "completed" and "agent_error" not in s.metadata, s.metadata
                    assert s.reward == my_env.reward(s) == float(right), (s.reward, s.metadata["agent"])
                    assert s.metadata["session_stats"]["turns"] == (1 if right else 2)   # one more try when wrong
            values = env.metrics.values()
            assert (values["episode/count"], values["episode/failed"]) == (8.0, 3.0), values
            assert await env.our_sessions() == []
        finally:
            await env.close()
            await client.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_miles_run_of_the_example_environment(tmp_path):
    from miles.wire.messages import Batch
    from miles.wire.recorder import read_records

    my_env = load_example()
    out = tmp_path / f"byo-{int(time.time())}"
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "envs" / "byo.toml"),
            "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"run.name={json.dumps(out.name)}",
            "--set", "logging.progress=false", "--set", f"cluster.head_port={cluster_port()}",
            "--set", "loop.num_steps=3", "--set", "logging.record_wire=true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=850)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    log = log.decode(errors="replace")
    assert proc.returncode == 0, log[-4000:]

    samples = [s for r in read_records(out / "wire" / "driver.mlw") if isinstance(r.msg, Batch)
               for g in r.msg.groups for s in g.samples]
    assert len(samples) == 3 * 2 * 4, len(samples)
    for s in samples:
        assert s.status in ("completed", "truncated"), s.metadata
        assert s.reward == my_env.reward(s)            # the example's own verifier, once per episode
        turns = int(np.count_nonzero(np.diff(np.concatenate([[0], s.loss_mask.astype(np.int8)])) == 1))
        assert turns == s.metadata["session_stats"]["turns"] and 1 <= turns <= 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in rows if r["kind"] == "actors"]
    assert actors[-1]["episode/count"] >= 24 and 1.0 <= actors[-1]["episode/attempts"] <= 2.0
    assert sorted(r["step"] for r in rows if r["kind"] == "eval") == [0, 3]
    assert left_behind(out) == []   # no session, sandbox or process of the run
