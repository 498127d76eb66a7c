#!/usr/bin/env bash
# Creates .venv (once) and installs Miles with its test extras.
# torch is pinned to 2.13.0 first: that release is a local CPU build on our machines; an unpinned
# torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MILES_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.miles-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==2.13.0"
    "$PY" -m pip install -q -e ".[dev,cloud]"
    touch "$stamp"
fi
