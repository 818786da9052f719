#!/usr/bin/env bash
# The test command (README, .ci/run): set-up included, idempotent, from any folder.
#
#   bash scripts/test.sh [pytest arguments...]     e.g. bash scripts/test.sh -k cli -x
#   bash scripts/test.sh --setup-only              set up .venv and stop (scripts/demo.sh uses this)
#
# Two suites: the core suite (pytest tests --ignore=tests/vllm, in .venv) and the vLLM suite (scripts/test_vllm.sh:
# tests/vllm and tests/parity/test_vllm_parity.py, in .venv-vllm). Arguments go to both. Test paths among them
# (an argument naming an existing file or folder, optionally with ::test) are sorted: paths under tests/vllm and
# tests/parity/test_vllm_parity.py go to the vLLM suite, the others to the core suite, and a suite none of the
# paths names is not run. A suite in which no test was selected (pytest exit 5, e.g. `-k cli` matches only core
# tests) counts as a success when the other suite ran tests; when no suite ran any test the exit is 5.
#
# Set-up: makes .venv (Python >= 3.11) when it is missing; installs torch==2.13.0 FIRST when the venv has no
# torch (the CPU build that lies on these machines' disk; an unpinned torch resolves to a 5.5 GB CUDA build; a
# torch you installed yourself, such as a CUDA build on a GPU machine, is kept); then this checkout, editable,
# with the test, jax-ffi and cli extras. The installs are skipped while pyproject.toml is unchanged and the venv still
# imports this checkout. Then: pytest on tests/ (tests/vllm has its own environment), then
# scripts/test_vllm.sh when it exists. Exits non-zero when anything fails.
#
# Environment: PYTHON (interpreter for a new venv; default python3.11, else python3), MLA_BRIDGE_VENV (default
# .venv), MLA_BRIDGE_TORCH (default torch==2.13.0), MLA_BRIDGE_EXTRAS (default test,jax-ffi,cli: pytest and
# transformers; jax and jax-tvm-ffi, so the tvm_ffi shim tests build and run on the CPU too; rich, matplotlib and
# safetensors, which the CLI and bench tests need),
# MLA_BRIDGE_SKIP_VLLM=1 (skip scripts/test_vllm.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MLA_BRIDGE_VENV:-.venv}"
PY="$VENV/bin/python"
TORCH_SPEC="${MLA_BRIDGE_TORCH:-torch==2.13.0}"
EXTRAS="${MLA_BRIDGE_EXTRAS:-test,jax-ffi,cli}"
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
    # do not exist); every other line, warning or error, still shows. Tried 3 times: a download cut short by the
    # network is the usual failure.
    local rc attempt
    for attempt in 1 2 3; do
        rc=0
        "$PY" -m pip install -q "$@" 2>&1 \
            | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.\?$" || true; } \
            || rc=$?
        if [ "$rc" -eq 0 ]; then
            return 0
        fi
        if [ "$attempt" -lt 3 ]; then
            echo "test.sh: pip install $* failed (attempt $attempt of 3), trying again" >&2
        fi
    done
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

# Sort the arguments: options (and an option's value) go to both suites, test paths to the suite they belong to.
both=() core_paths=() vllm_paths=() prev=""
for arg in "$@"; do
    case "$prev" in -k|-m|-p|-o|-c|-W|--rootdir|--deselect|--ignore|--ignore-glob|--junitxml|--basetemp) takes=1 ;; *) takes=0 ;; esac
    prev="$arg"
    if [ "$takes" = 0 ] && [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ]; then
        case "$(realpath -m --relative-to="$ROOT" "${arg%%::*}")" in
            tests/vllm|tests/vllm/*|tests/parity/test_vllm_parity.py) vllm_paths+=("$arg") ;;
            *) core_paths+=("$arg") ;;
        esac
    else
        both+=("$arg")
    fi
done
run_core=1 run_vllm=1
[ -f scripts/test_vllm.sh ] && [ "${MLA_BRIDGE_SKIP_VLLM:-0}" != "1" ] || run_vllm=0
if [ "${#core_paths[@]}" -gt 0 ] || [ "${#vllm_paths[@]}" -gt 0 ]; then
    [ "${#core_paths[@]}" -gt 0 ] || run_core=0
    [ "${#vllm_paths[@]}" -gt 0 ] || run_vllm=0
else
    core_paths=(tests)
fi

core_rc=none vllm_rc=none
if [ "$run_core" = 1 ]; then
    core_rc=0
    "$PY" -m pytest -q "${core_paths[@]}" --ignore=tests/vllm "${both[@]}" || core_rc=$?
fi
if [ "$run_vllm" = 1 ]; then
    echo "test.sh: vLLM adapter tests (scripts/test_vllm.sh)"
    vllm_rc=0
    bash scripts/test_vllm.sh "${vllm_paths[@]}" "${both[@]}" || vllm_rc=$?
fi

# pytest exit 5 = no test collected or selected: fine in one suite when the other ran tests (exit 0).
status=0
for rc in "$core_rc" "$vllm_rc"; do
    [ "$rc" = none ] || [ "$rc" = 0 ] || [ "$rc" = 5 ] || { status=$rc; break; }
done
if [ "$status" = 0 ] && [ "$core_rc" != 0 ] && [ "$vllm_rc" != 0 ]; then
    status=5
    echo "test.sh: no test ran in either suite (pytest exit 5)" >&2
elif [ "$status" = 0 ]; then
    [ "$core_rc" != 5 ] || echo "test.sh: no test of the core suite selected; the vLLM suite ran"
    [ "$vllm_rc" != 5 ] || echo "test.sh: no test of the vLLM suite selected; the core suite ran"
fi
if [ "$status" -ne 0 ]; then
    echo "test.sh: FAILED (exit $status)" >&2
fi
exit "$status"
