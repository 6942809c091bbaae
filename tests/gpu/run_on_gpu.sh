#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine: at most 280
# seconds in all (CKPT_GPU_BUDGET_S), every step under `timeout`, steps
# skipped with a line saying so when the time left is below what they need.
# Uses .gpu-bundle/ (tests/gpu/make_bundle.sh, made on the build machine) or,
# with CKPT_BUILD_DIR=build, a full CUDA build.
#
#   OUT=/some/dir tests/gpu/run_on_gpu.sh
#
# Steps, in order of priority (timeout cap / least time worth starting, s):
#   nvidia_smi         10 / 5    the device; without one every step is skipped
#   drift_cuda_test    30 / 10   the CUDA drift kernel against the CPU reference
#   gpu_snapshot_test  90 / 25   CUDA IPC handover end to end (train, restore
#                                bit-exact in a new process, mappings closed)
#   torch_exact        60 / 25   tests/gpu/torch_gpu_check.py --part exact:
#                                ckpt.torch SIGKILL/restore bit-exact on CUDA
#                                tensors, default allocator and expandable
#                                segments (bit-exact, or the refusal of pages that allow no export)
#   torch_gpt2        100 / 45   --part gpt2: a 124M GPT-2-sized loop, no
#                                checkpointing vs ckptd all / layercheck vs DCP
#                                async_save; stall per step; D2H vs pinned peak
#   torch_ddp          60 / 25   --part ddp: two DDP ranks on the one GPU (gloo)
#   torch_dcp          30 / 15   tests/gpu/dcp_gpu_check.py: ckpt.dcp save, async
#                                save and load of CUDA tensors, bit-exact
#   sandbox            60 / 25   tests/gpu/sandbox_check.sh: ckptd under the
#                                unit's sandbox, a trainer of another uid
#   gpu_bench          20 / 8    ckpt_gpu_bench: drift kernel vs a D2D copy
#   trainer_bench      45 / 20   ckpt_gpu_trainer --mode=bench, 1 GiB snapshots
#
# Disk: every step runs with TMPDIR set to a data directory of its own under
# one temporary directory (CKPT_GPU_TMP, else TMPDIR, else /tmp), removed
# when the step ends; every ckptd keeps one checkpoint event and DCP its
# newest checkpoint; `df` of that directory is printed before and after.
# Logs: everything goes into ONE archive, $OUT/gpu-logs.tar.gz (without OUT:
# beside the temporary directory), with the summary, which is also printed.
# The archive is rewritten after every step (steps.txt: the results so far),
# so what ran comes back even when this script is killed.
#
# Signals: each step runs as `timeout ... & wait`, so a SIGTERM or SIGINT
# to this script runs its trap at once (bash defers a trap while a
# foreground command runs); the trap kills the step's process group (timeout
# makes one of its own, which a signal to this script's group misses),
# writes the archive and removes the temporary directory.
#
# Exit status: 0 when every step that could run passed (steps skipped for
# want of a device count as passed: a dry run on a CPU machine exits 0), 1
# when a step failed, timed out or was skipped for want of time, 2 when no
# build was found. A missed performance goal is reported, not failed.
#
# Environment: CKPT_BUILD_DIR (default .gpu-bundle), CKPT_GPU_BUDGET_S
# (default 280), CKPT_GPU_TMP, CKPT_BENCH_COMPUTE_MS (simulated compute per
# step of the trainer bench's fence loop, default 100).
set -uo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top" || exit 2
start=$SECONDS
budget=${CKPT_GPU_BUDGET_S:-280}
compute_ms=${CKPT_BENCH_COMPUTE_MS:-100}

bin=$(cd "${CKPT_BUILD_DIR:-.gpu-bundle}" 2>/dev/null && pwd) || {
  echo "run_on_gpu: no ${CKPT_BUILD_DIR:-.gpu-bundle}; run tests/gpu/make_bundle.sh on the build machine" >&2
  exit 2
}
export CKPT_BUILD_DIR=$bin
if [ -d "$bin/lib" ]; then  # the bundle's libraries first, the toolkit's after
  export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -d /usr/local/cuda/lib64 ]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
fi

tmp_base=${CKPT_GPU_TMP:-${TMPDIR:-/tmp}}
work=$(mktemp -d "$tmp_base/ckpt-gpu.XXXXXX") || exit 2
# Other uids may pass through (not list) it: the sandbox step's daemon and
# trainer use their step's data directory below it.
chmod 0711 "$work"
logs=$work/logs
mkdir -p "$logs" "$work/data"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  archive=$OUT/gpu-logs.tar.gz
else
  archive=$tmp_base/ckpt-gpu-logs.$$.tar.gz
fi

