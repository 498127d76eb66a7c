# Sourced by the 3.12 environment set-up scripts: sets PY312 to a Python 3.12 interpreter.
# Order: $MILES_PY312 (explicit), pyenv's newest 3.12.x, then python3.12 on PATH. No absolute
# paths: pyenv knows where it keeps its versions.
find_py312() {
    if [ -n "${MILES_PY312:-}" ]; then
        PY312=$MILES_PY312
    elif command -v pyenv >/dev/null 2>&1 && root=$(pyenv root 2>/dev/null) \
        && latest=$(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V | tail -n 1) \
        && [ -n "$latest" ] && [ -x "$latest/bin/python3.12" ]; then
        PY312=$latest/bin/python3.12
    elif command -v python3.12 >/dev/null 2>&1; then
        PY312=$(command -v python3.12)
    else
        echo "no Python 3.12 found: install one with pyenv (pyenv install 3.12) or set MILES_PY312" >&2
        return 1
    fi
    if ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "$PY312 is not Python 3.12" >&2
        return 1
    fi
}

# envs_dir: where the environments' venvs live, outside the checkout and shared by every clone of
# it on this machine (as pip's cache is): they hold only the ecosystems' own packages, never Miles,
# so a fresh clone (CI) reuses the venvs an earlier run made and the stamp (the requirement) says
# when one must be made again. $MILES_ENVS_DIR moves them; each $MILES_<NAME>_VENV moves one.
envs_dir() {
    echo "${MILES_ENVS_DIR:-${MILES_CACHE:-$HOME/.cache/miles}/envs}"
}

# make_venv DIR: creates DIR with Python 3.12 unless it already holds one.
make_venv() {
    local dir=$1
    if [ ! -x "$dir/bin/python" ]; then
        "$PY312" -m venv "$dir"
    fi
}

# lock_venv DIR: one set-up of DIR at a time (test.sh starts them in the background while the
# tests run, and a test may ask for the same venv meanwhile: it waits here, then finds the stamp).
lock_venv() {
    mkdir -p "$(dirname "$1")"
    exec 9>"$1.lock"
    flock 9
}
