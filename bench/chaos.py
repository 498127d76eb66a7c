"""The chaos suite as a table: SIGKILL each actor kind during a real short run, one case at a time.

Prints one JSON line per case:
  {"bench": "chaos", "kind", "completed", "exit_code", "recovery_s", "wall_s", "steps_trained",
   "samples_lost", "trained_twice", "kills", "notes", "machine", ...}
then a summary line {"bench": "chaos", "summary": true, "survived", "cases", ...}.

Each case is `miles run recipes/chaos_cpu.toml` (the CPU quickstart, shortened), its target
SIGKILLed once at a step in the middle (engine_x10: ten times, every other step); the driver case
ends the job by design and is resumed with a second `miles run` on the same output directory.
What is measured and how "0 samples lost" is counted: tests/chaos/chaos_harness.py.

  .venv/bin/python bench/chaos.py [--cases engine,buffer] [--work-dir DIR]
  .venv/bin/python bench/chaos.py --storm --runs R --kills K --seed S [--quick]

`--storm`: R runs, each with K kill events of kinds and at step gaps drawn from the seed (every
kind a run survives without a job restart, each also as a burst that kills it again during its
own restart: `chaos_harness.STORM_TARGETS`; each killed role gets a restart budget above its
deaths; `--quick`: every group kept and a 5-step warm start, as the CI storm runs); one JSON
line per run, then one summary line: runs completed, prompts lost, prompts trained twice, the
longest gap between two steps, and the prompt ledger's verdict per run (`miles ledger`: lost and
trained twice from the run's files alone).
The trainer cases (trainer, trainer_x5) add a `chaos_heal` line: the heal time's median and p90
in its parts (detection, restart, restore, first step).

Cases run one after another, never in parallel: on a small CPU machine parallel runs would
measure each other. The runs' logs stay in the work directory (named in each line's `log`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # tests.ports
sys.path.insert(0, str(ROOT / "tests" / "chaos"))

FIELDS = ("kind", "completed", "exit_code", "recovery_s", "wall_s", "steps_trained", "samples_lost",
          "trained_twice", "kills", "notes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all", help="comma list of engine, gateway, rollout, buffer, "
                    "trainer (healed from memory), trainer_x5 (5 heals: the heal-time line), trainer_no_keeper "
                    "(the fallback to disk), evaluator, driver, engine_x10, mixed (ten kills of five kinds in one run), "
                    "engine_side (engine kills during restarts, two of the fleet actor), "
                    "engine_x5_startup (the engine killed 5 times, 4 during its start-up), "
                    "session_server (default: all)")
    ap.add_argument("--work-dir", default=None, help="keep the runs' output dirs and logs here")
    ap.add_argument("--full", action="store_true", help="every field of each row, log tails included")
    ap.add_argument("--source", default=None,
                    help="run this Miles tree instead of the checkout (e.g. `git archive COMMIT | tar -x -C DIR`)")
    ap.add_argument("--storm", action="store_true", help="seeded random kills (with --runs, --kills, --seed)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kills", type=int, default=4, help="kill events per storm run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="storm: every group kept and a 5-step warm start (the CI storm's settings)")
    args = ap.parse_args()
    if args.source:  # read by the harness at import
        os.environ["MILES_CHAOS_SOURCE"] = str(Path(args.source).resolve())
    from chaos_harness import CASES, row_json, run_case
    if args.storm:
        storm(args)
        return
    names = list(CASES) if args.cases == "all" else [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"--cases {args.cases!r}: unknown {unknown}; expected some of {list(CASES)}")
    machine = {"platform": platform.platform(), "machine": platform.machine(), "cores": os.cpu_count(),
               "source": str(args.source or ROOT)}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="miles_chaos_"))
    rows, t0 = [], time.monotonic()
    for name in names:
        row = run_case(CASES[name], work)
        rows.append(row)
        shown = row if args.full else {k: row.get(k) for k in FIELDS} | {
            k: row[k] for k in ("hung", "failure", "recovery_s_each", "steps_missing", "evals_after_kill",
                                "resumed_from", "log") if row.get(k)}
        print(row_json({"bench": "chaos", **shown, **machine}), flush=True)
    heals = [h for r in rows for h in r.get("heals", [])]
    if heals:  # the trainer's heal time, in its parts (issue 38: median <= 15 s, p90 <= 25 s)
        print(json.dumps({"bench": "chaos_heal", "kills": len(heals), **heal_summary(heals),
                          "ledger": [r["ledger"]["line"] for r in rows if r.get("heals")],
                          "load_1m": round(os.getloadavg()[0], 2), **machine}), flush=True)
    ran = [r for r in rows if CASES[r["kind"]].in_loop]
    survived = [r["kind"] for r in ran if r["completed"] and r["samples_lost"] == 0 and r["trained_twice"] == 0]
    print(json.dumps({"bench": "chaos", "summary": True, "cases": len(ran), "survived": len(survived),
                      "survived_kinds": survived, "failed_kinds": [r["kind"] for r in ran if r["kind"] not in survived],
                      "not_in_loop": [r["kind"] for r in rows if r not in ran],
                      "samples_lost": sum(r["samples_lost"] or 0 for r in ran),
                      "wall_s": round(time.monotonic() - t0, 1), **machine}), flush=True)


def heal_summary(heals: list[dict]) -> dict:
    """Median and p90 (nearest rank) of each part of the heals."""
    import math
    import statistics

    out = {}
    for part in ("total_s", "detect_s", "restart_s", "restore_s", "first_step_s"):
        values = sorted(h[part] for h in heals if h.get(part) is not None)
        if values:
            out[part] = {"median": round(statistics.median(values), 2),
                         "p90": values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)],
                         "each": values}
    return out


def storm(args) -> None:
    from chaos_harness import row_json, run_case, storm_case

    machine = {"platform": platform.platform(), "machine": platform.machine(), "cores": os.cpu_count()}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="miles_storm_"))
    rows, t0 = [], time.monotonic()
    for r in range(args.runs):
        case = storm_case(args.seed, r, args.kills, quick=args.quick)
        row = run_case(case, work)
        rows.append(row)
        per = row.get("samples_per_prompt") or 1
        print(row_json({"bench": "chaos_storm", "run": r, "seed": args.seed, "targets": case.target,
                        **{k: row.get(k) for k in FIELDS + ("killed", "recovery_s_each", "heals",
                                                             "longest_gap_s", "hung", "failure",
                                                             "log", "ledger")},
                        "prompts_lost": None if row["samples_lost"] is None else row["samples_lost"] / per}),
              flush=True)
    unknown = [r for r in rows if r["samples_lost"] is None or r["trained_twice"] is None]
    print(json.dumps({
        "bench": "chaos_storm", "summary": True, "seed": args.seed, "runs": len(rows),
        "kills_per_run": args.kills, "quick": args.quick, "signals_per_run": [r["kills"] for r in rows], "runs_completed": sum(bool(r["completed"]) for r in rows),
        "prompts_lost": None if unknown else sum(r["samples_lost"] / r["samples_per_prompt"] for r in rows),
        "prompts_trained_twice": None if unknown else sum(r["trained_twice"] for r in rows),
        "longest_gap_s": max((r["longest_gap_s"] or 0.0 for r in rows), default=None),
        "ledger_holds": sum(bool(r.get("ledger", {}).get("ok")) for r in rows),
        "ledger_prompts_lost": sum(r.get("ledger", {}).get("lost", 0) for r in rows),
        "ledger_trained_twice": sum(r.get("ledger", {}).get("trained_twice", 0) for r in rows),
        "signals_sent": sum(r["kills"] for r in rows), "wall_s": round(time.monotonic() - t0, 1),
        "load_1m": round(os.getloadavg()[0], 2), **machine}), flush=True)


if __name__ == "__main__":
    main()
