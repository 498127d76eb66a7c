#!/usr/bin/env bash
# A separate venv with Ray for bench/data_plane.py's object-store baseline (Ray is never a Miles
# dependency). Prints the venv's python on success. Usage: bench/ray_venv.sh [venv dir]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.cache/bench/ray}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import ray" 2>/dev/null; then
    PY=""
    for v in 3.11 3.12; do  # Ray's wheels cover both; the first one pyenv has wins
        if command -v pyenv >/dev/null && p=$(pyenv prefix "$v" 2>/dev/null); then
            PY="$p/bin/python"; break
        fi
    done
    PY=${PY:-python3}
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "ray==2.60.0" numpy >&2
fi
echo "$VENV/bin/python"
