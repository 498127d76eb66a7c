"""What a running (or finished) job shows over HTTP: Prometheus `/metrics` on every node daemon,
and on the head the dashboard (`/`) with its data (`/api/run`, `/api/actors`).

    http://<node>:<port>/metrics      Prometheus text format (prometheus_client)
    http://<head>:<port>/             the dashboard (miles/dashboard.html)
    http://<head>:<port>/episodes     the episode browser (miles/episodes.html; `miles.episodes`)
    miles dashboard runs/<name>       the same dashboard for a finished run, from its files

Design decisions:
- One small aiohttp app on the daemon's own event loop; the port is `logging.metrics_port`
  (0: `cluster.head_port + 1 + node rank`, so nodes sharing a host do not collide, or a free port
  when that one is taken; -1: off). The URL is written to `<run>/metrics_url.node<rank>`.
- Metrics come from what the daemon already has, read when scraped: its children (up,
  incarnation, restarts), the registry's heartbeats on the head (age, event-loop lag), and the
  run's `metrics.jsonl` (the latest train / eval / actors rows: buffer state, engine load,
  weight-sync stall time, trainer throughput, staleness). Nothing is pushed, nothing is kept twice.
- Names follow Prometheus conventions: `miles_` prefix, base units (seconds, bytes), `_total`
  for counters, labels for actor / node / engine / state. A run-level number from the JSONL is a
  gauge of its latest value (`miles_rollout_reward`); the JSONL stays the record of the run.
- smg serves its own Prometheus endpoint; `miles_smg_metrics_info{url=...}` links it.
- The episode browser reads `<run>/episodes.jsonl` through one incremental reader per app (only
  appended bytes are decoded per request, on a thread, off the daemon's loop); its filters are
  the ones `miles episodes` applies (`miles.episodes.select`). The list carries no messages;
  `/api/episode?key=...` reads one record whole.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from miles.episodes import EpisodeFile, annotate, key_of, parse_reward, select, to_json

DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
EPISODES_HTML = Path(__file__).with_name("episodes.html")
EPISODES_LISTED = 200   # the newest matching episodes the browser lists

# JSONL key -> (metric name, help); every one is a gauge of the latest value
RUN_GAUGES = {
    "rollout/reward": ("miles_rollout_reward", "Mean reward of the latest trained batch"),
    "batch/staleness_avg": ("miles_batch_staleness", "Mean staleness (versions) of the latest batch"),
    "train/tokens_per_s": ("miles_trainer_tokens_per_second", "Trainer throughput in the latest step"),
    "train/grad_norm": ("miles_trainer_grad_norm", "Gradient norm of the latest step"),
    "perf/step_s": ("miles_step_train_publish_seconds", "Train + publish time of the latest step"),
    "perf/wait_s": ("miles_step_wait_seconds", "Time the driver waited for the latest batch"),
    "perf/publish_s": ("miles_step_publish_seconds", "The driver's publish call in the latest step"),
    "weights/stall_s": ("miles_weights_stall_seconds", "Engines paused for the latest publish (pause, transfer, load, version, resume)"),
    "weights/transfer_s": ("miles_weights_transfer_stall_seconds", "Transfer time the engines were paused for"),
    "weights/changed_frac": ("miles_weights_changed_ratio", "Fraction of weights a disk-delta publish changed"),
    "buffer/queue_groups": ("miles_buffer_queued_groups", "Groups queued in the buffer"),
    "rollout/inflight": ("miles_rollout_inflight_samples", "Samples being generated"),
    "engines/alive": ("miles_engines_alive", "Engines serving"),
    "engines/pending": ("miles_engines_pending", "Restarted engines waiting for weights"),
    "engine/prefix_cache_hit_rate": ("miles_engine_prefix_cache_hit_ratio", "Prefix-cache hit rate"),
    "session/open_sessions": ("miles_session_open", "Open TITO sessions"),
}
COUNTERS = {
    "rollout/samples": ("miles_rollout_samples", "Samples generated"),
    "rollout/tokens_generated": ("miles_rollout_tokens_generated", "Tokens generated"),
    "rollout/requests_retried": ("miles_rollout_requests_retried", "Engine requests retried"),
    "engines/restarts": ("miles_engine_restarts", "Engine restarts"),
    "buffer/dropped": ("miles_buffer_groups_dropped", "Groups dropped"),
    "buffer/trained": ("miles_buffer_groups_trained", "Groups trained"),
}
SLOT = re.compile(r"^buffer/slots_(\w+)$")
ACTOR_COUNTER = re.compile(r"^actor/(.+)/(calls|tells|handler_errors|cancelled)$")  # miles.loop.actor_counters
ACTOR_COUNTER_DOCS = {"calls": "Calls the actor handled", "tells": "Tells (one-way messages) the actor handled",
                      "handler_errors": "Messages whose handler raised", "cancelled": "Handlers cancelled"}
ENGINE = re.compile(r"^engine/(\d+)/requests$")


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl as rows; a line being written is skipped."""
    rows = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def latest(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in rows:
        out.setdefault(row.get("kind", ""), {}).update(row)
    return out


def collector(rows_fn: Callable[[], list[dict]], actors_fn: Callable[[], list[dict]], node_rank: int):
    """A prometheus_client Collector over the daemon's live state, read at scrape time."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    class MilesCollector:
        def collect(self):
            node = str(node_rank)
            up = GaugeMetricFamily("miles_actor_up", "1 while the actor's process runs", labels=["actor", "node"])
            inc = GaugeMetricFamily("miles_actor_incarnation", "Current incarnation", labels=["actor", "node"])
            restarts = CounterMetricFamily("miles_actor_restarts", "Restarts of the actor", labels=["actor", "node"])
            lag = GaugeMetricFamily("miles_actor_event_loop_lag_seconds", "Event-loop lag in the last heartbeat",
                                    labels=["actor", "node"])
            beat = GaugeMetricFamily("miles_actor_heartbeat_age_seconds", "Seconds since the last heartbeat",
                                     labels=["actor", "node"])
            for a in actors_fn():
                labels = [a["name"], str(a.get("node", node))]
                up.add_metric(labels, 1.0 if a.get("up") else 0.0)
                inc.add_metric(labels, float(a.get("incarnation", 0)))
                restarts.add_metric(labels, float(a.get("restarts", 0)))
                if "loop_lag_ms" in a:
                    lag.add_metric(labels, a["loop_lag_ms"] / 1000.0)
                if "heartbeat_age_s" in a:
                    beat.add_metric(labels, a["heartbeat_age_s"])
            yield from (up, inc, restarts, lag, beat)
            rows = rows_fn()
            if not rows:
                return
            last = latest(rows)
            merged = {**last.get("actors", {}), **last.get("train", {})}
            step = GaugeMetricFamily("miles_train_step", "Steps trained")
            step.add_metric([], float(last.get("train", {}).get("step", 0)))
            yield step
            if "eval" in last and "eval/reward" in last["eval"]:
                ev = GaugeMetricFamily("miles_eval_reward", "Held-out reward of the latest evaluation")
                ev.add_metric([], float(last["eval"]["eval/reward"]))
                yield ev
            for key, (name, doc) in RUN_GAUGES.items():
                if isinstance(merged.get(key), (int, float)):
                    g = GaugeMetricFamily(name, doc)
                    g.add_metric([], float(merged[key]))
                    yield g
            for key, (name, doc) in COUNTERS.items():
                if isinstance(merged.get(key), (int, float)):
                    c = CounterMetricFamily(name, doc)
                    c.add_metric([], float(merged[key]))
                    yield c
            slots = GaugeMetricFamily("miles_buffer_slots", "Buffer slots by state", labels=["state"])
            load = GaugeMetricFamily("miles_engine_requests", "Requests running or waiting on an engine",
                                     labels=["engine"])
            counters = {k: CounterMetricFamily(f"miles_actor_{k}", doc, labels=["actor"])
                        for k, doc in ACTOR_COUNTER_DOCS.items()}
            for key, value in merged.items():
                if not isinstance(value, (int, float)):
                    continue
                if m := SLOT.match(key):
                    slots.add_metric([m.group(1)], float(value))
                elif m := ENGINE.match(key):
                    load.add_metric([m.group(1)], float(value))
                elif m := ACTOR_COUNTER.match(key):
                    counters[m.group(2)].add_metric([m.group(1)], float(value))
            yield from (slots, load, *counters.values())
            port = merged.get("engines/gateway_metrics_port")
            if port:
                info = InfoMetricFamily("miles_smg_metrics", "Where the smg gateway serves its own metrics")
                info.add_metric([], {"url": f"http://127.0.0.1:{int(port)}/metrics"})
                yield info

    return MilesCollector()


def dashboard_data(rows: list[dict]) -> dict[str, Any]:
    """What the dashboard draws, from the JSONL rows (the page does no arithmetic of its own)."""
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and "eval/reward" in r]
    actors = latest(rows).get("actors", {})
    stale = Counter(round(r.get("batch/staleness_avg", 0.0)) for r in train)
    engines = {m.group(1): v for k, v in actors.items() if (m := ENGINE.match(k))}
    return {
        "reward": [[r["step"], r.get("rollout/reward")] for r in train if "rollout/reward" in r],
        "eval": [[r["step"], r["eval/reward"]] for r in evals],
        "staleness_hist": sorted([int(k), v] for k, v in stale.items()),
        "step_time": [[r["step"], r.get("perf/wait_s", 0.0), r.get("perf/train_s", 0.0),
                       r.get("perf/publish_s", 0.0)] for r in train],
        "engine_load": sorted([int(k), v] for k, v in engines.items()),
        "steps": train[-1]["step"] if train else 0,
    }


def recent_errors(log_dir: Path, limit: int = 20) -> list[str]:
    """The last WARNING / ERROR / Traceback lines of every actor log, newest last."""
    found: list[tuple[float, str]] = []
    for path in sorted(log_dir.glob("*.log")):
        try:
            lines = path.read_text(errors="replace").splitlines()[-2000:]
        except OSError:
            continue
        mtime = path.stat().st_mtime
        for line in lines:
            if " WARNING " in line or " ERROR " in line or line.startswith(("Traceback", "ERROR")):
                found.append((mtime, f"[{path.stem}] {line[:300]}"))
    return [line for _, line in found[-limit:]]


def make_app(run_dir: Path, *, actors_fn: Callable[[], list[dict]] = lambda: [], node_rank: int = 0,
             dashboard: bool = True) -> web.Application:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    metrics_path = run_dir / "metrics.jsonl"
    registry = CollectorRegistry()
    registry.register(collector(lambda: read_rows(metrics_path), actors_fn, node_rank))

    async def metrics(_request):
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def page(_request):
        return web.Response(text=DASHBOARD_HTML.read_text(), content_type="text/html")

    async def api_run(_request):
        data = dashboard_data(read_rows(metrics_path))
        data.update(run=run_dir.name, errors=recent_errors(run_dir / "logs"), time=time.time())
        return web.json_response(data)

    async def api_actors(_request):
        return web.json_response(actors_fn())

    episodes_index = EpisodeFile(run_dir)

    async def episodes_page(_request):
        return web.Response(text=EPISODES_HTML.read_text(), content_type="text/html")

    def list_episodes(step, reward, task) -> dict[str, Any]:
        episodes_index.refresh()
        hits, total = select(episodes_index, read_rows(metrics_path), step=step, reward=reward,
                             task=task, n=EPISODES_LISTED)
        return {"run": run_dir.name, "total": total, "warnings": episodes_index.warnings[-5:],
                "episodes": [to_json(s, info) for s, _, _, info in reversed(hits)]}

    async def api_episodes(request):
        q = request.query
        try:   # a bad filter is one line naming it (the page shows it)
            step = int(q["step"]) if q.get("step", "") != "" else None
        except ValueError:
            return web.json_response({"error": f"step {q['step']!r}: expected a step number"},
                                     status=400)
        try:
            reward = parse_reward(q["reward"]) if q.get("reward", "") != "" else None
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        data = await asyncio.to_thread(list_episodes, step, reward, q.get("task") or None)
        return web.json_response(data)

    def one_episode(key: str) -> dict[str, Any] | None:
        episodes_index.refresh()
        rows = [r for r in episodes_index.rows if key_of(r[0]) == key]
        if not rows:
            return None
        info = annotate([r[0] for r in episodes_index.rows], read_rows(metrics_path))
        i = episodes_index.rows.index(rows[-1])
        return to_json(episodes_index.full(rows[-1][1], rows[-1][2]), info[i], key)

    async def api_episode(request):
        key = request.query.get("key", "")
        data = await asyncio.to_thread(one_episode, key)
        if data is None:
            return web.json_response({"error": f"key {key!r}: no such episode"}, status=404)
        return web.json_response(data)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if dashboard:
        app.router.add_get("/", page)
        app.router.add_get("/api/run", api_run)
        app.router.add_get("/api/actors", api_actors)
        app.router.add_get("/episodes", episodes_page)
        app.router.add_get("/api/episodes", api_episodes)
        app.router.add_get("/api/episode", api_episode)
    return app


async def serve(app: web.Application, host: str, port: int, *,
                any_port_if_taken: bool = False) -> tuple[web.AppRunner, int]:
    """(The running app, the port it listens on). `any_port_if_taken`: when `port` is in use, a
    free port the system picks (for a derived default port; an asked-for one fails instead)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        if not any_port_if_taken:
            await runner.cleanup()
            raise
        await web.TCPSite(runner, host, 0).start()
    return runner, int(runner.addresses[-1][1])
