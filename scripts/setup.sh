#!/usr/bin/env bash
# One-command setup of .venv/ on a fresh machine (2 cores, no GPU, Python 3.11):
# torch 2.14.1 (+ triton 3.8), SGLang 0.5.23 without its CUDA stack, a CPU stand-in for
# sgl_kernel (only where no GPU is present), test tools, and cedar itself (editable).
# A stamp file makes a second run return within seconds.
#
# The terminal gets one line per step, then "done". Every step's full output (pip's resolver
# report on SGLang's CUDA-only dependencies, left out on purpose, and any index warnings of this
# machine's pip configuration) goes to .venv/setup.log; a failing step's output is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
STAMP=$VENV/.cedar-setup-v1
HASH=$(cat scripts/setup.sh scripts/setup_steps.sh scripts/requirements-sglang-cpu.txt pyproject.toml | sha256sum | cut -c1-16)
source scripts/setup_steps.sh

build_kernels() {
  # NOTE: Cedar's C++ CPU kernels, into torch's extension cache (~15 s; a no-op when the source
  # is unchanged). Where no compiler works the server runs its batched torch path instead.
  quiet "$VENV/bin/python" -m cedar.kernels.cpu_ext || {
    rm -f "$STEP_OUTPUT"
    echo "[setup] WARNING: C++ CPU kernels not built (decode runs the slower torch path); see $SETUP_LOG"
  }
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  SETUP_LOG=$VENV/setup-check.log
  : > "$SETUP_LOG"
  build_kernels
  exit 0
fi
mkdir -p "$VENV"
SETUP_LOG=$VENV/setup.log
: > "$SETUP_LOG"
echo "[setup] installing into $VENV/ (full log: $SETUP_LOG)"
[ -x "$VENV/bin/python" ] || step "Python venv ($("$PY" --version 2>&1))" "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
step "pip, setuptools, wheel" $PIP install --upgrade pip setuptools wheel
step "torch 2.14.1 (+ triton 3.8)" $PIP install "torch==2.14.1" "torchvision==0.29.1" "triton==3.8.0"
# NOTE: --no-deps, then SGLang's own list minus its CUDA-only packages: pip reports those as
# missing (into the log); they are left out on purpose
step "SGLang 0.5.23 runtime (no CUDA stack)" $PIP install --no-deps "sglang==0.5.23"
step "SGLang's CPU dependencies" $PIP install -r scripts/requirements-sglang-cpu.txt
step "sglang-router 0.3.2 (cedar serve --replicas)" $PIP install --no-deps "sglang-router==0.3.2"
step "test and plot tools (pytest, hypothesis, matplotlib, safetensors, psutil)" \
  $PIP install pytest hypothesis matplotlib safetensors psutil
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # NOTE: never install the stand-in beside a real sgl_kernel (GPU machines use the real one).
  if ! "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('sgl_kernel') else 1)" 2>/dev/null; then
    step "sgl_kernel CPU stand-in" $PIP install --no-deps ./scripts/sgl_kernel_cpu_stub
  fi
fi
step "cedar (editable)" $PIP install --no-deps -e .
echo "[setup] C++ CPU kernels"
build_kernels
echo "$HASH" > "$STAMP"
echo "[setup] done"
