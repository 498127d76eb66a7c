"""Prometheus /metrics and the dashboard: a scrape parsed by prometheus_client's own parser, `miles
status` of a live run, and the dashboard rendered by a real headless Chromium (live and finished)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles.observe import dashboard_data, make_app
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]
MILES = [sys.executable, "-m", "miles.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def write_run(run: Path, steps: int = 6) -> None:
    (run / "logs").mkdir(parents=True)
    rows = [{"kind": "eval", "step": 0, "time_s": 0.1, "eval/reward": 0.25}]
    for s in range(1, steps + 1):
        rows.append({"kind": "train", "step": s, "time_s": s * 1.0, "rollout/reward": 0.1 * s,
                     "batch/staleness_avg": float(s % 3), "perf/wait_s": 0.2, "perf/train_s": 0.5,
                     "perf/publish_s": 0.05, "weights/stall_s": 0.04, "train/tokens_per_s": 1000.0 + s})
        rows.append({"kind": "actors", "step": s, "buffer/slots_queued": 3.0, "buffer/slots_out": 1.0,
                     "engine/0/requests": 7.0, "engine/1/requests": 2.0, "rollout/samples": 64.0 * s,
                     "engines/gateway_metrics_port": 29999.0, "actor/rollout/calls": 10.0 * s,
                     "actor/rollout/handler_errors": 1.0, "actor/driver/tells": 2.0 * s})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "logs" / "rollout.log").write_text("2026-12-01 10:00:00,000 INFO a: fine\n"
                                              "2026-12-01 10:00:01,000 WARNING a: engine slow\n")


async def test_the_scrape_has_the_run_and_actor_families(tmp_path, aiohttp_client=None):
    from aiohttp.test_utils import TestClient, TestServer
    run = tmp_path / "run"
    write_run(run)
    actors = [{"name": "driver", "node": 0, "up": True, "incarnation": 1, "restarts": 0,
               "loop_lag_ms": 3.0, "heartbeat_age_s": 0.4},
              {"name": "rollout", "node": 0, "up": False, "incarnation": 2, "restarts": 1}]
    async with TestClient(TestServer(make_app(run, actors_fn=lambda: actors))) as client:
        text = await (await client.get("/metrics")).text()
        data = await (await client.get("/api/run")).json()
    fam = families(text)
    up = {s.labels["actor"]: s.value for s in fam["miles_actor_up"].samples}
    assert up == {"driver": 1.0, "rollout": 0.0}
    assert [s.value for s in fam["miles_actor_restarts"].samples if s.name.endswith("_total")] == [0.0, 1.0]
    assert fam["miles_actor_event_loop_lag_seconds"].samples[0].value == pytest.approx(0.003)
    assert fam["miles_train_step"].samples[0].value == 6
    assert fam["miles_weights_stall_seconds"].samples[0].value == 0.04
    assert fam["miles_step_publish_seconds"].samples[0].value == 0.05
    assert fam["miles_trainer_tokens_per_second"].samples[0].value == 1006.0
    assert {s.labels["engine"]: s.value for s in fam["miles_engine_requests"].samples} == {"0": 7.0, "1": 2.0}
    assert {s.labels["state"] for s in fam["miles_buffer_slots"].samples} == {"queued", "out"}
    assert fam["miles_smg_metrics_info"].samples[0].labels["url"] == "http://127.0.0.1:29999/metrics"
    total = lambda family: {s.labels["actor"]: s.value for s in fam[family].samples  # noqa: E731
                            if s.name.endswith("_total")}
    assert total("miles_actor_calls") == {"rollout": 60.0}         # the latest step's counters
    assert total("miles_actor_handler_errors") == {"rollout": 1.0}
    assert total("miles_actor_tells") == {"driver": 12.0}
    assert data["staleness_hist"] == [[0, 2], [1, 2], [2, 2]]
    assert data["step_time"][0] == [1, 0.2, 0.5, 0.05] and data["engine_load"] == [[0, 7.0], [1, 2.0]]
    assert data["errors"] == ["[rollout] 2026-12-01 10:00:01,000 WARNING a: engine slow"]


def test_miles_logs_prints_an_actors_last_lines_and_names_the_actors_with_logs(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    (run / "logs" / "trainer_0.log").write_text("".join(f"line {i}\n" for i in range(30)))
    out = subprocess.run([*MILES, "logs", str(run), "trainer/0", "-n", "3"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "line 27\nline 28\nline 29\n"
    out = subprocess.run([*MILES, "logs", str(run), "rollout"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].endswith("WARNING a: engine slow")
    out = subprocess.run([*MILES, "logs", str(run), "nosuch"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "actors with logs: rollout, trainer_0" in out.stderr, out.stderr


def test_dashboard_data_of_an_empty_run_is_empty():
    assert dashboard_data([]) == {"reward": [], "eval": [], "staleness_hist": [], "step_time": [],
                                  "engine_load": [], "steps": 0}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail("chromium is missing although scripts/setup_system.sh installs it as root "
                        "(see /tmp/miles-apt-chromium.log)")
        pytest.skip("Debian's chromium is not installed and this user cannot install it")
    return path


def render(url: str, out: Path) -> tuple[str, Path]:
    """The DOM after the page's scripts ran, and a screenshot, from a real headless Chromium."""
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={out / 'profile'}", "--virtual-time-budget=6000", "--window-size=1300,900"]
    for attempt in range(3):  # on a loaded 2-core machine headless Chromium now and then dumps nothing
        dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0, dom.stderr[-2000:]
        if "data-rendered" in dom.stdout:
            break
        print(f"chromium attempt {attempt}: no rendered page; stderr: {dom.stderr[-1000:]}")
    shot = out / "dashboard.png"
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    return dom.stdout, shot


