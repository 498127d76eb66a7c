"""What the head node's console shows: one progress bar, a concise line every N steps, and the
actors' warnings and errors. Everything else stays in `<run>/logs/<actor>.log`.

Design decisions:
- The node daemon owns the console; actors write only to their log files (they are child
  processes whose stdout is their log). The daemon follows each actor's log and forwards a line
  to the console only if it is not routine: a logging record below WARNING (`... INFO name: ...`,
  the format `miles.runtime.host` sets) stays in the file. Anything else an actor prints (its
  restarts, resumes, failures, a traceback) is an event a user should see, and goes out behind
  `[actor] `, as before.
- Progress comes from `metrics.jsonl`, which the driver appends to anyway: the daemon tails it, so
  no actor draws a bar into a log file (in a pipe a bar became thousands of `\\r` fragments).
- A TTY gets a tqdm bar and the lines above it (`tqdm.write`, so they never garble the bar); a
  pipe or file gets no bar, only the lines: one every `logging.console_every` steps and one per
  evaluation, so a log file of a 1000-step run has ~100 progress lines.
- The concise line: step, batch reward, latest eval reward, staleness, seconds per step and tokens
  trained per second over the steps since the previous line.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable, TextIO

# `%(asctime)s %(levelname)s %(name)s: %(message)s` (miles.runtime.host), below WARNING
ROUTINE = re.compile(rb"^(?:\[[^\]]+\] )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:DEBUG|INFO) ")


def is_routine(line: bytes) -> bool:
    """A log record below WARNING: it belongs in the actor's log file, not on the console."""
    return bool(ROUTINE.match(line))


class RunProgress:
    """Tails a run's metrics.jsonl onto a console: a bar on a TTY, concise lines always."""

    def __init__(self, metrics_path: str | Path, total_steps: int, *, every: int = 10,
                 bar: bool | None = None, stream: TextIO | None = None):
        self.path = Path(metrics_path)
        self.total, self.every = total_steps, max(1, every)
        self.stream = stream or sys.stdout
        self.offset, self.partial = 0, b""
        self.eval_reward: tuple[int, float] | None = None
        self.prev_time = self.window_start = 0.0      # the run's clock (time_s) at the last row
        self.window: list[dict] = []
        self.lines_written = 0
        use_bar = self.stream.isatty() if bar is None else bar
        self.bar = None
        if use_bar and total_steps > 0:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, desc="RL steps", file=self.stream, dynamic_ncols=True,
                            mininterval=0.5, leave=True)

    # ---- the console, shared with the actors' forwarded lines ----------------------------------

    def write(self, text: str) -> None:
        """One line (no newline) above the bar, or plainly where there is no bar."""
        self.lines_written += 1
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the console is gone; the files have everything
                pass

    def write_bytes(self, data: bytes) -> None:
        for line in data.decode(errors="replace").splitlines():
            self.write(line)

    # ---- metrics ----------------------------------------------------------------------------

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:   # a fresh run rewrote the file
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *rows, self.partial = (self.partial + data).split(b"\n")
        for raw in rows:
            try:
                self._row(json.loads(raw))
            except (ValueError, TypeError, KeyError):
                continue  # a line being written, or not ours: the file is the record, not this view

    def _row(self, row: dict) -> None:
        kind, step = row.get("kind"), int(row.get("step", 0))
        try:
            self._show(kind, step, row)
        finally:
            self.prev_time = float(row.get("time_s", self.prev_time))

    def _show(self, kind, step: int, row: dict) -> None:
        if kind == "eval" and "eval/reward" in row:
            self.eval_reward = (step, float(row["eval/reward"]))
            self.write(f"eval  step {step:>5}  held-out reward {row['eval/reward']:.3f}"
                       + (f"  (lag {row['eval_lag_s']:.1f} s)" if row.get("eval_lag_s") else ""))
        elif kind == "train":
            if not self.window:
                self.window_start = self.prev_time
            self.window.append(row)
            if self.bar is not None:
                self.bar.n = step
                shown = {"reward": f"{row.get('rollout/reward', 0):.3g}"}
                if self.eval_reward:
                    shown["eval"] = f"{self.eval_reward[1]:.3g}"
                self.bar.set_postfix(shown, refresh=False)
                self.bar.refresh()
            if step % self.every == 0 or step == self.total:
                self.write(self.summary(step))
                self.window = []

    def summary(self, step: int) -> str:
        rows = self.window or [{}]
        reward = sum(r.get("rollout/reward", 0.0) for r in rows) / len(rows)
        stale = sum(r.get("batch/staleness_avg", 0.0) for r in rows) / len(rows)
        span = rows[-1].get("time_s", 0.0) - self.window_start   # wall time: waits included
        step_s = span / len(rows)
        tokens = sum(r.get("train/tokens", 0.0) for r in rows)
        parts = [f"step {step:>5}/{self.total}", f"reward {reward:.3f}"]
        if self.eval_reward:
            parts.append(f"eval {self.eval_reward[1]:.3f} @{self.eval_reward[0]}")
        parts += [f"staleness {stale:.2f}", f"{step_s:.2f} s/step"]
        if span > 0:
            parts.append(f"{tokens / span:,.0f} tok/s")
        return "  ".join(parts)

    def close(self) -> None:
        self.pump()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def forwarder(progress: RunProgress | None, raw_write: Callable[[bytes], object]) -> Callable[[bytes], None]:
    """The `write` for an actor's LogFollower: routine records dropped, the rest to the console."""
    def write(data: bytes) -> None:
        kept = b"".join(line for line in data.splitlines(keepends=True) if not is_routine(line))
        if not kept:
            return
        if progress is not None:
            progress.write_bytes(kept)
        else:
            raw_write(kept)
    return write
