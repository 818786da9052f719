#!/usr/bin/env bash
# vLLM adapter tests against the real vLLM package, on CPU.
#
# Sets up a separate virtual environment for vLLM (default .venv-vllm, gitignored) by a "lean" install:
#   1. torch at vLLM's own pin (2.13.0 for vLLM 0.32.0; its CPU build),
#   2. vLLM's Requires-Dist minus the GPU-only packages (nvidia-*, triton, flashinfer, CUDA kernel packages,
#      torchaudio/torchvision/torchcodec...), read from the wheel's METADATA,
#   3. vLLM itself with --no-deps, then mla-bridge editable with --no-deps, and pytest.
# A present and correct environment is reused (checked by a stamp file and an import). Then it runs
#   pytest tests/vllm tests/parity/test_vllm_parity.py
# with VLLM_TARGET_DEVICE=cpu.
#
# Environment:
#   VLLM_VERSION   vLLM release to test (default 0.32.0)
#   VLLM_VENV      the environment's folder (default .venv-vllm; use one per vLLM version)
#   PYTHON         the interpreter the environment is made from (default python3)
# Arguments go to pytest (test paths among them replace the default paths; the value of -k/-m/... is never taken
# for a path). Without -m, "-m 'not gpu'" is added. Exit status: pytest's (5 when no test was selected).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
STAMP="$VENV/.mla-bridge-vllm-stamp"
WANT="vllm==$VLLM_VERSION lean-v1"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

quiet_pip() {  # pip, silent unless it fails (then its last log is shown); tried 3 times: a download cut short by
    local log attempt  # the network (seen in CI: "not enough bytes were received") is the usual failure
    log="$(mktemp)"
    for attempt in 1 2 3; do
        if "$PY" -m pip "$@" >"$log" 2>&1; then
            rm -f "$log"
            return 0
        fi
        if [ "$attempt" -lt 3 ]; then
            echo "test_vllm.sh: pip $* failed (attempt $attempt of 3), trying again" >&2
        fi
    done
    cat "$log" >&2
    rm -f "$log"
    echo "test_vllm.sh: pip $* failed" >&2
    return 1
}

env_ok() {  # the lean vLLM environment itself
    [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
        && "$PY" -c "import sys; from importlib.metadata import version; sys.exit(version('vllm') != '$VLLM_VERSION')" \
        2>/dev/null && "$PY" -c "import pytest" 2>/dev/null
}

checkout_ok() {  # this checkout installed editable, with its vllm.general_plugins entry point
    "$PY" - "$ROOT" <<'PYEOF' 2>/dev/null
import os, sys
from importlib.metadata import entry_points
import mla_bridge, mla_bridge_vllm
root = os.path.realpath(sys.argv[1])
assert os.path.realpath(mla_bridge_vllm.__file__).startswith(root + os.sep), mla_bridge_vllm.__file__
assert os.path.realpath(mla_bridge.__file__).startswith(root + os.sep), mla_bridge.__file__
assert any(ep.value == "mla_bridge_vllm:register" for ep in entry_points(group="vllm.general_plugins"))
PYEOF
}

setup_env() {
    local start=$SECONDS tmp
    echo "test_vllm.sh: setting up $VENV (lean vLLM $VLLM_VERSION install)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    quiet_pip install -q --upgrade pip
    tmp="$(mktemp -d)"
    quiet_pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$tmp"
    # Split vLLM's Requires-Dist into torch's pin and the rest, minus the GPU-only packages.
    "$PY" - "$tmp" <<'PYEOF'
import glob, re, sys, zipfile
tmp = sys.argv[1]
whl = glob.glob(f"{tmp}/vllm-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
gpu_only = re.compile(
    r"^(nvidia-.*|triton.*|flashinfer.*|torchaudio|torchvision|torchcodec|pynvvideocodec|apache-tvm-ffi|tilelang"
    r"|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|cupy.*|xformers"
    r"|deep[-_]gemm|deep[-_]ep|flash[-_]attn.*|flashmla.*|b12x|helion)$", re.I)
torch_pin, keep, dropped = None, [], []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;]", req, 1)[0]
    if name.lower() == "torch":
        torch_pin = req
    elif gpu_only.match(name):
        dropped.append(name)
    else:
        keep.append(req)
open(f"{tmp}/torch.txt", "w").write(torch_pin + "\n")
open(f"{tmp}/reqs.txt", "w").write("\n".join(keep) + "\n")
print(f"test_vllm.sh: {torch_pin}; {len(keep)} requirements; dropped GPU-only: {' '.join(sorted(set(dropped)))}")
PYEOF
    quiet_pip install -q -r "$tmp/torch.txt"
    quiet_pip install -q -r "$tmp/reqs.txt" pytest
    quiet_pip install -q --no-deps "$tmp"/vllm-*.whl
    rm -rf "$tmp"
    echo "$WANT" > "$STAMP"
    echo "test_vllm.sh: $VENV ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
}

if env_ok; then
    echo "test_vllm.sh: reusing $VENV (vllm $VLLM_VERSION)"
else
    setup_env
    env_ok || { echo "test_vllm.sh: $VENV does not hold vllm $VLLM_VERSION and pytest" >&2; exit 1; }
fi
if ! checkout_ok; then
    quiet_pip install -q --no-deps -e "$ROOT"
    checkout_ok || { echo "test_vllm.sh: mla_bridge_vllm from $ROOT is not importable in $VENV" >&2; exit 1; }
fi

export VLLM_TARGET_DEVICE=cpu
has_path=0 prev=""
for arg in "$@"; do  # a test path: an existing file or folder that is not an option nor an option's value
    case "$prev" in -k|-m|-p|-o|-c|-W|--rootdir|--deselect|--ignore|--ignore-glob|--junitxml|--basetemp) ;;
        *) [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ] && has_path=1 ;;
    esac
    prev="$arg"
done
[ "$has_path" = 1 ] || set -- tests/vllm tests/parity/test_vllm_parity.py "$@"
# GPU tests (tests/vllm/test_kernel_path.py -m gpu) need no vLLM and run in the core suite on a GPU machine.
case " $* " in *" -m "*) ;; *) set -- -m "not gpu" "$@" ;; esac
exec "$PY" -m pytest -q -W "ignore::DeprecationWarning:torch.jit._script" "$@"
