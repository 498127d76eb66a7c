"""The head's console: routine log records stay in the files, progress is one bar (TTY) or one
line every `logging.console_every` steps, and a short quickstart prints a handful of lines."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.console import RunProgress, forwarder, is_routine
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]


def test_records_below_warning_are_routine_and_everything_else_is_not():
    assert is_routine(b"[trainer/0] 2026-12-01 15:29:09,267 INFO miles.weights.publisher: published version 1\n")
    assert is_routine(b"2026-12-01 15:29:09,267 DEBUG x: y\n")
    assert not is_routine(b"[driver] 2026-12-01 15:31:13,167 WARNING miles.runtime.actor: stuck\n")
    assert not is_routine(b"[trainer/0] 2026-12-01 15:31:13,167 ERROR miles.x: boom\n")
    assert not is_routine(b"[rollout] incarnation 2 resumes from the buffer's journal\n")
    assert not is_routine(b"Traceback (most recent call last):\n")
    assert not is_routine(b"INFO is a word a message may start with\n")
    out = []
    write = forwarder(None, out.append)
    write(b"[t] 2026-12-01 15:29:09,267 INFO a: b\n[t] 2026-12-01 15:29:09,267 WARNING a: c\n")
    assert out == [b"[t] 2026-12-01 15:29:09,267 WARNING a: c\n"]


def rows(n_steps: int, eval_every: int) -> list[dict]:
    out = [{"kind": "eval", "step": 0, "time_s": 0.1, "eval/reward": 0.25}]
    for step in range(1, n_steps + 1):
        out.append({"kind": "train", "step": step, "time_s": 0.1 + 0.5 * step, "rollout/reward": 0.5,
                    "batch/staleness_avg": 1.0, "perf/step_s": 0.4, "train/tokens": 1000.0})
        out.append({"kind": "actors", "step": step, "buffer/kept": 3.0})
        if step % eval_every == 0:
            out.append({"kind": "eval", "step": step, "time_s": 0.2 + 0.5 * step, "eval/reward": 0.5})
    return out


def test_a_pipe_gets_one_line_per_k_steps_and_per_evaluation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    stream = io.StringIO()
    progress = RunProgress(path, 100, every=10, bar=None, stream=stream)   # StringIO: not a TTY
    assert progress.bar is None
    data = "".join(json.dumps(r) + "\n" for r in rows(100, 50))
    path.write_text(data[:len(data) // 2])        # half a file, cut mid-line: read up to the cut
    progress.pump()
    with open(path, "a") as f:
        f.write(data[len(data) // 2:])
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10 + 3, lines            # every 10 steps, and the evals at 0, 50, 100
    assert lines[1].startswith("step    10/100  reward 0.500  eval 0.250 @0  staleness 1.00  0.50 s/step")
    assert "2,000 tok/s" in lines[1]              # 10 x 1000 tokens over 5 s of wall time (from step 0's eval)
    assert "eval 0.500 @50" in lines[-2] and lines[-1].startswith("eval  step   100")


def test_a_tty_gets_a_bar_and_the_lines_above_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(20, 100)))
    stream = io.StringIO()
    progress = RunProgress(path, 20, every=10, bar=True, stream=stream)
    progress.pump()
    assert progress.bar.n == 20
    progress.write("[buffer] a warning")
    progress.close()
    text = stream.getvalue()
    assert "RL steps" in text and "20/20" in text and "[buffer] a warning" in text


@pytest.mark.slow
def test_a_short_quickstart_prints_a_handful_of_lines(tmp_path):
    steps = 30
    out = tmp_path / "qs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    port = cluster_port()
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml"),
         "--set", f"loop.num_steps={steps}", "--set", f"run.output_dir={json.dumps(str(out))}",
         "--set", f"cluster.head_port={port}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) <= steps / 10 + 20, proc.stdout
    assert not any(re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ", line) for line in lines), proc.stdout
    assert "\r" not in proc.stdout                     # no bar fragments in a pipe
    summaries = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in summaries] == ["10/30", "20/30", "30/30"], proc.stdout
    # the routine records are still in the log files
    assert "published version 30 via nccl" in (out / "logs" / "trainer_0.log").read_text()
