"""bench/tito.py runs and shows per-turn cost far below a full re-render of 64k tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prints_one_json_line():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tito.py"), "--repeats", "4"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.strip().splitlines()
    row = json.loads(line)
    assert row["bench"] == "tito" and {"turn_ms_1k", "turn_ms_64k", "retokenize_ms_64k", "machine"} <= set(row)
    assert row["history_tokens_64k"] >= 65536 and row["appended_tokens_64k"] == row["appended_tokens_1k"]
    # loose on purpose (shared CI machine): the point is the order of magnitude
    assert row["turn_ms_64k"] * 5 < row["retokenize_ms_64k"]