df_line() { df -Ph "$work" 2>/dev/null | awk 'NR == 2 { print $4 " free of " $2 " on " $6 " (" $1 ")" }'; }
df_before=$(df_line)
echo "run_on_gpu: binaries from $bin, temporary directory $work ($df_before), budget $budget s"
df -Ph "$work" >"$logs/df.log" 2>&1
[ -f "$bin/MANIFEST" ] && { head -2 "$bin/MANIFEST"; cp "$bin/MANIFEST" "$logs/MANIFEST"; }

failed=0
order=()
declare -A result=() took=()

step_pid=  # the running step's timeout: the leader of the step's process group

# save_logs: the archive, from the logs as they are now (at most the last
# 4 MiB of any file); written beside and renamed, so a kill midway leaves
# the previous one whole.
save_logs() {
  find "$logs" -type f -size +4M -exec sh -c 'tail -c 4194304 "$1" >"$1.tail" && mv "$1.tail" "$1"' sh {} \;
  tar -czf "$archive.part" -C "$work" logs 2>/dev/null && mv -f "$archive.part" "$archive"
}

# finish: the running step killed, the archive, whatever happened; then the
# temporary directory goes.
# shellcheck disable=SC2317  # run by the EXIT trap
finish() {
  trap '' TERM INT
  if [ -n "$step_pid" ]; then
    save_logs
    kill -TERM -- "-$step_pid" 2>/dev/null || kill -TERM "$step_pid" 2>/dev/null
    for _ in $(seq 1 40); do  # 4 s for the step's own clean-up (sandbox_check.sh's)
      kill -0 -- "-$step_pid" 2>/dev/null || kill -0 "$step_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL -- "-$step_pid" 2>/dev/null
    kill -KILL "$step_pid" 2>/dev/null
    echo "run_on_gpu: stopped the running step after $((SECONDS - start)) s" | tee -a "$logs/steps.txt"
  fi
  if [ ! -f "$logs/summary.txt" ]; then
    { echo "run_on_gpu: ended early, after $((SECONDS - start)) s; the steps so far:"
      cat "$logs/steps.txt" 2>/dev/null; } >"$logs/summary.txt"
  fi
  if save_logs; then
    echo "run_on_gpu: logs in $archive ($(du -h "$archive" | cut -f1))"
  else
    rm -f "$archive.part"
    echo "run_on_gpu: could not write $archive" >&2
  fi
  rm -rf "$work"
}
trap finish EXIT
trap 'exit 1' TERM INT

# record NAME RESULT SECONDS
record() {
  order+=("$1")
  result[$1]=$2
  took[$1]=$3
  echo "== $1: $2"
  printf '%-18s %s (%s s)\n' "$1" "$2" "$3" >>"$logs/steps.txt"
  save_logs  # what ran so far comes back even if this script is killed
}

no_device=  # why there is no device, once nvidia_smi has run
no_torch=   # why the Python steps cannot run

# step NAME CAP MIN CMD...: CMD under timeout min(CAP, time left), with its
# output in $logs/NAME.log and TMPDIR a data directory of its own, removed
# after it; skipped when less than MIN seconds are left.
step() {
  local name=$1 cap=$2 min=$3
  shift 3
  if [ -n "$no_device" ]; then
    record "$name" "SKIPPED (no device: $no_device)" 0
    return 0
  fi
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$min" ]; then
    record "$name" "SKIPPED (out of time: $left s left, it needs at least $min)" 0
    failed=1
    return 0
  fi
  local limit=$cap
  # timeout's -k 5: a step that ignores SIGTERM still ends within the budget.
  [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
  [ "$limit" -ge 1 ] || limit=1  # timeout 0 would mean none
  echo "== $name (timeout ${limit} s; $left s of the budget left)"
  local dir=$work/data/$name t0=$SECONDS rc
  mkdir -p "$dir"
  # In the background and waited for: a signal's trap (finish) runs at once.
  TMPDIR=$dir CKPT_STEP_LIMIT_S=$limit timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  rc=$?
  step_pid=
  rm -rf "$dir"
  echo "after $name: $(df_line)" >>"$logs/df.log"
  local what
  case $rc in
    0) what=PASS ;;
    77)
      local why
      why=$(grep -m1 -o 'SKIPPED (.*)' "$logs/$name.log" | sed 's/^SKIPPED (//; s/)$//')
      [ -n "$why" ] || why=$(grep -v '^[[:space:]]*$' "$logs/$name.log" | tail -n 1 | cut -c1-150)
      what="SKIPPED (${why:-exit 77})" ;;
    124 | 137) what="TIMEOUT after $limit s"; failed=1 ;;
    *) what="FAIL (exit $rc)"; failed=1 ;;
  esac
  if [ "$rc" -eq 0 ] && grep -q "PASSED  \] 0 tests" "$logs/$name.log"; then
    what="SKIPPED (every test skipped itself)"
  fi
  record "$name" "$what" $((SECONDS - t0))
  grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/$name.log" | sed 's/^/   /'
  grep '^SUMMARY ' "$logs/$name.log" | sed 's/^SUMMARY /   /'
  [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || tail -n 15 "$logs/$name.log" | sed 's/^/   | /'
  return 0
}

