#!/usr/bin/env bash
# The test command (README, .ci/run): set-up included, idempotent, from any folder.
#
#   bash scripts/test.sh [pytest arguments...]     e.g. bash scripts/test.sh -k cli -x
#   bash scripts/test.sh --setup-only              set up .venv and stop (scripts/demo.sh uses this)
#
# Set-up: makes .venv (Python >= 3.11) when it is missing; installs torch==2.13.0 FIRST when the venv has no
# torch (the CPU build that lies on these machines' disk; an unpinned torch resolves to a 5.5 GB CUDA build; a
# torch you installed yourself, such as a CUDA build on a GPU machine, is kept); then this checkout, editable,
# with the test and jax extras. The installs are skipped while pyproject.toml is unchanged and the venv still
# imports this checkout. Then: pytest on tests/ (tests/vllm has its own environment), then
# scripts/test_vllm.sh when it exists. Exits non-zero when anything fails.
#
# Environment: PYTHON (interpreter for a new venv; default python3.11, else python3), MLA_BRIDGE_VENV (default
# .venv), MLA_BRIDGE_TORCH (default torch==2.13.0), MLA_BRIDGE_EXTRAS (default test,jax),
# MLA_BRIDGE_SKIP_VLLM=1 (skip scripts/test_vllm.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MLA_BRIDGE_VENV:-.venv}"
PY="$VENV/bin/python"
TORCH_SPEC="${MLA_BRIDGE_TORCH:-torch==2.13.0}"
EXTRAS="${MLA_BRIDGE_EXTRAS:-test,jax}"
STAMP="$VENV/.mla-bridge-setup"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

pick_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    if command -v python3.11 >/dev/null 2>&1; then echo python3.11; else echo python3; fi
}

want_stamp() {
    echo "$(sha256sum pyproject.toml | cut -c1-16) extras=$EXTRAS root=$ROOT"
}

setup_ok() {
    [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(want_stamp)" ] \
        && "$PY" - "$ROOT" <<'PYEOF' >/dev/null 2>&1
import os, sys
import mla_bridge, pytest, torch  # noqa: F401
assert os.path.realpath(mla_bridge.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PYEOF
}

pip_install() {
    # pip -q, minus the warnings this machine's pip configuration prints for each package (index folders that
    # do not exist); every other line, warning or error, still shows.
    local rc=0
    "$PY" -m pip install -q "$@" 2>&1 \
        | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.\?$" || true; } || rc=$?
    return "$rc"
}

setup() {
    local start=$SECONDS python
    if [ ! -x "$PY" ]; then
        python="$(pick_python)"
        "$python" - <<'PYEOF' || { echo "test.sh: $python is older than Python 3.11 (set PYTHON=...)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PYEOF
        echo "test.sh: making $VENV with $python ($("$python" --version 2>&1))"
        "$python" -m venv "$VENV"
    fi
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "test.sh: installing $TORCH_SPEC first (a CPU build on these machines)"
        pip_install "$TORCH_SPEC"
    fi
    echo "test.sh: installing mla-bridge (editable) with extras [$EXTRAS]"
    pip_install -e ".[$EXTRAS]"
    want_stamp > "$STAMP"
    echo "test.sh: $VENV ready in $((SECONDS - start)) s (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
}

if setup_ok; then
    echo "test.sh: reusing $VENV"
else
    setup
    setup_ok || { echo "test.sh: $VENV does not import mla_bridge from $ROOT with pytest and torch" >&2; exit 1; }
fi
if [ "${1:-}" = "--setup-only" ]; then
    exit 0
fi

status=0
"$PY" -m pytest -q tests --ignore=tests/vllm "$@" || status=$?
if [ -f scripts/test_vllm.sh ] && [ "${MLA_BRIDGE_SKIP_VLLM:-0}" != "1" ]; then
    echo "test.sh: vLLM adapter tests (scripts/test_vllm.sh)"
    bash scripts/test_vllm.sh || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
fi
if [ "$status" -ne 0 ]; then
    echo "test.sh: FAILED (exit $status)" >&2
fi
exit "$status"
