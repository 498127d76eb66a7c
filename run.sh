#!/usr/bin/env bash
# The main command: sets up .venv if needed, then runs a recipe (default: the CPU quickstart).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
recipe=${1:-recipes/quickstart.toml}
shift || true
exec .venv/bin/miles run "$recipe" "$@"