# ---- 0. the device ----
if ! command -v nvidia-smi >/dev/null; then
  no_device="nvidia-smi not found"
  record nvidia_smi "SKIPPED (no device: nvidia-smi not found)" 0
else
  step nvidia_smi 10 5 sh -c 'nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv'
  if [ "${result[nvidia_smi]}" != PASS ]; then
    no_device="nvidia-smi failed: ${result[nvidia_smi]}"
  elif ! grep -q '^GPU [0-9]' "$logs/nvidia_smi.log"; then
    no_device="nvidia-smi lists no GPU"
  fi
fi
device=$(grep -m1 '^GPU [0-9]' "$logs/nvidia_smi.log" 2>/dev/null || echo "none (${no_device:-?})")

# ---- 1. the C++ GPU tests ----
step drift_cuda_test 30 10 "$bin/tests/kernels/drift_cuda_test" --gtest_brief=1
step gpu_snapshot_test 90 25 "$bin/tests/gpu/gpu_snapshot_test" --gtest_brief=1

# ---- 2-4. ckpt.torch on CUDA (the machine's python3, 3.12 with torch) ----
if [ -z "$no_device" ]; then
  if [ ! -d "$bin/python/ckpt" ]; then
    no_torch="no Python package in $bin/python (make_bundle.sh found no python3.12)"
  else
    timeout -k 2 60 python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print("torch", torch.__version__, "CUDA", torch.version.cuda)' \
      >"$logs/python.log" 2>&1 &
    step_pid=$!
    wait "$step_pid"
    prc=$?
    step_pid=
    probe=$(cat "$logs/python.log")
    if [ "$prc" -ne 0 ]; then
      no_torch="python3 has no torch with CUDA: $(echo "$probe" | tail -1)"
    else
      echo "run_on_gpu: python3 $(python3 --version 2>&1 | cut -d' ' -f2), $probe"
    fi
  fi
fi
torch_step() {
  local name=$1 cap=$2 min=$3
  shift 3
  if [ -n "$no_torch" ] && [ -z "$no_device" ]; then
    record "$name" "SKIPPED ($no_torch)" 0
    failed=1
    return 0
  fi
  step "$name" "$cap" "$min" env PYTHONPATH="$bin/python" PYTHONDONTWRITEBYTECODE=1 \
    python3 "$top/tests/gpu/torch_gpu_check.py" --build-dir "$bin" "$@"
}
torch_step torch_exact 60 25 --part exact
torch_step torch_gpt2 100 45 --part gpt2
torch_step torch_ddp 60 25 --part ddp
if [ -n "$no_torch" ] && [ -z "$no_device" ]; then
  record torch_dcp "SKIPPED ($no_torch)" 0
  failed=1
else
  step torch_dcp 30 15 env PYTHONPATH="$bin/python" PYTHONDONTWRITEBYTECODE=1 \
    python3 "$top/tests/gpu/dcp_gpu_check.py" --build-dir "$bin"
fi

# ---- 5. ckptd under the unit's sandbox, a trainer of another uid ----
if [ -n "$no_torch" ] && [ -z "$no_device" ]; then
  record sandbox "SKIPPED ($no_torch)" 0
  failed=1
else
  step sandbox 60 25 bash "$top/tests/gpu/sandbox_check.sh" --device cuda --build-dir "$bin" \
    --python "$(command -v python3 || echo python3)" --logs "$logs/sandbox"
fi

# ---- 6. the benchmarks of the C++ trainer ----
step gpu_bench 20 8 "$bin/tests/gpu/ckpt_gpu_bench"
# A fresh ckptd with 3 GiB of staging (three 1 GiB snapshots), then the
# trainer's benchmark; the ckptd goes with the step (timeout kills the group).
# --shutdown_grace_ms=0 and SIGKILL after 3 s: once the trainer has written
# its JSON, the stop must not eat the step's time (the grace would let the
# staged 1 GiB versions be written first), or a finished bench reads TIMEOUT.
# shellcheck disable=SC2016  # expanded by the inner shell
bench='
bin=$1 logs=$2 compute_ms=$3 dir=$TMPDIR
sock=$dir/ckptd.sock
"$bin/daemon/ckptd" --socket="$sock" --data_dir="$dir/data" --metrics_address= \
  --staging_pool_bytes=3221225472 --lock_staging_memory=false --keep_last_events=1 \
  --keep_every_steps=0 --gc_interval_s=1 --shutdown_grace_ms=0 >"$logs/ckptd_bench.log" 2>&1 &
