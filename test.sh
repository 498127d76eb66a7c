#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite (tests/gpu skips without CUDA).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
