#!/usr/bin/env bash
# CI's checks besides the tests (.ci/run runs them after scripts/test.sh), each also runnable alone:
#
#   bash scripts/check.sh                 lint, types, docs, package
#   bash scripts/check.sh lint docs       some of them:
#     lint     ruff check . and ruff format --check . (the rules in pyproject.toml)
#     types    mypy (the packages and exceptions in pyproject.toml)
#     docs     mkdocs build --strict (docs/, mkdocs.yml; no GPU, JAX or vLLM needed)
#     package  python -m build (wheel and sdist), the wheel installed into a clean venv (torch first), and
#              scripts/check_installed.py run from a temporary folder: the installed package alone, then with the
#              cli, jax and transformers extras
#
# lint, types and docs run in the test venv (.venv, or MLA_BRIDGE_VENV; made by scripts/test.sh --setup-only when
# missing) with the docs and dev extras added. The package check makes its own venv in a temporary folder
# (MLA_BRIDGE_SMOKE_VENV to keep it somewhere), installs MLA_BRIDGE_TORCH (default torch==2.13.0, the CPU build
# on these machines: an unpinned torch resolves to a 5.5 GB CUDA build) before the wheel, and reuses pip's cache.
# Exits non-zero when a check fails; every step says how long it took.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MLA_BRIDGE_VENV:-.venv}"
PY="$VENV/bin/python"
TORCH_SPEC="${MLA_BRIDGE_TORCH:-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mla-bridge/mypy}"
export NO_MKDOCS_2_WARNING=1

steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(lint types docs package)
for name in "${steps[@]}"; do
    case "$name" in
        lint|types|docs|package) ;;
        *) echo "check.sh: unknown step '$name' (lint, types, docs, package)" >&2; exit 2 ;;
    esac
done

quiet_pip() {  # quiet_pip PYTHON ARGS...: pip install, its output shown only when it fails; tried 3 times
    local py=$1 log attempt
    shift
    log="$(mktemp)"
    for attempt in 1 2 3; do
        if "$py" -m pip install -q "$@" >"$log" 2>&1; then
            rm -f "$log"
            return 0
        fi
        echo "check.sh: pip install $* failed (attempt $attempt of 3)" >&2
    done
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return 1
}

tools() {  # the docs and dev extras in the test venv
    [ -x "$PY" ] || bash scripts/test.sh --setup-only
    if ! "$PY" -c "import mkdocs, mkdocstrings_handlers.python, ruff, mypy, build" >/dev/null 2>&1; then
        echo "check.sh: installing the docs and dev extras into $VENV"
        quiet_pip "$PY" -e ".[docs,dev]"
    fi
}

# Each check is called in a `||` list, where set -e is off: every command in it returns on failure itself.
lint() {
    "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check .
}

types() {
    "$VENV/bin/mypy"
}

docs() {
    local site rc=0
    site="$(mktemp -d)"
    "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$site" || rc=$?
    rm -rf "$site"
    return "$rc"
}

package() {
    local dist smoke_root venv whl sdist python extra
    dist="$(mktemp -d)"
    "$PY" -m build --outdir "$dist" . >"$dist/build.log" 2>&1 || { cat "$dist/build.log" >&2; return 1; }
    whl="$(ls "$dist"/mla_bridge-*.whl)" && sdist="$(ls "$dist"/mla_bridge-*.tar.gz)" || return 1
    echo "check.sh: built $(basename "$whl") and $(basename "$sdist")"
    tar tzf "$sdist" >"$dist/sdist.txt" || return 1
    for f in LICENSE README.md CHANGELOG.md mkdocs.yml docs/index.md; do  # what builds, tests and documents it
        grep -qx "mla_bridge-[^/]*/$f" "$dist/sdist.txt" || { echo "check.sh: the sdist has no $f" >&2; return 1; }
    done
    smoke_root="$(mktemp -d)"
    venv="${MLA_BRIDGE_SMOKE_VENV:-$smoke_root/venv}"
    python="$("$PY" -c 'import sys; print(sys._base_executable)')" || return 1
    rm -rf "$venv"
    "$python" -m venv "$venv" || return 1
    quiet_pip "$venv/bin/python" --no-compile "$TORCH_SPEC" || return 1
    quiet_pip "$venv/bin/python" --no-compile "$whl" || return 1
    (cd "$smoke_root" && env -u PYTHONPATH "$venv/bin/python" "$ROOT/scripts/check_installed.py" core) || return 1
    for extra in cli jax transformers; do
        quiet_pip "$venv/bin/python" --no-compile "$whl[$extra]" || return 1
        (cd "$smoke_root" && env -u PYTHONPATH "$venv/bin/python" "$ROOT/scripts/check_installed.py" "$extra") \
            || return 1
    done
    rm -rf "$dist" "$smoke_root"
}

began=$SECONDS
failed=()
tools
for name in "${steps[@]}"; do
    t0=$SECONDS
    rc=0
    echo "check.sh: $name"
    "$name" || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "check.sh: $name passed in $((SECONDS - t0)) s"
    else
        echo "check.sh: $name FAILED (exit $rc) in $((SECONDS - t0)) s" >&2
        failed+=("$name")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "check.sh: FAILED: ${failed[*]} ($((SECONDS - began)) s in all)" >&2
    exit 1
fi
echo "check.sh: ${steps[*]}: all passed in $((SECONDS - began)) s"