pid=$!
stop_ckptd() {
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  kill -KILL $pid 2>/dev/null
  wait $pid
}
trap stop_ckptd EXIT
trap "exit 1" TERM INT
for _ in $(seq 1 300); do
  kill -0 $pid 2>/dev/null || { echo "ckptd exited; see ckptd_bench.log"; exit 1; }
  "$bin/tools/ckptctl" --socket="$sock" status >/dev/null 2>&1 && break
  sleep 0.1
done
"$bin/tests/gpu/ckpt_gpu_trainer" --mode=bench --socket="$sock" --job=bench --layers=4 \
  --layer-bytes=256M --compute-ms="$compute_ms" --snapshot-steps=3 --fence-steps=10 \
  --json-out="$logs/trainer_bench.json" &
wait $!
rc=$?
stop_ckptd
trap - EXIT
exit $rc
'
step trainer_bench 45 20 bash -c "$bench" bench "$bin" "$logs" "$compute_ms"

# ---- summary ----
# The value of "key": number in the last JSON line of FILE that has it.
jget() { grep -o "\"$2\":[-0-9.eE+]*" "$1" 2>/dev/null | tail -1 | cut -d: -f2; }
verdict() {
  [ -z "$1" ] && { echo "n/a"; return; }
  awk -v v="$1" -v t="$2" -v op="$3" \
    'BEGIN { ok = (op == "ge") ? (v + 0 >= t + 0) : (v + 0 <= t + 0); print ok ? "PASS" : "MISS" }'
}
gbs() { if [ -z "$1" ]; then echo "?"; else awk -v v="$1" 'BEGIN { printf "%.1f", (v + 0) / 1e9 }'; fi; }
num() { if [ -z "$1" ]; then echo "?"; else awk -v v="$1" -v f="$2" 'BEGIN { printf f, v + 0 }'; fi; }

tb=$logs/trainer_bench.log
gb=$logs/gpu_bench.log
{
  echo
  echo "==== ckptd GPU summary ===="
  echo "device:    $device"
  echo "budget:    $budget s, elapsed $((SECONDS - start)) s; temporary directory: $df_before before, $(df_line) after"
  for name in "${order[@]}"; do
    printf '%-18s %-60s %4s s\n' "$name" "${result[$name]}" "${took[$name]}"
  done
  echo "figures:"
  for name in torch_exact torch_gpt2 torch_ddp sandbox; do
    grep '^SUMMARY ' "$logs/$name.log" 2>/dev/null | sed 's/^SUMMARY /  /'
  done
  if [ "${result[trainer_bench]:-}" = PASS ]; then
    ratio=$(jget "$tb" snapshot_vs_d2h_peak)
    echo "  trainer bench: D2H snapshot $(gbs "$(jget "$tb" snapshot_bytes_per_s)") GB/s vs" \
         "cudaMemcpyAsync pinned peak $(gbs "$(jget "$tb" d2h_pinned_peak_bytes_per_s)") GB/s:" \
         "ratio $(num "$ratio" %.3f) (target >= 0.8) $(verdict "$ratio" 0.8 ge)"
    fence=$(jget "$tb" fence_pct_of_step)
    echo "  trainer bench: fence wait $(num "$fence" %.3f) % of step time (mean" \
         "$(num "$(jget "$tb" fence_ms_mean)" %.3f) ms, step $(num "$(jget "$tb" step_ms)" %.1f) ms," \
         "checkpoint every $(jget "$tb" checkpoint_every) steps of $compute_ms ms compute)" \
         "(target <= 1 %) $(verdict "$fence" 1 le); durable $(gbs "$(jget "$tb" durable_bytes_per_s)") GB/s"
  fi
  if [ "${result[gpu_bench]:-}" = PASS ]; then
    ratio=$(jget "$gb" drift_vs_d2d)
    echo "  gpu bench: drift kernel $(gbs "$(jget "$gb" drift_bytes_per_s)") GB/s read vs D2D copy" \
         "$(gbs "$(jget "$gb" d2d_bytes_per_s)") GB/s: ratio $(num "$ratio" %.3f) (target >= 0.6)" \
         "$(verdict "$ratio" 0.6 ge)"
  fi
  echo "exit:      $failed ($([ "$failed" -eq 0 ] && echo "every step that could run passed" || echo "a step failed, timed out or was skipped for time"))"
} | tee "$logs/summary.txt"
exit "$failed"
