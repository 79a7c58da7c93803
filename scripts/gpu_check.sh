#!/usr/bin/env bash
# One GPU check of Cedar for a machine with torch and Triton but no SGLang and no network.
#
#   scripts/gpu_check.sh [--dry-run] OUTDIR
#
# Runs the stages of cedar.backend.gpu_stages (env, kernels, served, replay, graphs) one process
# each under its own time limit; each writes OUTDIR/<n>-<stage>.json as it ends (this script
# writes one with status "timeout" or "crashed" when it could not), then OUTDIR/summary.json and
# OUTDIR/log.txt: 7 files. A failing stage does not stop the next. Whole run under 8 minutes.
# --dry-run: every stage on the CPU at tiny sizes (Triton interpreted; the CUDA-graph stage
# reports "skipped: no CUDA"), in well under a minute: what CI runs.
# Runs from a plain copy of the repository: a temporary folder holds a `cedar` link to the
# repository root (the package maps cedar.<x> to the folder <x>, see pyproject.toml), so nothing
# is installed. PYTHON picks the interpreter (default: python3).
set -u
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; shift; fi
if [ $# -ne 1 ]; then echo "usage: $0 [--dry-run] OUTDIR" >&2; exit 2; fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LINK=$(mktemp -d)
trap 'rm -rf "$LINK"' EXIT
ln -s "$ROOT" "$LINK/cedar"
export PYTHONPATH="$LINK${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "$DRY" ]; then
  # NOTE: Triton reads TRITON_INTERPRET when a kernel is defined; hide any GPU so CPU is the device
  # and skip the C++ CPU kernels (their first build takes a minute; the batched torch ops stand in)
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" CEDAR_NO_CPU_EXT=1
  LIMITS="env:30 kernels:60 served:60 replay:60 graphs:30"
else
  LIMITS="env:30 kernels:120 served:90 replay:120 graphs:90"  # 450 s of stages: 7.5 min at most
fi
# GPU_CHECK_LIMITS="stage:seconds ...": other limits, or a subset of the stages (in this order)
LIMITS=${GPU_CHECK_LIMITS:-$LIMITS}
: > "$OUT/log.txt"
n=0
for pair in $LIMITS; do
  stage=${pair%%:*}; limit=${pair##*:}
  case $stage in env) n=1;; kernels) n=2;; served) n=3;; replay) n=4;; graphs) n=5;;
    *) echo "unknown stage $stage in limits" >&2; exit 2;; esac
  file="$OUT/$n-$stage.json"
  rm -f "$file"
  start=$(date +%s)
  timeout -k 5 "$limit" "$PY" -m cedar.backend.gpu_stages "$stage" "$OUT" $DRY >>"$OUT/log.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ ! -s "$file" ]; then
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; else status=crashed; fi
    printf '{"stage": "%s", "status": "%s", "returncode": %d, "limit_s": %d, "elapsed_s": %d}\n' \
      "$stage" "$status" "$rc" "$limit" "$took" > "$file"
  fi
  echo "stage $n $stage: rc $rc, ${took}s (limit ${limit}s)"
  tail -n 1 "$OUT/log.txt"
done
echo "summary ($OUT/summary.json):"
"$PY" -m cedar.backend.gpu_stages summary "$OUT"
