"""User-style plug-ins of the episode depths, loaded by import path in tests/rl/test_plugin_depths.py.

- `generate`: a two-turn `rollout.generate`. The model answers, a "tool" reads the task's file in
  the episode's sandbox, its output is appended as tokens the model did not make (loss mask 0),
  the model answers again; the final answer is written into the sandbox for the verifier.
- `agent`: a two-turn `rollout.agent` over the session's OpenAI-compatible endpoint (aiohttp),
  with the same sandbox steps.
- `sandbox_reward`: the verifier. It reads the answer file from the episode's sandbox.
- Bad plug-ins for the recipe checks, and plug-ins that fail halfway.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import numpy as np

from miles.rl.rewards import first_answer
from miles.wire.messages import Sample


async def generate(ctx, sample: Sample) -> Sample:
    sandbox = await ctx.sandbox()
    prompt = sample.tokens.tolist()
    first = await ctx.generate(prompt)
    tool = await sandbox.exec("cat secret.txt")
    tool_ids = ctx.tokenizer.encode(f" tool:{tool.stdout.strip()}\n", add_special_tokens=False)
    second = await ctx.generate(prompt + first.output_ids + tool_ids)
    response = first.output_ids + tool_ids + second.output_ids
    text = ctx.tokenizer.decode(response, skip_special_tokens=True)
    await sandbox.upload("answer.txt", text.encode())
    ctx.note("tool_calls", 1)
    mask = [1] * len(first.output_ids) + [0] * len(tool_ids) + [1] * len(second.output_ids)
    logprobs = first.output_logprobs + [0.0] * len(tool_ids) + second.output_logprobs
    return msgspec.structs.replace(
        sample, tokens=np.asarray(prompt + response, np.int32), response_length=len(response),
        loss_mask=np.asarray(mask, np.uint8), rollout_logprobs=np.asarray(logprobs, np.float32),
        response=text, status="completed" if second.finish_reason.type == "stop" else "truncated",
        metadata={**sample.metadata, "plugin": "depths.generate", "answer_written": text,
                  "turn_lengths": [len(first.output_ids), len(tool_ids), len(second.output_ids)],
                  "tool_stdout": tool.stdout})


async def agent(base_url: str, task: dict) -> dict:
    sandbox = task["sandbox"]
    headers = {"Authorization": f"Bearer {task['api_key']}"}
    url = f"{base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": task["prompt"]}]
    async with aiohttp.ClientSession(headers=headers) as http:
        async def ask() -> str:
            body = {"model": "policy", "messages": messages, "max_tokens": 4, "temperature": 1.0}
            async with http.post(url, json=body) as r:
                reply = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"chat completion failed: HTTP {r.status}: {reply}")
            content = reply["choices"][0]["message"].get("content") or ""
            messages.append({"role": "assistant", "content": content})
            return content
        await ask()
        tool = await sandbox.exec("cat secret.txt")
        messages.append({"role": "user", "content": f"tool: {tool.stdout.strip()}"})
        final = await ask()
    await sandbox.upload("answer.txt", final.encode())
    return {"metrics": {"tool_calls": 1.0}, "marker": "depths.agent", "answer_written": final,
            "tool_stdout": tool.stdout}


async def sandbox_reward(sample: Sample, sandbox) -> dict:
    """The answer as the sandbox holds it (not the sample's text): what a verifier of state does."""
    text = (await sandbox.download("answer.txt")).decode()
    checked = Sample(tokens=np.zeros(1, np.int32), response=text, label=sample.label)
    return {"correct": first_answer(checked), "sandbox_bytes": float(len(text.encode()))}


# ----- plug-ins that fail halfway (unit tests of the episode runner) --------------------------

async def raises_after_one_turn(ctx, sample: Sample) -> Sample:
    await ctx.sandbox()
    await ctx.generate(sample.tokens.tolist())
    raise RuntimeError("the tool crashed after turn 1")


async def hangs_after_one_turn(ctx, sample: Sample) -> Sample:
    sandbox = await ctx.sandbox()
    first = await ctx.generate(sample.tokens.tolist())
    await sandbox.exec("true")
    await ctx.generate(sample.tokens.tolist() + first.output_ids + [5, 6])
    await asyncio.sleep(3600)
    raise AssertionError("unreachable: the episode timeout cuts this off")


async def too_many_turns(ctx, sample: Sample) -> Sample:
    ids = sample.tokens.tolist()
    while True:
        ids += (await ctx.generate(ids)).output_ids


async def agent_raises_halfway(base_url: str, task: dict) -> dict:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {task['api_key']}"}) as http:
        async with http.post(f"{base_url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": task["prompt"]}],
                                   "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
    await task["sandbox"].exec("touch half.txt")
    raise RuntimeError("the harness crashed after turn 1")


async def agent_hangs_halfway(base_url: str, task: dict) -> dict:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {task['api_key']}"}) as http:
        async with http.post(f"{base_url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": task["prompt"]}],
                                   "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
    await task["sandbox"].exec("true")
    await asyncio.sleep(3600)
    return {}


# ----- plug-ins that break the contract (refused by the recipe check) -------------------------

def not_async(ctx, sample):
    return sample


async def one_parameter(sample):
    return sample


async def agent_three_parameters(base_url, task, extra):
    return {}


def sync_sandbox_reward(sample, sandbox):
    return 0.0


async def agent_loses_its_session(base_url: str, task: dict) -> dict:
    """One turn, then the session vanishes from the server (as after a session-server restart)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {task['api_key']}"}) as http:
        async with http.post(f"{base_url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": task["prompt"]}],
                                   "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
        async with http.delete(base_url) as r:
            assert r.status == 200, await r.text()
    return {"reward": 1.0}


async def forks(ctx, sample: Sample) -> list[Sample]:
    """A trajectory tree: two continuations of one first turn, returned with no ids set."""
    prompt = sample.tokens.tolist()
    first = await ctx.generate(prompt)
    out = []
    for _ in range(2):
        second = await ctx.generate(prompt + first.output_ids)
        response = first.output_ids + second.output_ids
        out.append(Sample(tokens=np.asarray(prompt + response, np.int32), response_length=len(response),
                          loss_mask=np.ones(len(response), np.uint8),
                          rollout_logprobs=np.asarray(first.output_logprobs + second.output_logprobs, np.float32),
                          response=ctx.tokenizer.decode(response), status="completed"))
    return out


async def files_reward(sample: Sample, sandbox) -> float:
    """A verifier of a sandbox the episode never used: it is created for it, task files written."""
    return float((await sandbox.download("secret.txt")).decode() == "hint\n")
