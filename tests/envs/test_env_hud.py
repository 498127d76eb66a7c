"""HUD through `rollout.agent`: a HUD env template (tests/envs/hud_envs) on HUD's `LocalRuntime`,
Miles' agent (or HUD's own `OpenAIChatAgent`, `metadata.hud.agent = "hud"`) driving it against the
episode's TITO session, the env's MCP tools called through HUD's client, HUD's grade as the reward;
nothing reaches HUD's platform.

The fast tests use the scripted engine (exact answers, so exact rewards) behind the real session
server; the slow one is a real `miles run` of recipes/envs/hud.toml with the tiny model, with
every HUD platform URL pointed at a local recorder that must stay empty.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest

from miles.envs import hud_env
from miles.envs.agent import run_agent
from miles.tito.client import SessionServerClient
from tests.envs.leftovers import left_behind

ROOT = Path(__file__).resolve().parents[2]
HUD_URL_VARS = ("HUD_API_URL", "HUD_TELEMETRY_URL", "HUD_WEB_URL", "HUD_GATEWAY_URL", "HUD_RUNTIME_URL",
                "HUD_RL_URL")

aio = pytest.mark.asyncio(loop_scope="module")


def score(answer: str, digits: str) -> float:
    import importlib.util
    spec = importlib.util.spec_from_file_location("miles_digits_hud_env", hud_env.EXAMPLE_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score(answer, digits)


class Recorder:
    """A local HTTP server standing in for every HUD platform URL: what reaches it is a phone-home."""

    def __init__(self) -> None:
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                hits.append((self.command, self.path))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_network(monkeypatch):
    """Every outgoing connection of this process that is not to loopback is recorded and refused."""
    attempts = []
    real = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise ConnectionRefusedError(f"test: no network ({address})")
        return real(self, address)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


def task_of(row: dict, sampling: dict | None = None, **limits) -> dict:
    return {**row["metadata"], "prompt": row["prompt"], "label": row["label"],
            "limits": {"max_turns": 2, "episode_timeout_s": 120.0, **limits},
            "sampling": {"temperature": 0.0, "max_tokens": 16, **(sampling or {})}}


async def episode(url: str, row: dict, rollout_id: str, sampling: dict | None = None, **limits):
    async with SessionServerClient(url) as client:
        return await run_agent(hud_env.agent, task_of(row, sampling, **limits), client, group_id="g",
                               rollout_id=rollout_id)


@aio
async def test_check_spec_names_the_bad_key():
    with pytest.raises(hud_env.HudError, match=r"metadata.hud.template: expected a non-empty string"):
        hud_env.check_spec({"env": "e.py"})
    with pytest.raises(hud_env.HudError, match=r"unknown keys \['tmpl'\]"):
        hud_env.check_spec({"env": "e.py", "template": "t", "tmpl": 1})
    with pytest.raises(hud_env.HudError, match="metadata.hud.args"):
        hud_env.check_spec({"env": "e.py", "template": "t", "args": [1]})
    with pytest.raises(hud_env.HudError, match=r"metadata.hud.agent: expected one of \['miles', 'hud'\], got 'mine'"):
        hud_env.check_spec({"env": "e.py", "template": "t", "agent": "mine"})
    with pytest.raises(hud_env.HudError, match="no such file"):
        hud_env.load_task({"env": "nowhere/env.py", "template": "t"})
    with pytest.raises(hud_env.HudError, match=r"'nope' is not a template .* it has \['say_digits'\]"):
        hud_env.load_task({"env": str(hud_env.EXAMPLE_ENV), "template": "nope"})


@pytest.mark.parametrize("agent", ["miles", "hud"])
@aio
async def test_episodes_get_hud_grades_and_nothing_phones_home(scripted, no_network, agent):
    """8 HUD rollouts, answers exact, half-right and wrong: each reward is HUD's grade of the
    answer; with telemetry on and an API key set beforehand (every platform URL at a local
    recorder), nothing reaches the recorder and no non-loopback connection is tried."""
    from hud.settings import settings
    engine, url = scripted
    recorder = Recorder()
    for var in HUD_URL_VARS:
        setattr(settings, var.lower(), recorder.url)
    settings.api_key, settings.telemetry_enabled = "sk-test-not-a-key", True
    try:
        rows = hud_env.example_rows(8, seed=5, agent=agent)
        answers = []
        for i, row in enumerate(rows):
            digits = row["label"]
            answers.append([digits, f"{digits.split()[0]} and nothing", "no digits"][i % 3])
        for i, (row, answer) in enumerate(zip(rows, answers)):
            engine.replies[:] = [answer]
            run = await episode(url, row, f"hud-{i}")
            assert not run.error, run.error
            assert run.reward == pytest.approx(score(answer, row["label"])), (answer, run.reward)
            out = run.samples[0].metadata["agent"]
            assert out["answer"] == answer and out["stop_reason"] == "done"
            assert out["messages"] == [{"role": "user", "content": row["prompt"]},
                                       {"role": "assistant", "content": answer}]
            assert run.samples[0].status == "completed" and run.samples[0].response_length > 0
        assert sorted({round(r, 3) for r in (score(a, r["label"]) for a, r in zip(answers, rows))}) == [0.0, 0.333, 1.0]
    finally:
        recorder.close()
    assert recorder.hits == [], recorder.hits
    assert no_network == [], no_network
    assert not settings.telemetry_enabled and settings.api_key is None


LOOKUP_ENV = "tests/envs/hud_envs/miles_lookup_hud/env.py"


def lookup_row(key: str) -> dict:
    return {"prompt": "", "label": key, "metadata": {"hud": {"env": LOOKUP_ENV, "template": "find_code",
                                                             "args": {"key": key}}}}


def tool_call(name: str, **arguments) -> str:
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (the env's MCP server runs in it, as HUD runs here)."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def record_opened_capabilities(monkeypatch) -> list[str]:
    """The URLs of the MCP capabilities our agent opens, in order, recorded as it opens them."""
    urls, real = [], hud_env._open_tools

    async def recording(run, cap, timeout_s):
        urls.append(cap.url)
        return await real(run, cap, timeout_s)
    monkeypatch.setattr(hud_env, "_open_tools", recording)
    return urls


def assert_server_gone(url: str, listening_before: set[int]) -> None:
    """Nothing answers on the MCP server's port, and this process listens on no new port."""
    port = urllib.parse.urlsplit(url).port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert listening_ports() == listening_before, (url, listening_ports() - listening_before)


