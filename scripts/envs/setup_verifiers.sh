#!/usr/bin/env bash
# Creates the Verifiers venv once and installs Verifiers into it. Its own venv because verifiers
# 0.4 pins openai<3 and Miles' test tools need openai 3 (pip would downgrade it in .venv). Python
# 3.12 through pyenv, like the other environment venvs (verifiers supports 3.11 too). msgspec,
# psutil and aiohttp are the light part of Miles the adapter's in-process mode imports when it runs
# in this Python (miles.envs.verifiers_env, miles.envs.agent); no torch.
# Idempotent: a stamp names the requirements it was made for. Prints the venv's python last.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/envs/_py312.sh
REQ="verifiers==0.4.0 msgspec>=0.19 psutil>=5.9 aiohttp>=3.9"
VENV=${MILES_VERIFIERS_VENV:-$(envs_dir)/verifiers}
lock_venv "$VENV"
stamp="$VENV/.miles-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$REQ" ]; then
    find_py312
    make_venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q $REQ
    "$VENV/bin/python" -m pip check
    "$VENV/bin/python" -c 'import verifiers.v1.serve, msgspec, psutil, aiohttp'
    echo "$REQ" > "$stamp"
fi
echo "$VENV/bin/python"
