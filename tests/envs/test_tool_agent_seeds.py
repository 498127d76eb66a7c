"""The tool agent gives each turn of an episode its own seed (`miles.seeds.turn_seed`): the
turns once reused the episode's seed, so every turn drew the same uniforms. Real session server,
scripted engine: the seeds are read where the engine receives them."""

from __future__ import annotations

import pytest

from miles.envs.tool_agent import agent
from miles.seeds import turn_seed
from miles.tito.client import SessionServerClient

pytestmark = pytest.mark.asyncio(loop_scope="module")   # the session server fixture's loop


async def test_each_turn_of_an_episode_samples_with_its_own_seed(scripted, sandboxes):
    engine, url = scripted
    box = await sandboxes({"a.txt": "5"})
    engine.sampling.clear()
    engine.replies = ['<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'] * 3 + [
        '<tool_call>\n{"name": "submit", "arguments": {"answer": "5"}}\n</tool_call>']
    task = {"prompt": "go", "sandbox": box, "sampling": {"max_tokens": 200, "seed": 777}}
    async with SessionServerClient(url) as client:
        created = await client.create_session(rollout_id="seeds")
        try:
            result = await agent(created["base_url"], task)
        finally:
            await client.collect(created["session_id"], close=True)
    assert result["stop"] == "submitted" and result["metrics"]["turns"] == 4
    seeds = [p["sampling_seed"] for p in engine.sampling]
    assert seeds == [turn_seed(777, k) for k in range(4)] and seeds[0] == 777
    assert len(set(seeds)) == 4