def check_page(dom: str, shot: Path, min_steps: int) -> None:
    import re
    rendered = re.search(r'data-rendered="(\d+)"', dom)
    assert rendered and int(rendered.group(1)) >= min_steps, dom[:3000]
    for cls in ("train-curve", "eval-curve", "eval-point", "time-bar", "stale-bar"):
        assert f'class="{cls}"' in dom, cls
    assert re.search(r'<path d="M[\d.]+,[\d.]+ L', dom)          # a curve with at least two points
    import matplotlib.image as mpimg
    import numpy as np
    pixels = mpimg.imread(shot)[..., :3]
    blue = np.all(np.abs(pixels - np.array([0x1f, 0x77, 0xb4]) / 255) < 0.08, axis=-1)
    red = np.all(np.abs(pixels - np.array([0xd6, 0x27, 0x28]) / 255) < 0.08, axis=-1)
    assert blue.sum() > 200 and red.sum() > 50, (blue.sum(), red.sum())   # the curves were drawn


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_live_run_is_scraped_shown_by_status_and_drawn_by_chromium(tmp_path):
    out, head = tmp_path / "obs", cluster_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    metrics_port = free_port()
    proc = subprocess.Popen(
        [*MILES, "run", str(ROOT / "recipes" / "quickstart.toml"), "--set", "loop.num_steps=60",
         "--set", f"run.output_dir={json.dumps(str(out))}", "--set", f"cluster.head_port={head}",
         "--set", f"logging.metrics_port={metrics_port}", "--set", "loop.eval_every=5"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        rows = 0
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists():
                rows = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in line)
                if rows >= 12 and (out / "metrics_url.node0").exists():
                    break
            time.sleep(1)
        assert rows >= 12 and proc.poll() is None, f"the run did not get to step 12 in time (rows {rows})"
        url = (out / "metrics_url.node0").read_text().strip()
        assert url == f"http://127.0.0.1:{metrics_port}/"
        with urllib.request.urlopen(url + "metrics", timeout=10) as r:
            fam = families(r.read().decode())
        actors = {s.labels["actor"] for s in fam["miles_actor_up"].samples if s.value == 1.0}
        assert {"driver", "buffer", "rollout", "engines", "evaluator", "trainer/0"} <= actors, actors
        lags = {s.labels["actor"] for s in fam["miles_actor_event_loop_lag_seconds"].samples}
        assert "driver" in lags and "trainer/0" in lags
        assert fam["miles_train_step"].samples[0].value >= 12
        for name in ("miles_weights_stall_seconds", "miles_trainer_tokens_per_second", "miles_buffer_slots",
                     "miles_engine_requests", "miles_rollout_samples", "miles_smg_metrics_info", "miles_eval_reward"):
            assert fam[name].samples, name
        calls = {s.labels["actor"]: s.value for s in fam["miles_actor_calls"].samples
                 if s.name.endswith("_total")}  # the actors' own message counters
        assert all(calls.get(a, 0) > 0 for a in ("buffer", "rollout", "engines")), calls
        status = subprocess.run([*MILES, "status", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert status.returncode == 0, status.stderr
        table = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:]}
        assert table["trainer/0"][2] == "up" and table["driver"][3] == "0", status.stdout
        dom, shot = render(url, tmp_path)
        check_page(dom, shot, min_steps=12)
        assert "trainer/0" in dom and 'class="up"' in dom                      # actor health
        code = proc.wait(timeout=400)
        assert code == 0, proc.stdout.read().decode()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert not (out / "metrics_url.node0").exists()          # a finished job serves nothing
    port = free_port()
    dash = subprocess.Popen([*MILES, "dashboard", str(out), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/run", timeout=2).read()
                break
            except OSError:
                time.sleep(0.3)
        dom, shot = render(f"http://127.0.0.1:{port}/", tmp_path)
        check_page(dom, shot, min_steps=60)
        assert "finished" in dom
    finally:
        os.killpg(dash.pid, 9)
        dash.wait()


def test_a_taken_default_port_falls_back_to_a_free_one_and_an_asked_for_one_fails():
    """The derived default metrics port (head_port + 1 + rank) may be held by another process: the
    node then serves on a port the system picks (its URL file names it); a port the user asked for
    that is taken is an error, as before."""
    import asyncio

    from miles.observe import serve

    async def main():
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        try:
            with pytest.raises(OSError):
                await serve(make_app(Path(".")), "127.0.0.1", taken)
            runner, port = await serve(make_app(Path(".")), "127.0.0.1", taken, any_port_if_taken=True)
            try:
                assert port != taken and port > 0
                body = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
                assert b"# TYPE" in body or b"# HELP" in body
            finally:
                await runner.cleanup()
        finally:
            holder.close()

    asyncio.run(main())
