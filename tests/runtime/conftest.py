import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ports import cluster_port

ROOT = Path(__file__).resolve().parents[2]


def start_node(recipe: Path, rank: int, nnodes: int, log: Path, extra_env=None, overrides=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_"))}
    env.update(NODE_RANK=str(rank), NNODES=str(nnodes), MASTER_ADDR="127.0.0.1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "runtime" / "plugins"),
                                           env.get("PYTHONPATH", "")]), **(extra_env or {}))
    args = [sys.executable, "-m", "miles.cli", "run", str(recipe)]
    for o in overrides:
        args += ["--set", o]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def node_launcher(tmp_path):
    procs = []

    def launch(recipe_text: str, nnodes: int = 1, overrides=(), extra_env=None):
        port = cluster_port()
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(recipe_text.replace("@PORT@", str(port)).replace("@OUT@", str(tmp_path / "run")))
        started = [start_node(recipe, r, nnodes, tmp_path / f"node{r}.log", extra_env, overrides)
                   for r in range(nnodes)]
        procs.extend(started)
        return started, port, [tmp_path / f"node{r}.log" for r in range(nnodes)]

    yield launch
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()


def start_daemon(recipe: Path, rank: int, nnodes: int, port: int, log: Path, overrides=()):
    """One node daemon started the way `srun launch/miles.sh` starts it on a cluster node: the
    launch script, NODE_RANK / NNODES / MASTER_ADDR, the recipe and its `--set` overrides. The
    nodes are simulated on loopback, so each advertises 127.0.0.1 (the script's default is the
    host name)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_")) and k not in ("NODE_RANK", "NNODES", "MASTER_ADDR")}
    env.update(NODE_RANK=str(rank), NNODES=str(nnodes), MASTER_ADDR="127.0.0.1",
               MILES_HOST="127.0.0.1", MILES_PYTHON=sys.executable)
    args = ["bash", str(ROOT / "launch" / "miles.sh"), str(recipe), "--set", f"cluster.head_port={port}"]
    for o in overrides:
        args += ["--set", o]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def cluster_launcher(tmp_path):
    """Start `nnodes` daemons of one recipe file; calling it again with the same arguments is
    "the same command again" (same port, same run directory, logs appended)."""
    procs = []
    port = cluster_port()

    def launch(recipe: Path, nnodes: int = 2, overrides=()):
        started = [start_daemon(recipe, r, nnodes, port, tmp_path / f"node{r}.log", overrides)
                   for r in range(nnodes)]
        procs.extend(started)
        return started, [tmp_path / f"node{r}.log" for r in range(nnodes)]

    yield launch
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
