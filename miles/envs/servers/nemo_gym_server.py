"""NeMo Gym servers for Miles: a resources server from the package and its `simple_agent`, in one
process of NeMo Gym's own Python 3.12 venv.

    python nemo_gym_server.py --resources-port A --agent-port B \
        --resources resources_servers.example_tool_call_multireward.app:ToolCallMultiRewardResourcesServer

    resources server (port A): NeMo Gym's own app: POST /seed_session, /verify, /aggregate_metrics, tools
    agent server (port B):     NeMo Gym's SimpleAgent: POST /run, /v1/responses; GET /health

Run by `miles.envs.nemo_gym_env` as a supervised process. Imports only the stdlib and what NeMo Gym
installs: never Miles, never torch.

Design decisions:
- The package's classes run unchanged: the resources server (any `SimpleResourcesServer` subclass,
  named by import path) and `responses_api_agents.simple_agent.app:SimpleAgent`, each served by
  uvicorn from its own `setup_webserver()`. What NeMo Gym's launcher (`ng_run`: Ray, a head server,
  Hydra) adds is replaced by a fixed name table handed to its `ServerClient`.
- `policy_base_url` is per request: `/run`'s body carries it (the episode's TITO session) and
  `policy_api_key` (the session token, sent as a Bearer key); the agent's model calls go there.
  A context variable holds both for the request's task (headers carry them on the agent's call
  to its own /v1/responses); the ServerClient resolves the model server's name to the URL.
- The reward is the resources server's `/verify` answer, returned whole by `/run` (`reward`, and
  `reward_components` where the server gives them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib

import uvicorn
from fastapi import Request
from omegaconf import OmegaConf

from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient

POLICY = "policy_model"
RESOURCES = "resources"
AGENT = "simple_agent"
POLICY_HEADER = "X-Miles-Policy-Base-Url"
KEY_HEADER = "X-Miles-Policy-Api-Key"
# (policy_base_url, policy_api_key) of the request being served
_policy: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("policy", default=("", ""))


class PerRequestPolicyClient(ServerClient):
    """NeMo Gym's ServerClient; the policy model's address is the current request's policy_base_url."""

    def _build_server_base_url(self, server_config_dict) -> str:
        if server_config_dict.get("host") == POLICY:
            url = _policy.get()[0]
            if not url:
                raise RuntimeError("policy_base_url: the /run request named no policy endpoint")
            return url.rstrip("/")
        return super()._build_server_base_url(server_config_dict)

    async def request(self, server_name: str, url_path: str, method: str, **kwargs):
        url, key = _policy.get()
        if server_name == AGENT and url:
            # SimpleAgent.run calls its own /v1/responses over HTTP: the policy goes along
            kwargs["headers"] = {**(kwargs.get("headers") or {}), POLICY_HEADER: url, KEY_HEADER: key}
        elif server_name == POLICY and key:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {key}"}
        return await super().request(server_name, url_path, method, **kwargs)


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def build(resources_path: str, host: str, resources_port: int, agent_port: int):
    from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentRunRequest

    names = OmegaConf.create({
        RESOURCES: {"resources_servers": {RESOURCES: {"host": host, "port": resources_port}}},
        AGENT: {"responses_api_agents": {AGENT: {"host": host, "port": agent_port}}},
        POLICY: {"responses_api_models": {POLICY: {"host": POLICY, "port": 0}}}})
    client = PerRequestPolicyClient(head_server_config=BaseServerConfig(host=host, port=0), global_config_dict=names)

    resources_cls = _load(resources_path)
    config_cls = resources_cls.model_fields["config"].annotation
    resources = resources_cls(config=config_cls(host=host, port=resources_port, entrypoint="app.py",
                                                name=RESOURCES, domain="other"), server_client=client)
    agent_cfg_cls = SimpleAgent.model_fields["config"].annotation
    agent = SimpleAgent(config=agent_cfg_cls(
        host=host, port=agent_port, entrypoint="app.py", name=AGENT, max_steps=4,
        resources_server={"type": "resources_servers", "name": RESOURCES},
        model_server={"type": "responses_api_models", "name": POLICY}), server_client=client)

    resources_app = resources.setup_webserver()
    agent_app = agent.setup_webserver()
    # /run again, first: the same SimpleAgent.run, with the body's policy_base_url set for its calls
    agent_app.router.routes = [r for r in agent_app.router.routes if getattr(r, "path", "") != "/run"]

    @agent_app.post("/run")
    async def run(request: Request):
        body = await request.json()
        url = body.pop("policy_base_url", None)
        key = body.pop("policy_api_key", None) or ""
        if not isinstance(url, str) or not url:
            return _error(400, f"policy_base_url: expected the policy's base URL, got {url!r}")
        token = _policy.set((url, str(key)))
        try:
            return await agent.run(request, SimpleAgentRunRequest.model_validate(body))
        finally:
            _policy.reset(token)

    @agent_app.middleware("http")
    async def policy_from_header(request: Request, call_next):
        url = request.headers.get(POLICY_HEADER)
        if not url:
            return await call_next(request)
        token = _policy.set((url, request.headers.get(KEY_HEADER, "")))
        try:
            return await call_next(request)
        finally:
            _policy.reset(token)

    @agent_app.get("/health")
    async def health():
        return {"ok": True}

    @resources_app.get("/health")
    async def resources_health():
        return {"ok": True}

    return resources_app, agent_app


def _error(status: int, text: str):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": text}, status_code=status)


async def serve(args) -> None:
    # the HTTP client NeMo Gym's launcher would make from its global config: defaults, made here
    from nemo_gym.server_utils import GlobalAIOHTTPAsyncClientConfig, set_global_aiohttp_client
    set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    resources_app, agent_app = build(args.resources, args.host, args.resources_port, args.agent_port)
    servers = [uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                             timeout_graceful_shutdown=1))
               for app, port in ((resources_app, args.resources_port), (agent_app, args.agent_port))]
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--resources-port", type=int, required=True)
    p.add_argument("--agent-port", type=int, required=True)
    p.add_argument("--resources", default="resources_servers.example_tool_call_multireward.app:"
                                          "ToolCallMultiRewardResourcesServer")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
