"""Ctrl-C on a real run (the CPU quickstart, shortened): one line says where it stopped and how to
resume, and no process prints a traceback."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ctrl_c_after_the_first_checkpoint_prints_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    sets = ["loop.num_steps=50", "loop.save_every=2", "loop.eval_every=0", 'eval.mode="off"',
            "logging.progress=false", f"run.output_dir={json.dumps(str(out))}",
            f"cluster.head_port={cluster_port()}"]
    args = [sys.executable, "-m", "miles.cli", "run", str(ROOT / "recipes" / "quickstart.toml")]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        first = out / "checkpoints" / "step_000002" / "loop_state.json"
        deadline = time.monotonic() + 400
        while not first.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert first.exists(), proc.communicate(timeout=60)[0].decode()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends its foreground group
        text = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, text[-3000:]
    stopped = [line for line in text.splitlines() if "stopped" in line]
    assert len(stopped) == 1, text[-3000:]
    m = re.fullmatch(r"\[node/0\] shutting down: signal SIGINT; stopped at step (\d+) \(checkpoint "
                     r"(\S+)\); run the same command again to resume", stopped[0])
    assert m and int(m.group(1)) >= 2, stopped
    assert m.group(2) == str(out / "checkpoints" / f"step_{int(m.group(1)):06d}")
    assert "Traceback" not in text, text[-6000:]
