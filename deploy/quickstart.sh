#!/usr/bin/env bash
# ckptd quickstart on a fresh Debian 12 machine:
#   installs what is missing, builds, starts ckptd on ./data/quickstart, runs
#   the example trainer, kills it with SIGKILL mid-run, restores the composite
#   checkpoint in a new trainer process, and prints the restore summary.
# Builds only what it runs (ckptd, ckptctl, ckpt_example_trainer); the build
# output goes to build.build.log next to build/, and its tail is printed only
# when the build fails. CKPT_SKIP_DEPS=1 skips deploy/install_deps.sh (which
# needs root or sudo when a package is missing).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ckpt-ccache}
# The quickstart's trainer is the C++ example: it needs no Python environment.
if [ "${CKPT_SKIP_DEPS:-0}" != 1 ]; then CKPT_NO_VENV=1 "$top/deploy/install_deps.sh"; fi
echo "== build (ckptd, ckptctl, ckpt_example_trainer)"
start=$SECONDS
CKPT_BUILD_TARGETS="ckptd ckptctl ckpt_example_trainer" CKPT_BUILD_QUIET=1 \
  "$top/deploy/build.sh" "$top/build"
echo "   built in $((SECONDS - start)) s"

bin=$top/build
dir=$top/data/quickstart
rm -rf "$dir"
mkdir -p "$dir"
sock=$dir/ckptd.sock
job=quickstart

echo "== starting ckptd (data in $dir)"
"$bin/daemon/ckptd" --socket="$sock" --data_dir="$dir/store" --staging_pool_bytes=$((256 << 20)) \
  --metrics_address=127.0.0.1:0 \
  >"$dir/ckptd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$dir/ckptd.log"; exit 1; }

trainer=("$bin/tools/ckpt_example_trainer" --socket="$sock" --job=$job --layers=12
         --layer-bytes=1M,4M,2M --policy=explicit)
echo "== training (12 layers, explicit per-layer schedule); SIGKILL after ~150 steps"
"${trainer[@]}" --steps=100000 --compute-ms=5 --log="$dir/steps.jsonl" >/dev/null 2>&1 &
pid=$!
steps_logged() { if [ -f "$dir/steps.jsonl" ]; then wc -l <"$dir/steps.jsonl"; else echo 0; fi; }
while [ "$(steps_logged)" -lt 150 ]; do
  kill -0 $pid 2>/dev/null || { echo "trainer exited early"; exit 1; }
  sleep 0.1
done
kill -9 $pid
wait $pid 2>/dev/null || true
echo "   trainer killed at step $(tail -n1 "$dir/steps.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')"

echo "== what ckptd holds"
"$bin/tools/ckptctl" --socket="$sock" layers $job

echo "== new trainer process: composite restore, verified against the killed run's log"
echo "   (the newest durable step: steps ckptd had staged before the kill are written first)"
"${trainer[@]}" --steps=0 --restore --verify-log="$dir/steps.jsonl"

kill -TERM $daemon
wait $daemon || true
trap - EXIT
echo "== done (ckptd log: $dir/ckptd.log)"
