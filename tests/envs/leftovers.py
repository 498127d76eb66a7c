"""What a finished `miles run` may leave behind, for the environment tests' "nothing is left" checks:
its processes (servers included), its sandboxes, and what its rollout log says of its sessions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil


def run_processes(out: Path) -> list[str]:
    """Live processes of the run in `out`: an actor knows its run by MILES_RECIPE (a file under the
    output directory), and every server it starts (engine, session server, environment servers)
    inherits it."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("MILES_RECIPE", "").startswith(str(out)) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
        except psutil.Error:
            continue
    return found


def run_sandboxes(run_name: str) -> list[str]:
    """Ids of the subprocess backend's sandboxes labelled with the run: listed, not swept, so a
    leak fails the test instead of being cleaned up by it."""
    from miles.sandboxes import get_backend
    from miles.sandboxes.pool import RUN_LABEL
    backend = get_backend("subprocess")
    try:
        return [r.id for r in backend.records() if r.labels.get(RUN_LABEL) == run_name]
    finally:
        backend.spawner.close()


def settled_lines(out: Path) -> list[str]:
    """The rollout log's account of what the episodes left open when they were stopped, one line
    per actor role: `[role] episodes settled: sessions of this run open: N[; sandboxes live: M]`."""
    return [line for line in (out / "logs" / "rollout.log").read_text().splitlines()
            if "episodes settled:" in line]


SETTLED_CLEAN = re.compile(r"episodes settled: sessions of this run open: 0(; sandboxes live: 0)?$")


def left_behind(out: Path) -> list[str]:
    """What the finished run in `out` left behind, one line each; [] when nothing: every settled
    line says no session (and, where the run had a sandbox pool, no sandbox) was open, no sandbox
    labelled with the run exists, and no process of the run lives."""
    settled = settled_lines(out)
    found = [] if settled else ["rollout.log: no 'episodes settled' line"]
    found += [f"rollout.log: {line}" for line in settled if not SETTLED_CLEAN.search(line)]
    name = json.loads(next(out.glob("recipe.resolved*.json")).read_text())["run"]["name"]
    found += [f"sandbox {sid} of run {name}" for sid in run_sandboxes(name)]
    found += [f"process {p}" for p in run_processes(out)]
    return found
