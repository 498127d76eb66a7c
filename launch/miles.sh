#!/usr/bin/env bash
# One node daemon per node: `srun --ntasks-per-node=1 launch/miles.sh recipe.toml [--set k=v ...]`,
# or with torchrun-style variables (NODE_RANK, NNODES, MASTER_ADDR), or plain on one machine.
# Node rank, node count and head host are read by miles.node from SLURM_* / NODE_RANK variables;
# this script only picks this node's advertised address and the Python to use. Several "nodes"
# on one machine (tests, a try-out): MILES_HOST=127.0.0.1 NNODES=2 MASTER_ADDR=127.0.0.1 and
# NODE_RANK=0 / 1 per daemon (docs/gpu_and_clusters.md).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY=${MILES_PYTHON:-"$here/.venv/bin/python"}
[ -x "$PY" ] || PY=python3
if [ -n "${SLURM_JOB_NODELIST:-}" ] || [ -n "${NNODES:-}" ]; then
    # multi-node: advertise this host's name unless told otherwise
    export MILES_HOST=${MILES_HOST:-$(hostname)}
fi
exec "$PY" -m miles.cli run "$@"
