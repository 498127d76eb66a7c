#!/usr/bin/env bash
# Creates the Harbor venv (Python 3.12; Harbor needs >= 3.12, Miles' .venv is 3.11) once and
# installs Harbor into it. Idempotent: a stamp names the requirement it was made for. No torch:
# the Harbor trial server (miles/envs/servers/harbor_server.py) imports Harbor and the stdlib only.
# Prints the venv's python path on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/envs/_py312.sh
REQ="harbor==0.25.0"
VENV=${MILES_HARBOR_VENV:-$(envs_dir)/harbor}
lock_venv "$VENV"
stamp="$VENV/.miles-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$REQ" ]; then
    find_py312
    make_venv "$VENV"
    "$VENV/bin/python" -m pip install -q "$REQ"
    "$VENV/bin/python" -c 'import harbor.trial.trial'
    echo "$REQ" > "$stamp"
fi
echo "$VENV/bin/python"
