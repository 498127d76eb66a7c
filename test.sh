#!/usr/bin/env bash
# The test command: sets up .venv (and, as root, bubblewrap + a Docker daemon for the sandbox
# tests), then runs the CPU test suite (tests/gpu skips without CUDA). The environment packages'
# own venvs (scripts/envs/, Python 3.12) are made in the background meanwhile: their tests run
# the same scripts, which wait for a set-up in progress instead of starting a second one.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
scripts/setup_system.sh
mkdir -p .cache/envs
for setup in scripts/envs/setup_*.sh; do
    name=$(basename "$setup" .sh)
    (bash "$setup" > ".cache/envs/${name#setup_}.setup.log" 2>&1 &)
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
