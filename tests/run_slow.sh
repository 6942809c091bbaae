#!/usr/bin/env bash
# The long forms of the crash tests (what the README's crash figures come
# from), plus every test labelled slow. Usage: tests/run_slow.sh [KILLS] [KILL_POINT_DEATHS]
# Defaults: 1000 random kills (~20 minutes) and 300 kill-point deaths.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
kills=${1:-1000}
point_deaths=${2:-300}
"$top/deploy/install_deps.sh"
"$top/deploy/build.sh" "$top/build"
export CKPT_BUILD_DIR="$top/build"
seed=${CKPT_SEED:-$(date +%s)}
echo "== ckptd SIGKILLed at random moments: $kills kills (seed $seed)"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --kills="$kills" --seed="$seed"
echo "== ckptd killed at commit-protocol kill points: $point_deaths deaths (seed $((seed + 1)))"
/usr/bin/python3 "$top/tests/crash/crash_driver.py" --kills="$point_deaths" --kill-points \
  --policy=all --seed=$((seed + 1))
echo "== tests labelled slow"
(cd "$top/build" && ctest -L slow --output-on-failure --no-tests=ignore)
