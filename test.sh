#!/usr/bin/env bash
# The test command: sets up .venv (and, as root, bubblewrap + a Docker daemon for the sandbox
# tests), then runs the CPU test suite (tests/gpu skips without CUDA). The environment packages'
# own venvs (scripts/envs/, Python 3.12) are made in the background meanwhile: their tests run
# the same scripts, which wait for a set-up in progress instead of starting a second one.
#
# With no arguments the suite runs as two pytest processes side by side: the tests that make
# sandboxes (whose checks look for leftover sandbox processes machine-wide, so they must not run
# beside each other's episodes), with tests/algo to even the halves, and everything else. Most of a test's time is real processes
# waiting on each other (engine start-up, deadlines, kills), which leaves a 2-core machine a
# third idle when they run one at a time. The second process's output is printed when both have
# ended. With arguments (a file, -k, -m slow, ...) one pytest runs them as given;
# MILES_TEST_STREAMS=1 runs the whole suite that way too.
# A failed `slow` test (a real end-to-end run) is run once more (tests/conftest.py); the summary
# names every rerun, so an intermittent failure stays visible.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
scripts/setup_system.sh
mkdir -p .cache/envs
for setup in scripts/envs/setup_*.sh; do
    name=$(basename "$setup" .sh)
    (bash "$setup" > ".cache/envs/${name#setup_}.setup.log" 2>&1 &)
done
echo "[test.sh] set-up done after ${SECONDS} s; tests start at $(date -u +%H:%M:%S) UTC"
# --durations: the slowest tests close the output, so a CI log shows where its time went
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -rR --durations=25 --durations-min=10)
if [ "$#" -gt 0 ] || [ "${MILES_TEST_STREAMS:-2}" = 1 ]; then
    exec "${PYTEST[@]}" "$@"   # no path among them: pyproject's testpaths (tests/)
fi
SANDBOXED=(tests/agentic tests/envs tests/sandboxes tests/chaos tests/tito tests/algo
           tests/rl/test_plugin_depths.py tests/rl/test_moe_r3.py tests/runtime/test_observe.py)
IGNORE=()
for path in "${SANDBOXED[@]}"; do IGNORE+=("--ignore=$path"); done
log=.cache/tests-sandboxed.log
"${PYTEST[@]}" "${SANDBOXED[@]}" > "$log" 2>&1 &
sandboxed=$!
trap 'kill "$sandboxed" 2>/dev/null || true' EXIT
rest_rc=0
"${PYTEST[@]}" tests "${IGNORE[@]}" || rest_rc=$?
sandboxed_rc=0
wait "$sandboxed" || sandboxed_rc=$?
trap - EXIT
echo
echo "===== the sandboxed tests (${SANDBOXED[*]}), run beside the above ====="
grep -v "^WARNING: Location" "$log" || true
echo "===== test.sh: the rest exited $rest_rc, the sandboxed tests $sandboxed_rc; ${SECONDS} s in all ====="
[ "$rest_rc" = 0 ] && [ "$sandboxed_rc" = 0 ]
