"""Bring your own environment: a task set, an agent loop on the episode's OpenAI endpoint, a verifier.

    [data]
    task = "examples.envs.my_env:tasks"       # def tasks(seed, test_frac) -> {"train": rows, "test": rows}
    [rollout]
    agent = "examples.envs.my_env:agent"      # async def agent(base_url, task) -> dict
    reward = "examples.envs.my_env:reward"    # def reward(sample) -> float, once per episode

From the repository root (where `examples` is importable): `PYTHONPATH=. miles run recipes/envs/byo.toml`.
"""
import random

import aiohttp


def tasks(seed: int, test_frac: float) -> dict[str, list[dict]]:
    rows = [{"prompt": f"{a} plus {b} is", "label": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(rows)
    n = int(len(rows) * test_frac)
    return {"train": rows[n:], "test": rows[:n]}


async def agent(base_url: str, task: dict) -> dict:
    messages = [{"role": "user", "content": task["prompt"]}]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {task['api_key']}"}) as http:
        for attempt in range(2):   # an answer, and one more try when it is wrong
            body = {"model": "policy", "messages": messages, **task["sampling"]}
            async with http.post(f"{base_url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                answer = (await r.json())["choices"][0]["message"]["content"] or ""
            if task["label"] in answer:
                break
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "No. Again?"}]
    return {"answer": answer, "metrics": {"attempts": attempt + 1}}


def reward(sample) -> float:
    return float(sample.label in sample.metadata["agent"]["answer"])
