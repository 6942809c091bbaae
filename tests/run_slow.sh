#!/usr/bin/env bash
# The long forms of the reliability suite (what the README's Reliability
# figures come from). Usage: tests/run_slow.sh [MINUTES]   (default 120)
# The time is shared out: 40% random SIGKILLs of ckptd, 20% kills at every
# kill point, 15% fuzzing (the three targets), 10% power-loss images and
# fault injection on the real store, 5% ckpt_stress; then the TSan build's
# unit tests and every test labelled slow. Seeds are printed; CKPT_SEED fixes them.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
minutes=${1:-120}
"$top/deploy/install_deps.sh"
"$top/deploy/build.sh" "$top/build"
export CKPT_BUILD_DIR="$top/build"
seed=${CKPT_SEED:-$(date +%s)}
share() { awk -v m="$minutes" -v f="$1" 'BEGIN { printf "%.1f", m * f }'; }

echo "== ckptd SIGKILLed at random moments for $(share 0.4) min (seed $seed)"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --kills=1000000 --minutes="$(share 0.4)" \
  --seed="$seed"
echo "== ckptd killed at every kill point for $(share 0.2) min (seed $((seed + 1)))"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --whitebox --kills=1000000 \
  --minutes="$(share 0.2)" --seed=$((seed + 1))
echo "== fuzzing, three targets for $(share 0.15) min together"
"$top/tests/fuzz/run_fuzz.sh" "$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 * 0.05 }')"
echo "== power-loss images and fault injection on the real store"
(cd "$top/build" && CKPT_FAULT_ITERATIONS=$((minutes * 20)) ./tests/daemon/store/fault_test)
echo "== ckpt_stress for $(share 0.05) min"
/usr/bin/python3 "$top/tests/integration/test_stress.py" \
  --seconds="$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 * 0.05 }')" --seed="$seed"
echo "== TSan build: unit tests"
CKPT_SANITIZE_CTEST_ARGS="-L unit" "$top/tests/sanitize.sh" thread
echo "== tests labelled slow"
(cd "$top/build" && ctest -L slow --output-on-failure --no-tests=ignore)
