"""The smg gateway launcher against in-process fake engines: command line, registration,
affinity, runtime add/remove, DP-aware routing, RL fan-out, clean stop. Real smg processes."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import psutil
import pytest

from miles.engines.gateway import (ROUTED_WORKER_HEADER, ROUTING_KEY_HEADER, Gateway,
                                   GatewayConfig, GatewayError, build_command, launch_gateway)
from miles.engines.procs import ServerStartError


def _config(free_port, **kw) -> GatewayConfig:
    return GatewayConfig(port=free_port(), prometheus_port=free_port(), **kw)


async def _generate(session, gateway, key=None, **body):
    headers = {ROUTING_KEY_HEADER: key} if key else {}
    payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, **body}
    async with session.post(gateway.url + "/generate", json=payload, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers[ROUTED_WORKER_HEADER], await resp.json()


def test_command_line_sets_loopback_metrics_affinity_and_no_retries():
    cfg = GatewayConfig(port=4000, prometheus_port=4001, dp_aware=True,
                        extra_args={"max_idle_secs": 600, "enable_trace": True, "cors": False})
    cmd = build_command(cfg, ["http://127.0.0.1:5000", "http://127.0.0.1:5001"])
    assert cmd[1:4] == ["-m", "smg", "launch"]
    flags = " ".join(cmd[4:])
    for expected in ["--host 127.0.0.1 --port 4000", "--policy manual",
                     "--assignment-mode min_load",
                     "--prometheus-host 127.0.0.1 --prometheus-port 4001",
                     "--shutdown-grace-period-secs 2", "--health-check-endpoint /model_info",
                     "--worker-urls http://127.0.0.1:5000 http://127.0.0.1:5001",
                     "--dp-aware", "--enable-rl", "--disable-retries",
                     "--disable-worker-overload-protection", "--max-idle-secs 600",
                     "--enable-trace"]:
        assert expected in flags
    assert "--cors" not in flags
    assert "--retry-max-retries 3" in " ".join(
        build_command(GatewayConfig(port=1, prometheus_port=2, max_retries=3)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="sticky"), "gateway.policy: expected one of"),
    (dict(assignment_mode="least"), "gateway.assignment_mode"),
    (dict(prometheus_port=4000), "gateway.prometheus_port: must differ"),
    (dict(extra_args={"port": 1}), "gateway.smg.port: Miles sets this flag itself"),
    (dict(extra_args={"prometheus_port": 1}), "use the field 'prometheus_port'"),
    (dict(extra_args={"Bad Flag": 1}), "gateway.smg.Bad Flag: not a flag name"),
])
def test_config_errors_name_the_field(kwargs, message):
    base = dict(port=4000, prometheus_port=4001)
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**{**base, **kwargs})


async def test_routes_with_affinity_and_forwards_rl_fields(fake_engine, free_port):
    a, b = await fake_engine("A"), await fake_engine("B")
    a.generate_delay_s = b.generate_delay_s = 1.0  # all eight are in flight together
    gateway = await launch_gateway(_config(free_port), [a.url, b.url], timeout_s=30)
    try:
        assert {w["url"] for w in await gateway.workers()} == {a.url, b.url}
        async with aiohttp.ClientSession() as session:
            # Eight new keys at once: min_load assignment spreads them over both engines.
            first = await asyncio.gather(*[_generate(session, gateway, f"s{i}")
                                           for i in range(8)])
            owners = {f"s{i}": url for i, (url, _) in enumerate(first)}
            assert sum(url == a.url for url in owners.values()) >= 3
            assert sum(url == b.url for url in owners.values()) >= 3
            # Later turns of each session land on the engine that served the first turn.
            for turn in range(2):
                again = await asyncio.gather(*[_generate(session, gateway, key)
                                               for key in owners])
                assert [url for url, _ in again] == list(owners.values()), f"turn {turn}"
            # smg forwards the fields R3 and the session cache rely on, unchanged.
            await _generate(session, gateway, "s0", rid="r-1", return_logprob=True,
                            return_routed_experts=True, routed_experts_start_len=2,
                            session_id="s0")
        owner = a if owners["s0"] == a.url else b
        body = owner.calls("/generate")[-1]
        assert body["input_ids"] == [1, 2, 3] and body["rid"] == "r-1"
        assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 2
        assert body["session_id"] == "s0" and body["return_logprob"] is True
    finally:
        gateway.stop()


async def test_add_and_remove_workers_at_runtime(fake_engine, free_port):
    a, b = await fake_engine("A"), await fake_engine("B")
    gateway = await launch_gateway(_config(free_port), [a.url], timeout_s=30)
    try:
        await gateway.add_worker(b.url + "/")
        assert gateway.engine_urls == [a.url, b.url]
        assert {w["url"] for w in await gateway.workers()} == {a.url, b.url}
        async with aiohttp.ClientSession() as session:
            routed = {(await _generate(session, gateway, f"k{i}"))[0] for i in range(12)}
            assert routed == {a.url, b.url}
            await gateway.remove_worker(a.url)
            assert gateway.engine_urls == [b.url]
            # Keys that were pinned to the removed engine move to the remaining one.
            routed = {(await _generate(session, gateway, f"k{i}"))[0] for i in range(12)}
            assert routed == {b.url}
        with pytest.raises(GatewayError, match="is not registered"):
            await gateway.remove_worker("http://127.0.0.1:9")
    finally:
        gateway.stop()


async def test_dp_aware_registers_each_rank_and_injects_it(fake_engine, free_port):
    a = await fake_engine("A", dp_size=2)
    gateway = await launch_gateway(_config(free_port, dp_aware=True), [a.url], timeout_s=30)
    try:
        assert sorted(w["url"] for w in await gateway.workers()) == [a.url + "@0", a.url + "@1"]
        async with aiohttp.ClientSession() as session:
            # New keys go to the least-loaded worker; one at a time, the two ranks tie and smg
            # picks one at random: 24 keys reach both (8 all landed on one rank, p = 1/128).
            for i in range(24):
                await _generate(session, gateway, f"k{i}")
        assert {body["data_parallel_rank"] for body in a.calls("/generate")} == {0, 1}
        await gateway.remove_worker(a.url)  # removes both virtual workers
        assert all(w["status"] == "draining" for w in await gateway.workers())
    finally:
        gateway.stop()


async def test_fanout_reaches_each_engine_once(fake_engine, free_port):
    a, b = await fake_engine("A", dp_size=2), await fake_engine("B")
    gateway = await launch_gateway(_config(free_port, dp_aware=True), [a.url, b.url],
                                   timeout_s=30)
    try:
        result = await gateway.fanout("pause_generation", {"mode": "in_place"})
        assert result["total"] == 2 and result["succeeded"] == 2 and not result["failed"]
        await gateway.fanout("/continue_generation")
        for engine in (a, b):
            assert engine.calls("/pause_generation") == [{"mode": "in_place"}]
            assert engine.calls("/continue_generation") == [{}]
        # One engine failing a control call is an error, unless the caller accepts partial.
        b.failing_paths.add("/update_weights_from_disk")
        body = {"model_path": "/ckpt/3", "weight_version": "3"}
        with pytest.raises(GatewayError, match=rf"1 of 2 engines failed: {b.url}: .*HTTP 500"):
            await gateway.fanout("update_weights_from_disk", body)
        partial = await gateway.fanout("update_weights_from_disk", body, allow_partial=True)
        assert partial["succeeded"] == 1 and len(partial["failed"]) == 1
    finally:
        gateway.stop()


async def test_stop_leaves_no_process_and_frees_both_ports(fake_engine, free_port):
    a = await fake_engine("A")
    cfg = _config(free_port)
    gateway = await launch_gateway(cfg, [a.url], timeout_s=30)
    pid = gateway.process.pid
    await gateway.stop_async()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    for port in (cfg.port, cfg.prometheus_port):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # The same ports again, at once: no grace-period process is holding them.
    again = await launch_gateway(cfg, [a.url], timeout_s=30)
    again.stop()


async def test_startup_failure_reports_log_tail_and_cleans_up(free_port):
    # A passthrough flag this smg does not know: smg's argparse refuses it and exits.
    cfg = _config(free_port, extra_args={"no_such_flag": 1})
    started = time.monotonic()
    with pytest.raises(ServerStartError,
                       match="(?s)exited with code 2.*last lines.*unrecognized arguments"):
        await launch_gateway(cfg, [], timeout_s=30)
    assert time.monotonic() - started < 10, "a dead gateway must fail fast, not at the timeout"


async def test_unreachable_worker_times_out_with_its_url(free_port):
    dead = f"http://127.0.0.1:{free_port()}"
    gateway = Gateway(_config(free_port), [dead]).start()
    try:
        with pytest.raises(ServerStartError, match=f"workers not in the expected state.*{dead}"):
            await gateway.wait_ready(timeout_s=1.5)
    finally:
        gateway.stop()
