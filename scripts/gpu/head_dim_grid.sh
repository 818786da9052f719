#!/usr/bin/env bash
# Head-dim grid of FlashInfer's ragged prefill, each case in a fresh process (an illegal memory access cannot
# hide the next case), up to JOBS at a time, each under a timeout; one JSON line per case (see head_dim_probe.py).
#
#   bash scripts/gpu/head_dim_grid.sh OUT.jsonl
# Environment (defaults): BACKENDS="fa2 fa3"  DTYPES="bf16 fp16"  DIMS="16 32 ... 256" (qk = vo) plus the pair
# 192/128 (EXTRA="192/128"), JOBS=8, TIMEOUT=300 seconds per case (a first JIT compile of fa3 takes about 80 s).
# A case that crashes or times out without printing gets {"ok": false, "error": "exit N: <last stderr line>"}.
set -euo pipefail
out=${1:?usage: head_dim_grid.sh OUT.jsonl}
here=$(cd "$(dirname "$0")" && pwd)
BACKENDS=${BACKENDS:-"fa2 fa3"}
DTYPES=${DTYPES:-"bf16 fp16"}
DIMS=${DIMS:-"$(seq -s ' ' 16 16 256)"}
EXTRA=${EXTRA-"192/128"}
JOBS=${JOBS:-8}
TIMEOUT=${TIMEOUT:-300}
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cases=()
for b in $BACKENDS; do
  for t in $DTYPES; do
    for d in $DIMS; do cases+=("$b $d $d $t"); done
    for pair in $EXTRA; do cases+=("$b ${pair%/*} ${pair#*/} $t"); done
  done
done

run_case() {  # backend qk vo dtype
  local name="$1-$2-$3-$4" rc=0
  timeout --kill-after=10 "$TIMEOUT" "$PY" "$here/head_dim_probe.py" --backend "$1" --head-dim-qk "$2" \
    --head-dim-vo "$3" --dtype "$4" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  if ! grep -q '^{' "$tmp/$name.out"; then
    local why
    why=$(grep -v '^\s*$' "$tmp/$name.err" | tail -n 1 | tr -d '"\\' | cut -c1-300)
    [ "$rc" = 124 ] && why="timed out after ${TIMEOUT}s; $why"
    printf '{"backend": "%s", "head_dim_qk": %s, "head_dim_vo": %s, "dtype": "%s", "ok": false, "max_err": null, "max_lse_err": null, "error": "exit %s: %s"}\n' \
      "$1" "$2" "$3" "$4" "$rc" "$why" >"$tmp/$name.out"
  fi
  grep '^{' "$tmp/$name.out" | tail -n 1
}
export -f run_case
export here tmp TIMEOUT PY

printf '%s\n' "${cases[@]}" | xargs -P "$JOBS" -L 1 bash -c 'run_case "$@"' _ >"$out"
echo "$(wc -l <"$out") cases -> $out; ok: $(grep -c '"ok": true' "$out" || true)"
