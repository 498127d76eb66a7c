"""`miles dashboard RUN`, `miles status RUN`, `miles logs RUN ACTOR`, `miles episodes RUN`: looking
at a job from outside.

    miles dashboard runs/quickstart [--port 8265]   the dashboard of a run, live or finished, from its files
    miles status runs/quickstart                    actors, nodes, incarnations, restarts, loop lag (live run)
    miles logs runs/quickstart trainer/0 [-n 50] [-f]
    miles episodes runs/quickstart [--step N] [--reward R] [--task ID] [-n K] [--json]

Design decisions:
- A run directory is the handle: everything is found from it. A live job's head writes its
  dashboard URL to `<run>/metrics_url.node0`; `status` asks that endpoint (`/api/actors`), so it
  needs no ZeroMQ keys and works from any machine that reaches the head over HTTP.
- `dashboard` serves the same page as the live head, from `metrics.jsonl` and `logs/`, so a
  finished (or copied) run looks the same as a live one; actors are then listed from their logs.
- `logs` reads `<run>/logs/<actor>.log` (`/` in a name is `_` in the file, as the daemon writes it).
- `episodes` reads `<run>/episodes.jsonl` (`miles.episodes`), the same files and filters as
  the dashboard's episode browser (`/episodes`); bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

from miles.episodes import EpisodeFile, FILE, ROTATED, format_episode, parse_reward, select, to_json


def _run_dir(path: str) -> Path:
    run = Path(path)
    if not (run / "metrics.jsonl").exists() and not (run / "logs").is_dir():
        raise SystemExit(f"miles: {path}: not a run directory (no metrics.jsonl, no logs/)")
    return run


def live_url(run: Path) -> str | None:
    marker = run / "metrics_url.node0"
    return marker.read_text().strip() if marker.exists() else None


def _logged_actors(run: Path) -> list[dict]:
    return [{"name": p.stem.replace("_", "/", 1) if p.stem.startswith(("trainer_", "node_")) else p.stem,
             "up": False, "state": "finished"} for p in sorted((run / "logs").glob("*.log"))]


def dashboard(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="miles dashboard")
    p.add_argument("run")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8265)
    args = p.parse_args(argv)
    run = _run_dir(args.run)
    from miles.observe import make_app, serve

    async def main() -> None:
        app = make_app(run, actors_fn=lambda: _logged_actors(run))
        runner, _ = await serve(app, args.host, args.port)
        print(f"dashboard of {run} at http://{args.host}:{args.port}/ (Ctrl-C stops it)", flush=True)
        if url := live_url(run):
            print(f"the job's head serves it live at {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="miles status")
    p.add_argument("run")
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    run = _run_dir(args.run)
    if (run / "buffer" / "ledger.bin").exists():  # the prompts' fates, live or ended
        from miles.actors.ledger import check_run
        print(check_run(run).line())
    url = live_url(run)
    if url is None:
        print(f"miles: {run}: no live job (no metrics_url.node0; logging.metrics_port = -1?)", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/actors", timeout=args.timeout) as r:
            actors = json.loads(r.read())
    except OSError as e:
        print(f"miles: {run}: the head at {url} did not answer within {args.timeout}s ({e}); "
              f"the job has probably ended", file=sys.stderr)
        return 1
    print(f"{'actor':<16} {'node':>4} {'state':<8} {'incarnation':>11} {'restarts':>8} {'loop lag':>9} {'heartbeat':>9}")
    for a in actors:
        lag = f"{a['loop_lag_ms']:.1f}ms" if "loop_lag_ms" in a else "-"
        beat = f"{a['heartbeat_age_s']:.1f}s" if "heartbeat_age_s" in a else "-"
        print(f"{a['name']:<16} {a.get('node', '-'):>4} {a.get('state', 'up' if a.get('up') else 'down'):<8} "
              f"{a.get('incarnation', '-'):>11} {a.get('restarts', '-'):>8} {lag:>9} {beat:>9}")
    return 0


def logs(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="miles logs")
    p.add_argument("run")
    p.add_argument("actor", help="an actor name: driver, rollout, trainer/0, engines, ...")
    p.add_argument("-n", type=int, default=50, help="last N lines (default 50)")
    p.add_argument("-f", "--follow", action="store_true")
    args = p.parse_args(argv)
    run = _run_dir(args.run)
    path = run / "logs" / f"{args.actor.replace('/', '_')}.log"
    if not path.exists():
        names = sorted(q.stem for q in (run / "logs").glob("*.log"))
        print(f"miles: {args.actor}: no log {path}; actors with logs: {', '.join(names)}", file=sys.stderr)
        return 1
    with open(path, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
        sys.stdout.write("".join(line + "\n" for line in lines[-args.n:]))
        sys.stdout.flush()
        try:
            while args.follow:
                chunk = f.read()
                if chunk:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def episodes(argv: list[str]) -> int:
    """Transcripts of a run's episodes (`miles.episodes`), newest last; exit 2 on bad input."""
    from miles.observe import read_rows

    p = argparse.ArgumentParser(prog="miles episodes")
    p.add_argument("run")
    p.add_argument("--step", help="the step that trained them (or, untrained, that their policy "
                                  "version was about to train)")
    p.add_argument("--reward", help="the reward: 0, '>0', '<=0.5', ...")
    p.add_argument("--task", help="a task id, or part of one")
    p.add_argument("-n", default="10", help="the newest N that match (default 10; 0: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per episode")
    args = p.parse_args(argv)
    run = Path(args.run)
    try:
        step = None if args.step is None else int(args.step)
        if step is not None and step < 0:
            raise ValueError
    except ValueError:
        return _bad(f"--step {args.step!r}: expected a step number >= 0")
    try:
        n = int(args.n)
        if n < 0:
            raise ValueError
    except ValueError:
        return _bad(f"-n {args.n!r}: expected a count >= 0 (0: all)")
    try:
        reward = None if args.reward is None else parse_reward(args.reward)
    except ValueError as e:
        return _bad(f"--{e}")
    if not run.is_dir():
        return _bad(f"{args.run}: no such run directory")
    if not (run / FILE).exists() and not (run / ROTATED).exists():
        return _bad(f"{args.run}: no {FILE} (not a run directory, or logging.episodes = false)")
    index = EpisodeFile(run).refresh()
    for warning in index.warnings + [w for w in [index.torn_tail()] if w]:
        print(f"miles: warning: {warning}", file=sys.stderr)
    hits, total = select(index, read_rows(run / "metrics.jsonl"), step=step, reward=reward,
                         task=args.task, n=n)
    for summary, name, offset, info in hits:
        rec = index.full(name, offset)
        if args.json:
            print(json.dumps(to_json(rec, info)))
        else:
            print(format_episode(rec, info))
    if not hits:
        print(f"miles: no episode of {total} in {run} matches", file=sys.stderr)
        return 1
    if not args.json:
        print(f"({len(hits)} shown of {total} episodes)")
    return 0


def _bad(message: str) -> int:
    print(f"miles episodes: {message}", file=sys.stderr)
    return 2


def ledger(argv: list[str]) -> int:
    """`miles ledger RUN`: the exactly-once invariant over the run's prompt ledger, from its files
    alone (miles/actors/ledger.py); exit code 1 when it does not hold."""
    p = argparse.ArgumentParser(prog="miles ledger")
    p.add_argument("run")
    p.add_argument("--json", action="store_true", help="the whole report as one JSON line")
    args = p.parse_args(argv)
    from miles.actors.ledger import check_run

    report = check_run(Path(args.run))
    if args.json:
        import msgspec
        print(msgspec.json.encode({**msgspec.structs.asdict(report), "ok": report.ok}).decode())
    else:
        print(report.line())
        for problem in report.problems:
            print(f"  {problem}")
    return 0 if report.ok else 1


COMMANDS = {"dashboard": dashboard, "status": status, "logs": logs, "episodes": episodes,
            "ledger": ledger}
