"""A user-style agent function, loaded by import path (`user_agent:agent`) in the contract test.

It is what a user would write: plain aiohttp against an OpenAI-compatible URL, a local tool,
a retry of a turn (as harnesses do after a reply they could not use), a subagent with its own
conversation, and a reward computed from the final answer.
"""

from __future__ import annotations

import aiohttp

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


async def agent(base_url: str, task: dict) -> dict:
    url = f"{base_url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        async def ask(messages):
            body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": task.get("max_tokens", 8),
                    "temperature": 1.0}
            async with http.post(url, json=body) as r:
                reply = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"chat completion failed: {reply}")
                return reply["choices"][0]["message"]

        messages = [{"role": "system", "content": "You are a calculator. Use the add tool."},
                    {"role": "user", "content": task["question"]}]
        first = await ask(messages)
        reply = await ask(messages)            # retry the first turn: only the retry is kept
        for _ in range(task.get("turns", 3) - 1):
            messages.append(reply)
            for call in reply.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
            if not reply.get("tool_calls"):
                messages.append({"role": "user", "content": "Please call the add tool."})
            reply = await ask(messages)
        if task.get("subagent"):               # a subagent: its own conversation, same session
            await ask([{"role": "system", "content": "You check answers."},
                       {"role": "user", "content": f"Is {reply.get('content')!r} right?"}])
    answer = reply.get("content") or ""
    return {"reward": float(task["answer"] in answer), "final_answer": answer, "first_try": first.get("content")}
