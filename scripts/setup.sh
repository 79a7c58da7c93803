#!/usr/bin/env bash
# One-command setup of .venv/ on a fresh machine (2 cores, no GPU, Python 3.11):
# torch 2.14.1 (+ triton 3.8), SGLang 0.5.23 without its CUDA stack, a CPU stand-in for
# sgl_kernel (only where no GPU is present), test tools, and cedar itself (editable).
# A stamp file makes a second run return within seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
STAMP=$VENV/.cedar-setup-v1
HASH=$(cat scripts/setup.sh scripts/requirements-sglang-cpu.txt pyproject.toml | sha256sum | cut -c1-16)
build_kernels() {
  # NOTE: Cedar's C++ CPU kernels, into torch's extension cache (~15 s; a no-op when the source
  # is unchanged). Where no compiler works the server runs its batched torch path instead.
  "$VENV/bin/python" -m cedar.kernels.cpu_ext >/dev/null 2>&1 || echo "[setup] WARNING: C++ CPU kernels not built"
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  build_kernels
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
echo "[setup] torch 2.14.1 (+ triton 3.8)"
$PIP install -q "torch==2.14.1" "torchvision==0.29.1" "triton==3.8.0"
echo "[setup] SGLang 0.5.23 runtime (no CUDA stack)"
$PIP install -q --no-deps "sglang==0.5.23"
$PIP install -q -r scripts/requirements-sglang-cpu.txt
echo "[setup] sglang-router 0.3.2 (cedar serve --replicas)"
$PIP install -q --no-deps "sglang-router==0.3.2"
$PIP install -q pytest hypothesis matplotlib safetensors psutil
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # NOTE: never install the stand-in beside a real sgl_kernel (GPU machines use the real one).
  if ! "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('sgl_kernel') else 1)" 2>/dev/null; then
    $PIP install -q --no-deps ./scripts/sgl_kernel_cpu_stub
  fi
fi
echo "[setup] cedar (editable)"
$PIP install -q --no-deps -e .
echo "[setup] C++ CPU kernels"
build_kernels
echo "$HASH" > "$STAMP"
echo "[setup] done"
