#!/usr/bin/env bash
# bench/wire.py with Ray as the peer baseline. Ray lives only in .venv-bench (never a Miles dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -x .venv-bench/bin/python ]; then
    python3 -m venv .venv-bench
    .venv-bench/bin/pip install -q ray numpy
fi
exec .venv/bin/python bench/wire.py --ray-python .venv-bench/bin/python "$@"
