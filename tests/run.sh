#!/usr/bin/env bash
# Installs what is missing, builds ckptd, and runs every test that is not
# labelled slow or gpu:
#   1. the default build (CUDA used when the toolkit is present): every test;
#      then the Python tests that matter most across PyTorch releases again
#      under the newest PyTorch on PyPI (tests/torch_newest.sh);
#   2. an ASan+UBSan build without CUDA (so the no-CUDA build is checked too):
#      the unit and integration tests (tests/sanitize.sh address);
#   3. the libFuzzer targets of that build, a few seconds each
#      (tests/fuzz/run_fuzz.sh);
#   4. a TSan build: the unit and integration tests (tests/sanitize.sh thread).
# The sanitizer builds use clang-14 at -O1 with line tables only, which is
# what keeps three builds inside CI's 30 minutes on two cores.
# tests/run_slow.sh runs the long forms.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ckpt-ccache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$top/deploy/install_deps.sh"
start=$SECONDS

echo "== build (CUDA auto-detected)"
"$top/deploy/build.sh" "$top/build"
echo "== tests (default build)"
(cd "$top/build" && ctest -LE 'slow|gpu' --output-on-failure --timeout 900 -j2)
if [ -z "${CKPT_NO_VENV:-}" ]; then
  echo "== the newest PyTorch on PyPI: ckpt.dcp and ckpt.torch tests"
  "$top/tests/torch_newest.sh" "$top/build"
fi

echo "== ASan+UBSan build without CUDA: unit and integration tests"
"$top/tests/sanitize.sh" address
echo "== fuzzers, 5 s each"
fuzz_env=()
if [ -x "$top/build-asan/tests/fuzz/fuzz_format" ]; then
  fuzz_env=(CKPT_FUZZ_BUILD_DIR="$top/build-asan" CKPT_FUZZ_SKIP_BUILD=1)
fi
env "${fuzz_env[@]}" "$top/tests/fuzz/run_fuzz.sh" 5
echo "== TSan build without CUDA: unit and integration tests"
"$top/tests/sanitize.sh" thread
echo "== tests/run.sh passed in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
