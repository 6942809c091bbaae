#!/usr/bin/env bash
# Sanitizer builds of ckptd with the unit and integration tests (docs/reliability.md,
# sanitizers). Usage:
#
#   tests/sanitize.sh [address|thread|all]      (default: all)
#
# address: ASan + UBSan (-DCKPT_SANITIZE=address) in <repo>/build-asan; with
#          clang also the libFuzzer targets (-DCKPT_FUZZ=ON), so that
#          tests/fuzz/run_fuzz.sh can run them from this build
#          (CKPT_FUZZ_BUILD_DIR=<repo>/build-asan CKPT_FUZZ_SKIP_BUILD=1)
# thread:  TSan         (-DCKPT_SANITIZE=thread)  in <repo>/build-tsan
# Both build through deploy/build.sh (Ninja, ccache) with clang-14 when it is
# installed (else gcc), CUDA off, -O1 and line tables only (CMakeLists.txt),
# and run `ctest -L 'unit|integration' -LE 'slow|gpu'`.
# Environment: CKPT_SANITIZE_BUILD_ROOT (default <repo>) holds the build
# directories; CKPT_SANITIZE_JOBS (default 2) is ctest's -j;
# CKPT_SANITIZE_CTEST_ARGS adds ctest arguments (e.g. -R store_test).
#
# Left out by name (CKPT_SANITIZE_EXCLUDE overrides):
#   python.torch_attach  loads the sanitized `ckpt` module into Debian's
#                        /usr/bin/python3, which has no sanitizer runtime
#                        (ASan/TSan must be the first library loaded).
# The Python integration tests that only start sanitized ckptd / ckptctl /
# trainer processes do run: the sanitizer options below reach those processes
# through the environment, and a report makes them exit non-zero.
#
# Every sanitizer report goes to <build>/sanitizer-reports/ (log_path), not
# to stderr: daemons started by the tests write their stderr into temp logs
# and some tests do not check their exit status, so a report there would
# otherwise be lost. The reports are printed at the end and fail the run.
#
# Exit status: 0 when every selected build and test passed with no report.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
kinds=${1:-all}
case "$kinds" in
  address | thread) ;;
  all) kinds="address thread" ;;
  *) echo "usage: $0 [address|thread|all]" >&2; exit 2 ;;
esac
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ckpt-ccache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
root=${CKPT_SANITIZE_BUILD_ROOT:-$top}
jobs=${CKPT_SANITIZE_JOBS:-2}
exclude=${CKPT_SANITIZE_EXCLUDE:-^python\.torch_attach$}

# Reports stop the process (halt_on_error) with a distinct exit code, so a
# test fails even where its harness only checks "non-zero". Leak checking is
# on (LeakSanitizer runs at exit of every ASan process).
asan_options="halt_on_error=1:abort_on_error=0:exitcode=66:detect_leaks=1"
asan_options+=":strict_init_order=1:check_initialization_order=1"
lsan_options="print_suppressions=0"
ubsan_options="halt_on_error=1:print_stacktrace=1:exitcode=67"
# TSan goes on after a report (every race of a run is listed) and still exits 68.
tsan_options="halt_on_error=0:exitcode=68:second_deadlock_stack=1:history_size=4"
tsan_options+=":suppressions=$top/tests/tsan.supp:print_suppressions=0"

# clang-14 builds this tree about a third faster than gcc and can add the
# fuzz targets to the ASan build; both sanitizers work with either compiler.
compiler=()
fuzz=()
if command -v clang-14 >/dev/null && command -v clang++-14 >/dev/null; then
  compiler=(-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14)
  fuzz=(-DCKPT_FUZZ=ON)
fi

status=0
timings=()
for kind in $kinds; do
  extra=("${compiler[@]}")
  case $kind in
    address) dir=$root/build-asan; extra+=("${fuzz[@]}") ;;
    thread) dir=$root/build-tsan ;;
  esac
  echo "== $kind: build ($dir)"
  t0=$(date +%s)
  if ! "$top/deploy/build.sh" "$dir" -DCKPT_SANITIZE="$kind" -DCKPT_WITH_CUDA=OFF "${extra[@]}"; then
    echo "== $kind: BUILD FAILED"
    status=1
    timings+=("$kind: build failed after $(($(date +%s) - t0)) s")
    continue
  fi
  t1=$(date +%s)
  echo "== $kind: tests (ctest -L 'unit|integration' -LE 'slow|gpu' -E '$exclude')"
  reports=$dir/sanitizer-reports
  rm -rf "$reports"
  mkdir -p "$reports"
  rc=0
  # shellcheck disable=SC2086
  (cd "$dir" && \
    ASAN_OPTIONS="$asan_options:log_path=$reports/asan" LSAN_OPTIONS=$lsan_options \
    UBSAN_OPTIONS="$ubsan_options:log_path=$reports/ubsan" \
    TSAN_OPTIONS="$tsan_options:log_path=$reports/tsan" \
    ctest -L 'unit|integration' -LE 'slow|gpu' -E "$exclude" --output-on-failure \
      --timeout 1800 -j"$jobs" ${CKPT_SANITIZE_CTEST_ARGS:-}) || rc=$?
  t2=$(date +%s)
  nreports=$(find "$reports" -type f | wc -l)
  if [ "$nreports" != 0 ]; then
    echo "== $kind: $nreports sanitizer report(s) in $reports"
    for f in "$reports"/*; do
      echo "---- $f"
      head -n 80 "$f"
    done
  fi
  [ "$rc" = 0 ] && [ "$nreports" = 0 ] || status=1
  timings+=("$kind: build $((t1 - t0)) s, tests $((t2 - t1)) s, ctest exit $rc, reports $nreports")
done
echo "== sanitize.sh summary"
printf '%s\n' "${timings[@]}"
exit $status
