#!/usr/bin/env bash
# Runs the libFuzzer targets for SECONDS each and prints, per target, the
# executions, the corpus size and the crashes (docs/reliability.md, fuzzing).
#
#   tests/fuzz/run_fuzz.sh SECONDS [TARGET...]      TARGET: format index register
#
# First configures and builds <repo>/build-fuzz (clang-14, CKPT_FUZZ=ON, no
# CUDA) unless CKPT_FUZZ_SKIP_BUILD=1 (ctest sets it; tests/run.sh sets it
# with CKPT_FUZZ_BUILD_DIR=<repo>/build-asan, the ASan build of
# tests/sanitize.sh, which carries the fuzz targets). Environment:
#   CKPT_FUZZ_BUILD_DIR  build directory (default <repo>/build-fuzz)
#   CKPT_FUZZ_WORK       corpora and crash artifacts (default <build>/fuzz-work);
#                        corpora persist, so later runs start where earlier ones
#                        stopped (CI may cache this directory)
#   CKPT_FUZZ_ARGS       extra libFuzzer flags
# Exit status 0 when no target crashed, hung, leaked or ran out of memory;
# otherwise 1, with the reproducer under $CKPT_FUZZ_WORK/<target>/artifacts:
#   <build>/tests/fuzz/fuzz_<target> <artifact>    reruns it.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 SECONDS [format|index|register ...]" >&2
  exit 2
fi
seconds=$1
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(format index register)
build=${CKPT_FUZZ_BUILD_DIR:-$top/build-fuzz}
work=${CKPT_FUZZ_WORK:-$build/fuzz-work}

if [ "${CKPT_FUZZ_SKIP_BUILD:-0}" != 1 ]; then
  cc=$(command -v clang-14 || command -v clang || true)
  cxx=$(command -v clang++-14 || command -v clang++ || true)
  if [ -z "$cc" ] || [ -z "$cxx" ]; then
    echo "run_fuzz.sh: clang is needed (apt-get install clang-14 libclang-rt-14-dev)" >&2
    exit 2
  fi
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S "$top" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCKPT_FUZZ=ON -DCKPT_WITH_CUDA=OFF \
    -DPython3_EXECUTABLE=/usr/bin/python3 "${launcher[@]}" >"$build.configure.log" 2>&1 \
    || { cat "$build.configure.log"; exit 1; }
  cmake --build "$build" --target ckpt_fuzzers -j"$(nproc)"
fi

# Per target: libFuzzer flags beyond the common ones.
declare -A extra=(
  [format]="-max_len=32768 -dict=$top/tests/fuzz/format.dict"
  # -detect_leaks=0: RocksDB keeps per-process caches, so every input looks
  # like a leak and libFuzzer would run each one twice; LeakSanitizer still
  # checks the whole process when it exits.
  [index]="-max_len=4096 -detect_leaks=0 -dict=$top/tests/fuzz/index.dict"
  [register]="-max_len=16384"
)

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
summary=()
for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/fuzz_$t
  if [ -z "${extra[$t]+x}" ] || [ ! -x "$bin" ]; then
    echo "run_fuzz.sh: no fuzz target '$t' ($bin)" >&2
    exit 2
  fi
  dir=$work/$t
  rm -rf "$dir/seeds" "$dir/artifacts"
  mkdir -p "$dir/corpus" "$dir/seeds" "$dir/artifacts"
  CKPT_FUZZ_WRITE_SEEDS="$dir/seeds" "$bin" >/dev/null 2>&1
  log=$dir/last.log
  rc=0
  # shellcheck disable=SC2086
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/" ${extra[$t]} ${CKPT_FUZZ_ARGS:-} \
    "$dir/corpus" "$dir/seeds" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  corpus=$(find "$dir/corpus" -type f | wc -l)
  crashes=$(find "$dir/artifacts" -type f | wc -l)
  line="fuzz $t: ${execs:-0} executions in ${seconds} s (${rate:-?}/s), corpus ${corpus}, crashes ${crashes}, exit ${rc}"
  echo "$line"
  summary+=("$line")
  if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
    failed=1
    echo "---- $t: last lines of $log"
    tail -n 60 "$log"
    find "$dir/artifacts" -type f -printf '  reproducer: %p\n'
  fi
done
echo "== fuzz summary"
printf '%s\n' "${summary[@]}"
exit $failed
