#!/usr/bin/env bash
# Creates the OpenEnv venv once and installs OpenEnv into it. OpenEnv cannot share Miles' .venv:
# it requires gradio, which caps huggingface-hub < 2 and pillow < 13 (the .venv has newer ones).
# Python 3.12 (OpenEnv needs >= 3.10; the 3.12 helpers are shared with the other env venvs).
# Idempotent: a stamp names the requirement it was made for. No torch: the OpenEnv environment
# server and the episode driver (miles/envs/servers/openenv_server.py) import OpenEnv and the
# stdlib only. Prints the venv's python path on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/envs/_py312.sh
REQ="openenv==0.10.0"
VENV=${MILES_OPENENV_VENV:-$(envs_dir)/openenv}
lock_venv "$VENV"
stamp="$VENV/.miles-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$REQ" ]; then
    find_py312
    make_venv "$VENV"
    "$VENV/bin/python" -m pip install -q "$REQ"
    "$VENV/bin/python" -c 'import openenv.core.env_server, openenv.core.env_client, openai, uvicorn'
    echo "$REQ" > "$stamp"
fi
echo "$VENV/bin/python"
