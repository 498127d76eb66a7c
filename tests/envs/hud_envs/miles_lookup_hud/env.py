"""A HUD environment with a tool, for the Miles tests: an initialize hook serves an MCP server
(FastMCP's streamable-HTTP app under uvicorn, on a free loopback port) and publishes it as a
capability; the template asks for a code only the `lookup` tool knows, and grades the answer by it."""

from __future__ import annotations

import asyncio

import uvicorn
from fastmcp import FastMCP
from hud import Environment
from hud.capabilities import Capability

env = Environment("miles-lookup")
tools = FastMCP("miles-lookup-tools")
CODES = {"red": "417", "green": "803", "blue": "265"}
served: list[tuple[uvicorn.Server, asyncio.Task]] = []


@tools.tool
def lookup(key: str) -> str:
    """The code for a colour."""
    if key not in CODES:
        raise ValueError(f"no code for {key!r}; the keys are {sorted(CODES)}")
    return CODES[key]


@env.initialize
async def serve_tools() -> None:
    server = uvicorn.Server(uvicorn.Config(tools.http_app(), host="127.0.0.1", port=0, log_level="warning"))
    served.append((server, asyncio.create_task(server.serve())))
    for _ in range(200):                                   # up within 10 s, or the episode fails
        if server.started:
            break
        await asyncio.sleep(0.05)
    else:
        raise RuntimeError("miles-lookup: the MCP server did not come up in 10 s")
    port = server.servers[0].sockets[0].getsockname()[1]
    env.add_capability(Capability.mcp(name="tools", url=f"http://127.0.0.1:{port}/mcp"))


@env.shutdown
async def stop_tools() -> None:
    while served:
        server, task = served.pop()
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)


@env.template(id="find_code", description="Look up a colour's code and say it.")
async def find_code(key: str):
    answer = yield f"What is the code for {key}? Use the lookup tool, then say the code."
    yield float(CODES[key] in (answer or ""))
