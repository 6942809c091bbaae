#!/usr/bin/env bash
# Configures and builds ckptd. Usage: deploy/build.sh [BUILD_DIR] [extra cmake args...]
# CUDA is used when /usr/local/cuda (or nvcc on PATH) exists; -DCKPT_WITH_CUDA=OFF disables it.
# The Python module and the Python tests use the project's virtual environment
# (<repo>/.venv or $CKPT_VENV, made by deploy/install_deps.sh) when it exists,
# else /usr/bin/python3; $CKPT_PYTHON names another interpreter.
#
# Environment (all optional; unset, the whole tree is built with ninja's output on stdout):
#   CKPT_BUILD_TARGETS  space-separated targets to build instead of all of them
#   CKPT_BUILD_QUIET=1  send the build output to BUILD_DIR.build.log, print one line
#                       naming it, and print its tail only when the build fails
#
# ccache, when installed, is the compiler launcher. CCACHE_BASEDIR (the repository
# top unless set) and CCACHE_NOHASHDIR=true keep absolute paths and the build
# directory out of the cache keys, so a second clone of the repository at another
# path hits the cache the first one filled (same CCACHE_DIR).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$top/build}
shift || true
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
            -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$top}
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-true}
fi
python=${CKPT_PYTHON:-}
if [ -z "$python" ]; then
  python=/usr/bin/python3
  if [ -x "${CKPT_VENV:-$top/.venv}/bin/python" ]; then python=${CKPT_VENV:-$top/.venv}/bin/python; fi
fi
cuda=()
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  cuda=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
cmake -S "$top" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE="$python" "${launcher[@]}" "${cuda[@]}" "$@" >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep -E "ckptd: CUDA support" "$build.configure.log" || true

targets=()
if [ -n "${CKPT_BUILD_TARGETS:-}" ]; then
  read -r -a names <<<"$CKPT_BUILD_TARGETS"
  targets=(--target "${names[@]}")
fi
if [ "${CKPT_BUILD_QUIET:-0}" = 1 ]; then
  log=$build.build.log
  echo "build: ${CKPT_BUILD_TARGETS:-all targets} in $build (log: $log)"
  if ! cmake --build "$build" -j"$(nproc)" "${targets[@]}" >"$log" 2>&1; then
    echo "build failed; the last 40 lines of $log:"
    tail -n 40 "$log"
    exit 1
  fi
else
  cmake --build "$build" -j"$(nproc)" "${targets[@]}"
fi
