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
                    "trainer, evaluator, driver, engine_x10, mixed (ten kills of five kinds in one run), "
                    "session_server (default: all)")
    ap.add_argument("--work-dir", default=None, help="keep the runs' output dirs and logs here")
    ap.add_argument("--full", action="store_true", help="every field of each row, log tails included")
    ap.add_argument("--source", default=None,
                    help="run this Miles tree instead of the checkout (e.g. `git archive COMMIT | tar -x -C DIR`)")
    args = ap.parse_args()
    if args.source:  # read by the harness at import
        os.environ["MILES_CHAOS_SOURCE"] = str(Path(args.source).resolve())
    from chaos_harness import CASES, row_json, run_case
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
    ran = [r for r in rows if CASES[r["kind"]].in_loop]
    survived = [r["kind"] for r in ran if r["completed"] and r["samples_lost"] == 0 and r["trained_twice"] == 0]
    print(json.dumps({"bench": "chaos", "summary": True, "cases": len(ran), "survived": len(survived),
                      "survived_kinds": survived, "failed_kinds": [r["kind"] for r in ran if r["kind"] not in survived],
                      "not_in_loop": [r["kind"] for r in rows if r not in ran],
                      "samples_lost": sum(r["samples_lost"] or 0 for r in ran),
                      "wall_s": round(time.monotonic() - t0, 1), **machine}), flush=True)


if __name__ == "__main__":
    main()
