#!/usr/bin/env bash
# Packs the GPU checks of a CUDA build into .gpu-bundle/ for a GPU machine
# that has a driver and the CUDA 13 runtime but none of our Debian libraries
# (tests/gpu/run_on_gpu.sh runs them there).
#
# Usage: tests/gpu/make_bundle.sh [BUILD_DIR]     (default: build)
#
# The binaries are stripped and keep their build-tree paths
# (.gpu-bundle/daemon/ckptd, .gpu-bundle/tests/gpu/ckpt_gpu_trainer, ...), so
# the bundle works as CKPT_BUILD_DIR for the tests. Every shared library they
# load goes to .gpu-bundle/lib, except glibc's, libgcc_s, libstdc++ (the GPU
# machine's are newer, hence compatible) and libcuda (the driver's own).
# Fails when the bundle exceeds 60 MiB, when the bundled Python package does
# not import with its interpreter, or when the GPU scripts do not parse.
#
# It also carries the Python package `ckpt` built for the GPU machine's
# interpreter (Python 3.12 there; .gpu-bundle/python/ckpt, for
# tests/gpu/torch_gpu_check.py): compiled in BUILD_DIR-py with the headers of
# $CKPT_BUNDLE_PYTHON (default: a python3.12 on PATH or pyenv's) and the
# project's pybind11 (.venv). CKPT_BUNDLE_PYTHON=none leaves it out.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$top/build}" && pwd)
bundle=$top/.gpu-bundle
max_bytes=$((60 << 20))

# Build-tree paths, as the tests expect them under CKPT_BUILD_DIR.
binaries=(
  daemon/ckptd
  tools/ckptctl
  tests/gpu/ckpt_gpu_trainer
  tests/gpu/ckpt_gpu_bench
  tests/gpu/gpu_snapshot_test
  tests/kernels/drift_cuda_test
)
for b in "${binaries[@]}"; do
  if [ ! -x "$build/$b" ]; then
    echo "make_bundle: $build/$b is missing; build it first:" >&2
    echo "  ninja -C $build ckptd ckptctl ckpt_gpu_trainer ckpt_gpu_bench gpu_snapshot_test drift_cuda_test" >&2
    exit 1
  fi
done

# glibc (all of its libraries), the compiler runtime and the driver.
skip='^(linux-vdso|ld-linux|libc|libm|libmvec|libdl|libpthread|librt|libresolv|libutil|libanl|libnsl|libBrokenLocale|libthread_db|libgcc_s|libstdc\+\+|libcuda)\.so'

rm -rf "$bundle"
mkdir -p "$bundle/lib"
declare -A libs=()
for b in "${binaries[@]}"; do
  mkdir -p "$bundle/$(dirname "$b")"
  strip --strip-all -o "$bundle/$b" "$build/$b"
  # ldd lists the transitive closure: "soname => path (address)".
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ "$name" =~ $skip ]] && continue
    if [ "$path" = "not" ]; then
      echo "make_bundle: $b needs $name, which is not found here" >&2
      exit 1
    fi
    libs[$name]=$path
  done < <(ldd "$build/$b")
done
# The Python package for the GPU machine's interpreter.
py=${CKPT_BUNDLE_PYTHON:-}
if [ -z "$py" ]; then
  # pyenv's shims answer for versions that are not selected: try each.
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
                   "$(command -v python3.12 || true)"; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys' 2>/dev/null; then
      py=$candidate
      break
    fi
  done
fi
if [ -n "$py" ] && [ "$py" != none ]; then
  pybind11_dir=$("$top/.venv/bin/python" -m pybind11 --cmakedir)
  CKPT_PYTHON=$py CKPT_BUILD_TARGETS=ckpt_python CKPT_BUILD_QUIET=1 \
    "$top/deploy/build.sh" "$build-py" -DCKPT_BUILD_TESTS=OFF -Dpybind11_DIR="$pybind11_dir"
  mkdir -p "$bundle/python"
  cp -r "$build-py/python/ckpt" "$bundle/python/ckpt"
  for so in "$bundle"/python/ckpt/_ckpt.*.so; do
    strip --strip-unneeded "$so"
    while read -r name arrow path _; do
      [ "$arrow" = "=>" ] || continue
      [[ "$name" =~ $skip ]] && continue
      [ "$path" = "not" ] && { echo "make_bundle: the Python module needs $name" >&2; exit 1; }
      libs[$name]=$path
    done < <(ldd "$so")
  done
  echo "make_bundle: the Python package for $("$py" --version 2>&1)"
elif [ "$py" != none ]; then
  echo "make_bundle: no python3.12 here: the bundle has no Python package" \
       "(set CKPT_BUNDLE_PYTHON)" >&2
fi
for name in "${!libs[@]}"; do
  strip --strip-unneeded -o "$bundle/lib/$name" "${libs[$name]}"
done
# The bundled package must import with the interpreter it is for, its
# libraries taken from the bundle (as run_on_gpu.sh will).
if [ -d "$bundle/python/ckpt" ]; then
  if ! version=$(LD_LIBRARY_PATH="$bundle/lib" PYTHONPATH="$bundle/python" "$py" -c \
                 'import ckpt; print(ckpt.__version__)' 2>&1); then
    echo "make_bundle: the bundled Python package does not import: $version" >&2
    exit 1
  fi
  echo "make_bundle: the bundled package imports (ckpt $version)"
fi
# The scripts that will run there, parsed here: a syntax error must not
# cost device time.
for s in run_on_gpu.sh sandbox_check.sh; do
  bash -n "$top/tests/gpu/$s" || { echo "make_bundle: tests/gpu/$s does not parse" >&2; exit 1; }
done

{
  echo "built from $(git -C "$top" rev-parse HEAD 2>/dev/null || echo unknown)" \
       "($(git -C "$top" status --porcelain 2>/dev/null | wc -l) uncommitted changes)"
  echo "build dir $build, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for b in "${binaries[@]}"; do echo "$b"; done
  [ -d "$bundle/python/ckpt" ] && ls "$bundle/python/ckpt" | sed 's|^|python/ckpt/|'
  for name in "${!libs[@]}"; do echo "lib/$name <- ${libs[$name]}"; done | sort
} >"$bundle/MANIFEST"

bytes=$(du -sb "$bundle" | cut -f1)
echo "make_bundle: $bundle: ${#binaries[@]} binaries, ${#libs[@]} libraries," \
     "$((bytes >> 20)) MiB ($bytes bytes)"
if [ "$bytes" -gt "$max_bytes" ]; then
  echo "make_bundle: larger than $((max_bytes >> 20)) MiB" >&2
  exit 1
fi
echo "make_bundle: on the GPU machine (carry .gpu-bundle with the working tree):"
echo "  OUT=\$OUT tests/gpu/run_on_gpu.sh      # at most 280 s; logs in \$OUT/gpu-logs.tar.gz"
