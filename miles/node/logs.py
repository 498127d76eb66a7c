"""The daemon's console and its children's logs: every child writes to
`<output_dir>/logs/<actor name>.log`, which the daemon follows onto its console with a `[name] `
prefix (the head's through the run's progress view, `miles.console`); the lines of a log that say
why a child failed; where a stopped run can go on from."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from miles.config import Recipe
from miles.console import RunProgress

if TYPE_CHECKING:  # cluster's messages name where a run stopped (below): no import at run time
    from miles.node.cluster import NodeEnv

LOG_TAIL_LINES = 20         # of a failing child's log, in the daemon's messages


class Logs:
    """The daemon's part that follows its children's logs and writes its own lines."""

    name: str
    recipe: Recipe
    node: NodeEnv
    children: list

    def _progress(self):
        """The head's console view of an RL run (miles.console); None on other nodes and for
        recipes without the loop driver."""
        driver = self.recipe.actors.get("driver")
        if self.node.node_rank != 0 or driver is None or not driver.cls.endswith(":LoopDriver"):
            return None
        lg = self.recipe.logging
        return RunProgress(Path(self.recipe.output_dir) / "metrics.jsonl", self.recipe.loop.num_steps,
                           every=lg.console_every, bar=None if lg.progress else False)

    @staticmethod
    def _write_console(data: bytes) -> None:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except (OSError, ValueError):  # the console is gone; the log files still have it all
            pass

    def _pump_logs(self, final: bool = False) -> None:
        for child in self.children:
            if child.follower is not None:
                child.follower.pump(flush_partial=final)
        if self.progress is not None:
            self.progress.close() if final else self.progress.pump()

    async def _follow_logs(self, interval_s: float = 0.1) -> None:
        while True:
            self._pump_logs()
            await asyncio.sleep(interval_s)

    def _log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(f"[{self.name}] {text}")
        else:
            print(f"[{self.name}] {text}", flush=True)


def where_stopped(output_dir: Path) -> str:
    """Where a stopped run can go on from: its newest complete checkpoint (loop_state.json is
    written last, so a directory without it is not one)."""
    root = Path(output_dir) / "checkpoints"
    done = []
    for path in root.glob("step_*"):
        try:
            done.append((int(json.loads((path / "loop_state.json").read_text())["step"]), path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not done:
        return f"stopped before the first checkpoint (none in {root}); run the same command again to start over"
    step, path = max(done)
    return f"stopped at step {step} (checkpoint {path}); run the same command again to resume"


def _last_error_line(tail: str) -> str:
    """The line that says what went wrong: the host's `error:` line, else the last one."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: "):]
    return lines[-1][:500] if lines else ""


def _normalized(line: str) -> str:
    """The same failure twice: timestamps, pids, ports and addresses differ, the words do not."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", line)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
