"""Fixtures for the tool-agent tests: a tiny model that has learned the tool-call format, a real
serving stack in front of it, subprocess sandboxes.

- `tool_model`: the tiny Qwen3 model, fine-tuned (plain torch, a few seconds) on the `find_file`
  SFT transcripts (sent without tool schemas, as the quickstart does), so that it really emits `<tool_call>` blocks. A random
  model never calls a tool, and these tests are about what happens when it does.
- `stack`: the session server process -> smg -> one embedded engine, with a recording proxy between
  smg and the engine (what the engine received and produced is the ground truth for token
  exactness). Started once per module.
- `sandboxes`: `await sandboxes(files)` -> a fresh subprocess sandbox with the files written;
  all are destroyed at teardown, and the test fails if any process of theirs is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from miles.engines.procs import ServerProcess, free_port
from tests.scripted_engine import scripted_session_server

SFT_STEPS = 50   # loss ~0.2: the format is learned, the copying mostly


@pytest.fixture(scope="session")
def find_file_rows():
    """The agent quickstart's rows (`find_file`: no tool schemas sent), (train, held-out)."""
    from miles.rl.tasks import find_file_rows as rows
    return rows(seed=0, n_train=2000)


@pytest.fixture(scope="session")
def tool_model(find_file_rows, tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.rl.tasks import sft_rows
    from miles.tiny import build_tiny_model

    base = build_tiny_model(arch="qwen3")
    tok = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the engine and the other tests share the cores: spinning threads lose
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = sft_rows(find_file_rows[0])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch_size = 32
    for step in range(SFT_STEPS):
        batch = [rows[(step * batch_size + j) % len(rows)] for j in range(batch_size)]
        seqs, masks = [], []
        for r in batch:
            p = tok.encode(r["prompt"], add_special_tokens=False)
            a = tok.encode(r["label"], add_special_tokens=False) + [tok.eos_token_id]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("tool-model") / "model"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


class RecordingProxy:
    """Forwards everything to one engine and records each /generate body with its answer."""

    def __init__(self, engine_url: str):
        self.engine_url = engine_url
        self.generates: list[tuple[dict, dict]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        async with self.http.request(request.method, self.engine_url + request.path_qs, data=body or None,
                                     headers={"Content-Type": "application/json"} if body else None) as r:
            raw = await r.read()
            if request.path == "/generate" and r.status == 200:
                self.generates.append((json.loads(body), json.loads(raw)))
            return web.Response(body=raw, status=r.status, content_type=r.content_type)

    async def start(self) -> None:
        self.http = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.http.close()

    def for_session(self, session_id: str) -> list[tuple[dict, dict]]:
        return [g for g in self.generates if g[0]["rid"].startswith(f"tito-{session_id}-")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tool_model, tmp_path_factory):
    """(session server url, recording proxy, model dir)."""
    from miles.engines.embedded import launch_embedded_engine
    from miles.engines.gateway import GatewayConfig, launch_gateway

    logs = tmp_path_factory.mktemp("tool-agent-logs")
    engine = await launch_embedded_engine(tool_model, extra_args=["--torch-threads", "1", "--random-seed", "0"],
                                          log_path=logs / "engine.log")
    proxy = RecordingProxy(engine.url)
    await proxy.start()
    gateway = await launch_gateway(GatewayConfig(port=free_port(), prometheus_port=free_port()),
                                   [proxy.url], log_path=logs / "smg.log")
    port = free_port()
    server = ServerProcess("tito", [sys.executable, "-m", "miles.tito.server", "--engine-url", gateway.url,
                                    "--model-path", str(tool_model), "--family", "qwen3", "--port", str(port)],
                           log_path=logs / "tito.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        await server.wait_healthy(url, timeout_s=60)
        yield url, proxy, tool_model
    finally:
        await asyncio.gather(server.stop_async(grace_s=5), gateway.stop_async(grace_s=5),
                             engine.stop_async(grace_s=5))
        await proxy.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def sandboxes():
    from miles.sandboxes import SandboxSpec, get_backend
    from miles.sandboxes.hostfs import default_base_dir

    # Not pytest's tmp_path: its parents are 0700 and sandboxes run under their own uid.
    base = tempfile.mkdtemp(prefix="miles-envs-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(base, 0o711)
    backend = get_backend("subprocess", base_dir=base)
    made = []

    async def make(files: dict[str, str] | None = None):
        sandbox = await backend.create(SandboxSpec(labels={"miles.test": "tool-agent"}, ttl_s=600))
        for path, text in (files or {}).items():
            await sandbox.upload(path, text.encode())
        made.append(sandbox)
        return sandbox

    try:
        yield make
    finally:
        for sandbox in made:
            await sandbox.destroy()
        left = await backend.sweep({"miles.test": "tool-agent"})
        backend.spawner.close()
        shutil.rmtree(base, ignore_errors=True)
        assert left == 0, f"{left} sandboxes outlived their test"


@pytest_asyncio.fixture(loop_scope="module")
async def scripted():
    """(scripted engine, session server url): the real session server in this process."""
    async with scripted_session_server() as pair:
        yield pair
