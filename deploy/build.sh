#!/usr/bin/env bash
# Configures and builds ckptd. Usage: deploy/build.sh [BUILD_DIR] [extra cmake args...]
# CUDA is used when /usr/local/cuda (or nvcc on PATH) exists; -DCKPT_WITH_CUDA=OFF disables it.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$top/build}
shift || true
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
            -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cuda=()
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  cuda=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
cmake -S "$top" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE=/usr/bin/python3 "${launcher[@]}" "${cuda[@]}" "$@" >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep -E "ckptd: CUDA support" "$build.configure.log" || true
cmake --build "$build" -j"$(nproc)"