@aio
async def test_our_agent_calls_the_envs_mcp_tools_and_hud_grades_the_answer(scripted, monkeypatch):
    """The env publishes an MCP server (FastMCP on loopback) as a capability: Miles' agent offers
    its `lookup` tool to the model (in the rendered prompt), runs the call through HUD's client, feeds
    the result back, and HUD grades the final answer. A tool that raises is an error result the
    model sees, not the episode's end; the MCP server is gone after each episode (its port refuses
    connections, no listening socket is left)."""
    engine, url = scripted
    listening_before = listening_ports()
    opened = record_opened_capabilities(monkeypatch)
    engine.replies[:] = [tool_call("lookup", key="red"), "The code is 417."]
    run = await episode(url, lookup_row("red"), "hud-tool-ok", {"max_tokens": 64}, max_turns=3)
    assert not run.error, run.error
    assert len(opened) == 1 and opened[0].startswith("http://127.0.0.1:"), opened
    assert_server_gone(opened[0], listening_before)
    out = run.samples[0].metadata["agent"]
    assert run.reward == 1.0, (out, engine.prompts)
    assert '"name": "lookup"' in engine.prompts[0]        # the env's tool, declared to the model
    tool_msgs = [m for m in out["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["417"]
    assert run.metrics["tool_calls"] == 1.0 and run.metrics["tool_errors"] == 0.0
    assert out["answer"] == "The code is 417." and out["stop_reason"] == "done"
    assert run.samples[0].response_length > 0

    engine.replies[:] = [tool_call("lookup", key="pink"), tool_call("nope"), "I could not find it."]
    run = await episode(url, lookup_row("blue"), "hud-tool-bad", {"max_tokens": 64}, max_turns=4)
    assert not run.error, run.error
    assert run.reward == 0.0
    out = run.samples[0].metadata["agent"]
    errors = [m["content"] for m in out["messages"] if m["role"] == "tool"]
    assert "no code for 'pink'" in errors[0] and "unknown tool 'nope'; the tools are lookup" in errors[1], errors
    assert run.metrics["tool_errors"] == 2.0
    assert len(opened) == 2 and opened[1] != opened[0], opened   # a server of its own per episode
    assert_server_gone(opened[1], listening_before)

    engine.replies[:] = [tool_call("lookup", key="green")] * 3
    run = await episode(url, lookup_row("green"), "hud-tool-limit", {"max_tokens": 64}, max_turns=2)
    assert not run.error and run.samples[0].status == "truncated"
    assert run.samples[0].metadata["agent"]["stop_reason"] == "max_steps"
    assert len(opened) == 3
    assert_server_gone(opened[2], listening_before)


@aio
async def test_concurrent_episodes_run_at_once(scripted):
    """LocalRuntime(path) loads a fresh env per episode: 4 rollouts with a slow model overlap."""
    engine, url = scripted
    rows = hud_env.example_rows(4, seed=9)
    engine.replies[:] = [r["label"] for r in rows]

    t0 = time.monotonic()
    runs = await asyncio.gather(*(episode(url, r, f"hud-c{i}") for i, r in enumerate(rows)))
    wall = time.monotonic() - t0
    assert all(not r.error for r in runs), [r.error for r in runs]
    assert sorted(r.reward for r in runs) == sorted(score(r.samples[0].metadata["agent"]["answer"], row["label"])
                                                    for r, row in zip(runs, rows))
    starts = sorted(r.samples[0].metadata["agent_time_s"] for r in runs)
    assert wall < sum(starts), (wall, starts)   # not one after another


@pytest.mark.parametrize("case", ["template_raises", "grading_raises", "model_call_fails"])
@aio
async def test_a_failing_hud_rollout_fails_the_sample_not_the_run(scripted, case):
    engine, url = scripted
    args = {"template_raises": {"fail": "start"}, "grading_raises": {"fail": "grade"}, "model_call_fails": {}}[case]
    row = hud_env.example_rows(1, seed=2)[0]
    row["metadata"]["hud"]["args"].update(args)
    engine.replies[:] = ["1 2 3"]
    # the session server refuses the request (400 naming the field): the agent's model call fails
    run = await episode(url, row, f"hud-{case}", sampling={"temperature": -1.0} if case == "model_call_fails" else None)
    want = {"template_raises": "start failed on purpose", "grading_raises": "grading failed on purpose",
            "model_call_fails": "temperature"}[case]   # the session server names the field
    assert want in run.error, run.error
    for s in run.samples:
        assert s.status == "failed" and want in s.metadata["agent_error"]
    engine.replies[:] = [hud_env.example_rows(1, seed=2)[0]["label"]]
    ok = await episode(url, hud_env.example_rows(1, seed=2)[0], f"hud-after-{case}")
    assert not ok.error and ok.reward == 1.0


def test_the_recipe_checks():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "miles.cli", "check", str(ROOT / "recipes" / "envs" / "hud.toml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "recipe OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_miles_run_of_the_hud_recipe(tmp_path):
    """A real `miles run`: 16 HUD rollouts with the tiny model; every trained sample's reward is
    HUD's grade of its answer, its tokens are what the conversation renders to, nothing is left
    open, and nothing reached the (recorder-stood-in) HUD platform though a key was set."""
    from test_env_openenv import check_trained_samples, run_recipe

    recorder = Recorder()
    env = {var: recorder.url for var in HUD_URL_VARS}
    env.update(HUD_API_KEY="sk-test-not-a-key", HUD_TELEMETRY_ENABLED="true")
    out = tmp_path / "hud-run"
    try:
        code, log, samples = run_recipe(ROOT / "recipes" / "envs" / "hud.toml", out, env, timeout_s=800)
    finally:
        recorder.close()
    assert code == 0, log[-3000:]
    assert len(samples) >= 16, len(samples)
    for s in samples:
        assert s.status in ("completed", "truncated"), (s.status, s.metadata.get("agent_error"))
        answer = s.metadata["agent"]["answer"]
        assert s.reward == pytest.approx(score(answer, s.metadata["hud"]["args"]["digits"])), (answer, s.reward)
    assert any(s.reward > 0 for s in samples), [s.reward for s in samples]
    check_trained_samples(samples, out)
    assert recorder.hits == [], recorder.hits
    closing = [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
               if "sessions of this run open" in line]
    assert closing and all("open: 0" in line for line in closing), closing  # listed, and none open
    assert left_behind(out) == []   # no session, sandbox or process of the run (engine, session server)


@aio
async def test_an_mcp_capability_that_never_answers_fails_within_the_tool_timeout():
    """Opening the env's tools has its own deadline, naming the capability, not only HUD's
    rollout timeout."""
    import types

    async def hang(name):
        await asyncio.sleep(60)
    run = types.SimpleNamespace(client=types.SimpleNamespace(open=hang))
    cap = types.SimpleNamespace(name="tools", url="http://127.0.0.1:9/mcp")
    t0 = time.monotonic()
    with pytest.raises(hud_env.HudError, match=r"capability 'tools' \(http://127.0.0.1:9/mcp\) did not "
                                               r"open and list its tools within 0.2 s"):
        await hud_env._open_tools(run, cap, 0.2)
    assert time.monotonic() - t0 < 5
