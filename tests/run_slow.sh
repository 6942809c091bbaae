#!/usr/bin/env bash
# The long forms of the reliability suite (what the README's Reliability
# figures come from). Usage: tests/run_slow.sh [MINUTES]   (default 120)
# The time is shared out: 40% random SIGKILLs of ckptd, 20% kills at every
# kill point, 15% fuzzing (the three targets), 10% power-loss images and
# fault injection on the real store, 5% ckpt_stress; then every test labelled
# slow. The ASan+UBSan build (tests/sanitize.sh address) is made first: it
# carries the fuzz targets. Seeds are printed; CKPT_SEED fixes them.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
minutes=${1:-120}
"$top/deploy/install_deps.sh"
"$top/deploy/build.sh" "$top/build"
export CKPT_BUILD_DIR="$top/build"
seed=${CKPT_SEED:-$(date +%s)}
echo "== ASan+UBSan build (and its unit and integration tests)"
"$top/tests/sanitize.sh" address
fuzz_env=()
if [ -x "$top/build-asan/tests/fuzz/fuzz_format" ]; then
  fuzz_env=(CKPT_FUZZ_BUILD_DIR="$top/build-asan" CKPT_FUZZ_SKIP_BUILD=1)
fi
share() { awk -v m="$minutes" -v f="$1" 'BEGIN { printf "%.1f", m * f }'; }

echo "== ckptd SIGKILLed at random moments for $(share 0.4) min (seed $seed)"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --kills=1000000 --minutes="$(share 0.4)" \
  --seed="$seed"
echo "== ckptd killed at every kill point for $(share 0.2) min (seed $((seed + 1)))"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --whitebox --kills=1000000 \
  --minutes="$(share 0.2)" --seed=$((seed + 1))
echo "== fuzzing, three targets for $(share 0.15) min together"
env "${fuzz_env[@]}" "$top/tests/fuzz/run_fuzz.sh" "$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 * 0.05 }')"
echo "== power-loss images and fault injection on the real store"
(cd "$top/build" && CKPT_FAULT_ITERATIONS=$((minutes * 20)) ./tests/daemon/store/fault_test)
echo "== ckpt_stress for $(share 0.05) min"
/usr/bin/python3 "$top/tests/integration/test_stress.py" \
  --seconds="$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 * 0.05 }')" --seed="$seed"
echo "== a StepDone in flight at every stop of ckptd, 20 times per client"
CKPT_SHUTDOWN_IN_FLIGHT_RUNS=20 "$top/.venv/bin/python" "$top/tests/integration/test_shutdown.py" \
  || CKPT_SHUTDOWN_IN_FLIGHT_RUNS=20 /usr/bin/python3 "$top/tests/integration/test_shutdown.py"
echo "== tests labelled slow"
(cd "$top/build" && ctest -L slow --output-on-failure --no-tests=ignore)
