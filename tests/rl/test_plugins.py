"""Plug-in points of the loop, each loaded from an import path as a recipe names it."""

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from miles.actors.buffer import Buffer
from miles.config import load_recipe
from miles.rl.data import FileSource, load_rows
from miles import plugins
from miles.rl.rewards import call_maybe_async, check_reward, math_answer
from miles.rl.sources import make_source
from miles.wire.messages import Group, PutGroup, Sample

sys.path.insert(0, str(Path(__file__).parent / "plugins"))


def sample(response, label="7"):
    return Sample(tokens=np.zeros(3, np.int32), response_length=1, response=response, label=label)


async def test_reward_functions_builtin_and_by_import_path():
    assert math_answer(sample("so the answer is \\boxed{7}")) == 1.0
    assert math_answer(sample("I think 3, no wait, 7")) == 1.0
    assert plugins.load("rollout.reward", "first_answer")(sample("7 or 8")) == 1.0
    fn = plugins.load("rollout.reward", "user_plugins:length_reward")
    assert check_reward(await call_maybe_async(fn, sample("ab1")), "r") == {"len": 3.0, "has_digit": 1.0}
    batched = plugins.load("rollout.reward", "user_plugins:group_reward", batched=True)
    assert await call_maybe_async(batched, [sample("a"), sample("b")]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="rollout.reward = 'nope:fn': cannot import module 'nope'"):
        plugins.load("rollout.reward", "nope:fn")
    with pytest.raises(ValueError, match="reward must be a number"):
        check_reward("high", "rollout.reward 'x'")


def test_jsonl_and_parquet_sources_resume_at_the_same_prompt(tmp_path):
    rows = [{"prompt": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(10)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        a = FileSource(path, seed=3)
        seen = [next(a).prompt for _ in range(13)]           # crosses an epoch boundary
        b = FileSource(path, seed=3)
        [next(b) for _ in range(6)]
        c = FileSource(path, seed=3)
        c.restore(b.state())
        assert [next(c).prompt for _ in range(7)] == seen[6:]
        assert sorted(seen[:10]) == sorted(r["prompt"] for r in rows)
        p = a.at(2)                                           # metadata and label travel with the row
        assert p.metadata == {"i": int(p.label)} and p.prompt == f"q{p.label}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    with pytest.raises(ValueError, match="row 2 has no 'prompt' key"):
        load_rows(bad)


def test_user_data_source_by_import_path():
    recipe = load_recipe(text='[data]\nsource = "user_plugins:make_source"')
    src = make_source(recipe)
    assert [next(src).prompt for _ in range(3)] == ["count 0", "count 1", "count 2"]
    assert src.state() == {"position": 3}


async def test_user_buffer_policy_by_import_path():
    from miles.runtime import Runtime
    recipe = load_recipe(text='[buffer]\npolicy = "user_plugins:DropOdd"')
    buf = Buffer()
    buf.recipe = recipe
    rt = Runtime()
    await buf.start(rt, register=False)
    try:
        assert type(buf.policy).__name__ == "DropOdd"
        odd = Group(group_id="g", samples=[sample("x")], prompt_index=1)
        reply = await buf.on_put_group(PutGroup(group=odd, slot=0))
        assert (reply.decision, reply.reason) == ("drop", "odd prompt")
    finally:
        await buf.close()
        rt.close()
