#!/usr/bin/env bash
# The test command: sets up .venv (and, as root, bubblewrap + a Docker daemon for the sandbox
# tests), then runs the CPU test suite (tests/gpu skips without CUDA).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
scripts/setup_system.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
