#!/usr/bin/env bash
# The main job, set-up included (README): MLA prefill at DeepSeek-V2-Lite's dims (the
# `deepseek-v2-lite` preset, shared by DeepSeek-Coder-V2-Lite-Instruct).
#
#   bash scripts/demo.sh                                      4 requests x 256 new tokens, some cached context
#   bash scripts/demo.sh --batch 4 --prompt-len 10000         the seed workload
#   bash scripts/demo.sh --context-lens 8000 --prompt-len 2000    prefix-cache case
#
# Sets up .venv exactly as scripts/test.sh does (idempotent), prints `mla-bridge info`, then runs
# `mla-bridge prefill` with this script's arguments (see `mla-bridge prefill --help`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MLA_BRIDGE_VENV:-.venv}"
bash scripts/test.sh --setup-only
"$VENV/bin/mla-bridge" info
"$VENV/bin/mla-bridge" prefill "$@"
