#!/usr/bin/env bash
# Creates the NeMo Gym venv (Python 3.12: nemo-gym 0.4.0 is the last release that installs on
# 3.12; newer ones need >= 3.13.14) once and installs it. Idempotent: a stamp names the
# requirement it was made for. The resource/agent servers (miles/envs/servers/nemo_gym_*.py) run
# from this venv and import NeMo Gym and the stdlib only. Prints the venv's python path last.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/envs/_py312.sh
REQ="nemo-gym==0.4.0"
VENV=${MILES_NEMO_GYM_VENV:-$(envs_dir)/nemo_gym}
lock_venv "$VENV"
stamp="$VENV/.miles-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$REQ" ]; then
    find_py312
    make_venv "$VENV"
    "$VENV/bin/python" -m pip install -q "$REQ"
    "$VENV/bin/python" -c 'import nemo_gym.base_resources_server'
    echo "$REQ" > "$stamp"
fi
echo "$VENV/bin/python"
