"""The TITO session server is part of the fleet: started by the fleet actor in front of smg with a
per-job token, every turn of a session on one engine, restarted on its own URL after a kill -9,
and a crash loop ends the fleet with one clear error. Real embedded engines, a real smg, a real
session server process, 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import stat
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
import pytest_asyncio

from miles.runtime import Runtime
from miles.engines.fleet import EngineFleet
from miles.config import Recipe, RunConfig
from miles.engines.config import EngineConfig
from miles.rl.config import ModelConfig
from miles.tito.config import SessionConfig
from miles.wire.messages import GetEngines, GetMetrics
from tests.ports import cluster_port

pytestmark = pytest.mark.asyncio(loop_scope="module")
HEALTH_INTERVAL_S = 0.5


async def _fleet(out: Path, model: Path, *, session: SessionConfig | None = None, **engine):
    recipe = Recipe(run=RunConfig(output_dir=str(out)), model=ModelConfig(path=str(model)),
                    session=session or SessionConfig(enabled="on"),
                    engine=EngineConfig(start_timeout_s=120.0, health_interval_s=HEALTH_INTERVAL_S,
                                        **engine))
    fleet = EngineFleet()
    fleet.recipe = recipe
    runtime = Runtime()
    await fleet.start(runtime)
    return fleet, runtime, runtime.ref_at(fleet.server.endpoint, "engines")


async def _until(what: str, predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet2(tmp_path_factory):
    """One fleet of two embedded engines + smg + session server for the tests of this module that
    do not end it (started once: engine starts dominate on a 2-core machine)."""
    from miles.tiny import build_tiny_model
    model = build_tiny_model(arch="qwen3")
    # a policy that ignores the routing key: the fleet must replace it while sessions are on
    fleet, runtime, ref = await _fleet(tmp_path_factory.mktemp("fleet2") / "run", model,
                                       num_engines=2, gateway_policy="round_robin")
    try:
        engines = await ref.call(GetEngines(), timeout_s=180)
        token = Path(engines.session_token_file).read_text().strip()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            yield fleet, ref, engines, token, http
    finally:
        await fleet.close()
        runtime.close()


async def _post(http, url: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def _new_session(http, session_url: str, token: str) -> dict:
    status, body = await _post(http, f"{session_url}/sessions", {}, token)
    assert status == 201, body
    return body


async def _turn(http, session: dict, token: str, messages: list[dict]) -> dict:
    status, body = await _post(http, session["openai_base_url"] + "/chat/completions",
                               {"messages": messages, "max_tokens": 3, "temperature": 1.0}, token)
    assert status == 200, body
    return body["choices"][0]["message"]


async def _requests_served(http, engine_url: str) -> int:
    async with http.get(engine_url + "/metrics") as r:
        text = await r.text()
    return int(float(re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.M).group(1)))


async def test_session_server_needs_the_job_token_and_hides_it(fleet2):
    fleet, ref, engines, token, http = fleet2
    assert engines.session_url and engines.session_url == fleet.session.url
    token_file = Path(engines.session_token_file)
    assert token_file == Path(fleet.recipe.output_dir) / "session.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(token) >= 32

    session = await _new_session(http, engines.session_url, token)
    reply = await _turn(http, session, token, [{"role": "user", "content": "Hello."}])
    assert reply["role"] == "assistant"

    status, body = await _post(http, f"{engines.session_url}/sessions", {}, None)
    assert status == 401, body
    status, body = await _post(http, session["openai_base_url"] + "/chat/completions",
                               {"messages": [{"role": "user", "content": "Hi."}]}, "not-the-token")
    assert status == 401, body
    async with http.get(f"{engines.session_url}/stats") as r:
        assert r.status == 401

    # The token is in its file only: not in any log of the run, not in any process's argv or env.
    leaks = [p for p in Path(fleet.recipe.output_dir).rglob("*")
             if p.is_file() and p != token_file and token.encode() in p.read_bytes()]
    assert leaks == []
    argv_leaks = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if token in " ".join(p.info["cmdline"] or []):
            argv_leaks.append(p.info["pid"])
    assert argv_leaks == []
    server = psutil.Process(fleet.session.process.pid)
    assert "--token-file" in server.cmdline()
    assert all(token not in v for v in server.environ().values())


async def test_every_turn_of_a_session_lands_on_one_engine(fleet2):
    fleet, ref, engines, token, http = fleet2
    assert len(engines.engine_urls) == 2
    assert fleet.gateway.config.policy == "manual"  # round_robin ignores the routing key

    # A new key goes to the less loaded engine, ties at random, so nearly every run also puts
    # sessions on both engines (printed); a policy ignoring the key would split some session.
    sessions = [await _new_session(http, engines.session_url, token) for _ in range(6)]
    histories = [[{"role": "user", "content": f"Task {i}: count."}] for i in range(6)]
    served: dict[str, list[str]] = {s["session_id"]: [] for s in sessions}
    for turn in range(4):
        for session, history in zip(sessions, histories):  # sessions interleave on the gateway
            before = {u: await _requests_served(http, u) for u in engines.engine_urls}
            history.append(await _turn(http, session, token, history))
            history.append({"role": "user", "content": f"Go on ({turn})."})

            async def counted():
                after = {u: await _requests_served(http, u) for u in engines.engine_urls}
                grew = [u for u in after if after[u] > before[u]]
                return grew if sum(after[u] - before[u] for u in after) == 1 else None
            [engine] = await _until("one engine counted the turn", counted, timeout_s=10)
            served[session["session_id"]].append(engine)
    for sid, urls in served.items():
        assert len(urls) == 4 and len(set(urls)) == 1, f"session {sid} moved: {urls}"
    print("engines per session:", {sid[:8]: urls[0] for sid, urls in served.items()})


async def test_fleet_metrics_carry_sessions_and_cache_hits(fleet2):
    fleet, ref, engines, token, http = fleet2
    await _new_session(http, engines.session_url, token)
    async with http.get(f"{engines.session_url}/stats",
                        headers={"Authorization": f"Bearer {token}"}) as r:
        stats = await r.json()
    expected = stats.get("open_sessions", stats.get("sessions"))
    assert expected >= 1

    async def polled():
        m = (await ref.call(GetMetrics(), timeout_s=10)).values
        return m if m.get("session/open_sessions") == expected else None
    metrics = await _until("open sessions in the fleet's metrics", polled, timeout_s=10)
    assert metrics["session/restarts"] == 0.0 and metrics["engine/restarts"] == 0.0

    async with http.get(engines.engine_urls[0] + "/server_info") as r:
        reported = "cache_hit_rate" in (await r.json())["internal_states"][0]
    if reported:  # the embedded engine's prefix cache reports it
        assert 0.0 <= metrics["engine/prefix_cache_hit_rate"] <= 1.0
    else:
        assert "engine/prefix_cache_hit_rate" not in metrics

    t0 = time.perf_counter()
    for _ in range(100):
        fleet.metrics()
    assert (time.perf_counter() - t0) / 100 < 0.005, "metrics() must not wait on HTTP"


async def test_killed_session_server_comes_back_on_its_url(fleet2):
    fleet, ref, engines, token, http = fleet2
    old = await _new_session(http, engines.session_url, token)
    old_pid = fleet.session.process.pid
    t0 = time.monotonic()
    fleet.session.process.kill()  # SIGKILL

    async def back():
        if fleet.session.process.pid == old_pid or not fleet.session.process.alive:
            return False
        try:
            async with http.get(f"{engines.session_url}/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False
    await _until("the session server answering again on its URL", back, timeout_s=90)
    elapsed = time.monotonic() - t0
    print(f"session server back after kill -9 in {elapsed:.2f} s")
    assert elapsed < HEALTH_INTERVAL_S + 60.0

    again = await ref.call(GetEngines(), timeout_s=10)
    assert again.session_url == engines.session_url
    assert again.session_token_file == engines.session_token_file
    assert Path(again.session_token_file).read_text().strip() == token
    fresh = await _new_session(http, again.session_url, token)
    assert (await _turn(http, fresh, token, [{"role": "user", "content": "Again."}]))["role"] == "assistant"
    status, _ = await _post(http, f"{again.session_url}/sessions/{old['session_id']}/samples", {}, token)
    assert status == 404, "a restarted server has lost its open sessions"
    assert fleet.session_restarts == 1
    assert (await ref.call(GetMetrics(), timeout_s=10)).values["session/restarts"] == 1.0


async def test_wedged_session_server_is_restarted_after_its_probes_fail(fleet2):
    fleet, ref, engines, token, http = fleet2
    fleet.session_wedged_s = 2.0  # the default (30 s) outlasts any stall of a healthy server
    restarts, old_pid = fleet.session_restarts, fleet.session.process.pid
    t0 = time.monotonic()
    os.kill(old_pid, signal.SIGSTOP)  # alive, but it answers nothing
    try:
        async def back():
            if fleet.session.process.pid == old_pid or not fleet.session.process.alive:
                return False
            try:
                async with http.get(f"{engines.session_url}/health") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await _until("a restarted session server after the wedge", back, timeout_s=90)
    finally:
        if psutil.pid_exists(old_pid):
            os.kill(old_pid, signal.SIGCONT)
    elapsed = time.monotonic() - t0
    print(f"wedged session server replaced in {elapsed:.2f} s")
    assert elapsed >= fleet.session_wedged_s, "restarted before its probes had failed long enough"
    assert fleet.session_restarts == restarts + 1
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    session = await _new_session(http, engines.session_url, token)
    assert (await _turn(http, session, token, [{"role": "user", "content": "Hi."}]))["role"] == "assistant"


async def test_session_server_crash_loop_ends_the_fleet_with_one_error(tmp_path, capsys):
    from miles.tiny import build_tiny_model
    fleet, runtime, ref = await _fleet(tmp_path / "run", build_tiny_model(arch="qwen3"),
                                       max_restarts=1)
    run = asyncio.ensure_future(fleet.run())
    squatter = socket.socket()
    try:
        engines = await ref.call(GetEngines(), timeout_s=180)
        port = int(engines.session_url.rsplit(":", 1)[1])
        fleet.session.process.kill()
        squatter.bind(("127.0.0.1", port))  # every restart now fails to bind its port
        squatter.listen()
        assert await asyncio.wait_for(run, 90) == 1
        message = str(fleet._fatal.result())
        assert f"the session server could not be restarted on its port {engines.session_url}" in message
        assert "engine.max_restarts = 1" in message
        assert "address already in use" in message.lower(), message  # the server's own words
        errors = [l for l in capsys.readouterr().out.splitlines() if l.startswith("error:")]
        assert len(errors) == 1 and "session server" in errors[0], errors
    finally:
        squatter.close()
        await fleet.close()
        runtime.close()


async def test_session_server_that_cannot_start_fails_the_fleet(tmp_path):
    from miles.tiny import build_tiny_model
    fleet, runtime, ref = await _fleet(tmp_path / "run", build_tiny_model(arch="qwen3"),
                                       session=SessionConfig(enabled="on", family="no_such_family"))
    try:
        result = await asyncio.gather(ref.call(GetEngines(), timeout_s=180), return_exceptions=True)
        message = str(result[0])
        assert "the session server did not start" in message, message
        assert "miles.tito.server" in message and "no_such_family" in message
        assert not fleet.gateway.process.alive and not any(e.process.alive for e in fleet.engines)
    finally:
        await fleet.close()
        runtime.close()


@pytest.mark.slow  # a whole `miles run` (3 steps, no SFT): ~35 s on a 2-core machine
async def test_a_run_with_the_session_server_logs_the_fleet_metrics_per_step(tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    head_port = cluster_port()
    out = tmp_path / "run"
    sets = [f"run.output_dir={json.dumps(str(out))}", "logging.progress=false",
            f"cluster.head_port={head_port}", 'session.enabled="on"', "loop.num_steps=3",
            "loop.eval_every=0", "loop.save_every=0", 'eval.mode="off"', "sft.steps=0",
            'buffer.filter="none"']  # without SFT every reward is 0: nonzero_std would keep none
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_"))}
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "miles.cli", "run",
                           str(root / "recipes" / "quickstart.toml"),
                           *[a for kv in sets for a in ("--set", kv)]],
                          cwd=root, env=env, capture_output=True, timeout=400, start_new_session=True)
    log = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    actors = [r for r in rows if r.get("kind") == "actors"]
    assert actors, log[-3000:]
    last = actors[-1]
    assert last["engine/restarts"] == 0 and last["session/restarts"] == 0
    assert last["session/open_sessions"] == 0  # no agent in this recipe: nothing left open
    assert stat.S_IMODE((out / "session.token").stat().st_mode) == 0o600
    assert (out / "logs" / "session_server.log").exists()
