#!/usr/bin/env bash
# ckptd under the sandbox of deploy/systemd/ckptd.service, reached by a
# trainer of another uid: shows that the unit's settings leave ckptd what it
# needs (on a GPU machine: CUDA, the NVIDIA device nodes, pinned memory).
#
#   tests/gpu/sandbox_check.sh [--device cuda|cpu] [--build-dir DIR] [--python PY]
#                              [--logs DIR]
#
# Where systemd runs (/run/systemd/system exists), ckptd runs as a transient
# service through `systemd-run --wait --pipe` with every [Service] setting of
# the unit file except ExecStart and the Restart* lines, with two unused uids
# for User= and Group= and its own RuntimeDirectory/StateDirectory names.
# Without systemd it does the same by hand as far as the machine allows: a
# private mount namespace (unshare) with the unit's file-system settings
# (ProtectSystem=strict, ProtectHome, PrivateTmp, ProtectProc=invisible,
# read-only /proc/sys and /sys, a /dev that holds only the nodes the unit's
# device policy lets through), then setpriv to the daemon's uid with no
# capabilities and no new privileges, and the unit's resource limits and
# umask. What it could not apply is printed as "not shown". Either way the
# trainer (tests/gpu/torch_gpu_check.py --part exact, on the device) runs as
# a third uid in the daemon's group, outside the sandbox, and must restore
# bit for bit.
#
# Needs root; exit 77 when nothing is possible (not root), 0 when ckptd ran
# sandboxed and the trainer passed, 1 otherwise. Prints SUMMARY lines for
# tests/gpu/run_on_gpu.sh. Everything it makes (a copy of the binaries, the
# runtime, state and trainer directories, a temporary user entry) is removed
# at exit, also after SIGTERM or SIGINT.
#
# Time: it ends within CKPT_STEP_LIMIT_S seconds (run_on_gpu.sh's timeout
# for the step; default 225, within torch_gpu_check.py's 240): every wait
# inside (ckptd's start, the trainer, ckptd's stop) ends 15 s before that,
# which leaves the stop and the clean-up their time. On SIGTERM it kills
# what it started at once (the trainer's process group, the transient unit
# with SIGKILL) and cleans up within the 5 s of run_on_gpu.sh's timeout -k 5.
#
# Disk: the copies and the trainer's directory go under TMPDIR (the step's
# data directory) where the sandbox can see it and both uids can reach it;
# else under /opt and /tmp. The state directory is /var/lib/NAME under
# systemd (StateDirectory=), under TMPDIR by hand where it can be.
set -uo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
t_start=$SECONDS
limit_s=${CKPT_STEP_LIMIT_S:-225}
case $limit_s in '' | *[!0-9]*) limit_s=225 ;; esac
reserve_s=15  # ckptd's stop (--shutdown_grace_ms=1000, TimeoutStopSec=5) and the clean-up
deadline=$((t_start + limit_s - reserve_s))
# left [MAX]: seconds to the deadline, at least 1, at most MAX.
left() {
  local l=$((deadline - SECONDS))
  [ "$l" -ge 1 ] || l=1
  if [ -n "${1:-}" ] && [ "$l" -gt "$1" ]; then l=$1; fi
  echo "$l"
}
device=cuda
bin=${CKPT_BUILD_DIR:-$top/.gpu-bundle}
py=${CKPT_PYTHON:-python3}
logs=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --build-dir) bin=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    *) echo "sandbox_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
unit_file=$top/deploy/systemd/ckptd.service
[ -n "$logs" ] || logs=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-sandbox-logs.XXXXXX")
mkdir -p "$logs"
py=$(command -v "$py" || echo "$py")

skip() { echo "SUMMARY sandbox: SKIPPED ($*)"; exit 77; }
fail() { echo "SUMMARY sandbox: FAIL: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || skip "not root: a system unit, other uids and mount namespaces all need root"
bin=$(cd "$bin" 2>/dev/null && pwd) || fail "no build directory $bin"
if [ ! -x "$bin/daemon/ckptd" ] || [ ! -x "$bin/tools/ckptctl" ]; then fail "no ckptd or ckptctl in $bin"; fi
[ -d "$bin/python/ckpt" ] || fail "no Python package in $bin/python"
[ -f "$unit_file" ] || fail "no $unit_file"

# Two uids (and gids) nobody uses: the daemon's and the trainer's.
free_id() {
  local id=$1
  while getent passwd "$id" >/dev/null || getent group "$id" >/dev/null; do id=$((id + 1)); done
  echo "$id"
}
duid=$(free_id 61000)
tuid=$(free_id $((duid + 1)))
name=ckptd-gpucheck-$$
box=      # under TMPDIR: the copies, the trainer's directory, by hand the state
prefix=/opt/$name
run=/run/$name
state=/var/lib/$name
newdev=/run/$name.dev
sock=$run/ckptd.sock
tdir=
daemon_pid=   # ckptd by hand (unshare, then setpriv, exec one another)
runner_pid=   # systemd-run --wait
used_unit=    # set once systemd-run was started: the unit may exist
trainer_pid=  # the trainer's (or the probe's) timeout, leader of its process group
made_user=
hurry=        # set by SIGTERM/SIGINT: kill, do not wait

# stop_pid PID SECONDS: SIGTERM, up to SECONDS for it to end, then SIGKILL.
# PID is a child of this shell: `wait` reaps it afterwards.
stop_pid() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < $2 * 10; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null
  return 0
}
# wait_gone PID SECONDS: up to SECONDS for PID to end; 1 if it did not.
wait_gone() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  return 1
}
# wait_for_socket PID: until ckptd's socket exists, PID exits, or the
# step's deadline.
wait_for_socket() {
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ -S "$sock" ] && return 0
    kill -0 "$1" 2>/dev/null || return 0
    sleep 0.1
  done
}
# bg CMD...: CMD in the background, waited for: a SIGTERM or SIGINT to this
# shell runs its trap at once instead of after CMD (bash defers traps while
# a foreground command runs, and timeout puts CMD in a group of its own).
bg() {
  "$@" &
  local pid=$!
  wait "$pid"
}
# stop_unit SECONDS: the transient unit stopped (SIGTERM; TimeoutStopSec=5
# has systemd send SIGKILL after 5 s) within SECONDS, else killed with
# SIGKILL; then up to 3 s for systemd-run --wait to return, else it is
# killed too. SECONDS 0: SIGKILL at once, no waiting (the SIGTERM path).
stop_unit() {
  [ -n "$used_unit" ] || return 0
  if [ "$1" -eq 0 ]; then
    timeout 2 systemctl kill -s KILL "$name" >/dev/null 2>&1
    timeout 1 systemctl reset-failed "$name" >/dev/null 2>&1
    [ -z "$runner_pid" ] || kill -KILL "$runner_pid" 2>/dev/null
    return 0
  fi
  bg timeout -k 1 "$1" systemctl stop "$name" >/dev/null 2>&1
  if timeout 3 systemctl is-active --quiet "$name" 2>/dev/null; then
    timeout 3 systemctl kill -s KILL "$name" >/dev/null 2>&1
  fi
  timeout 3 systemctl reset-failed "$name" >/dev/null 2>&1
  if [ -n "$runner_pid" ] && ! wait_gone "$runner_pid" 3; then
    kill -KILL "$runner_pid" 2>/dev/null
  fi
  return 0
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  trap '' TERM INT
  if [ -n "$trainer_pid" ]; then  # its timeout leads a process group of its own
    kill -KILL -- "-$trainer_pid" 2>/dev/null
    kill -KILL "$trainer_pid" 2>/dev/null
  fi
  if [ -n "$hurry" ]; then stop_unit 0; else stop_unit 6; fi
  if [ -n "$daemon_pid" ]; then
    if [ -n "$hurry" ]; then kill -KILL "$daemon_pid" 2>/dev/null; else stop_pid "$daemon_pid" 6; fi
  fi
  [ -z "$runner_pid" ] || wait "$runner_pid" 2>/dev/null
  [ -z "$daemon_pid" ] || wait "$daemon_pid" 2>/dev/null
  rm -rf "$prefix" "$state" "$run" "$newdev" ${tdir:+"$tdir"} ${box:+"$box"}
  if [ -n "$made_user" ]; then
    userdel "$made_user" >/dev/null 2>&1
    groupdel "$made_user" >/dev/null 2>&1
  fi
}
trap cleanup EXIT
trap 'hurry=1; exit 143' TERM INT  # so that a timeout still cleans up

# as_uid UID GID GROUPS CMD...: execs CMD as UID:GID with supplementary
# GROUPS (comma-separated, may be empty), no capabilities, no new
# privileges. It replaces the calling shell: call it in a subshell.
as_uid() {
  local uid=$1 gid=$2 groups=$3
  shift 3
  if command -v setpriv >/dev/null; then
    local g=(--clear-groups)
    [ -n "$groups" ] && g=(--groups="$groups")
    exec setpriv --reuid="$uid" --regid="$gid" "${g[@]}" --no-new-privs --inh-caps=-all \
      --bounding-set=-all -- "$@"
  else  # no util-linux setpriv: the same with the interpreter the trainer uses
    exec "$py" -c '
import ctypes, os, sys
uid, gid = int(sys.argv[1]), int(sys.argv[2])
groups = [int(x) for x in sys.argv[3].split(",") if x]
libc = ctypes.CDLL(None, use_errno=True)
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
os.setgroups(groups); os.setgid(gid); os.setuid(uid)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.execvp(sys.argv[4], sys.argv[4:])' "$uid" "$gid" "$groups" "$@"
  fi
}

# The step's TMPDIR, for the copies and the trainer's directory, where the
# sandbox sees it (ProtectHome and PrivateTmp hide /root, /home, /run/user,
# /tmp and /var/tmp) and the daemon's and the trainer's uids can reach it.
base=$(realpath -e "${TMPDIR:-/tmp}" 2>/dev/null) || base=/tmp
box_seen=1
case "$base/" in /tmp/* | /var/tmp/* | /home/* | /root/* | /run/user/*) box_seen= ;; esac
box=$(mktemp -d "$base/ckpt-sandbox.XXXXXX" 2>/dev/null) || box=
if [ -n "$box" ]; then
  chmod 0755 "$box"
  if ! (as_uid "$duid" "$duid" "" test -x "$box") 2>/dev/null ||
     ! (as_uid "$tuid" "$tuid" "" test -x "$box") 2>/dev/null; then
    rm -rf "$box"; box=  # a parent of TMPDIR the two uids cannot pass: /opt and /tmp
  fi
fi
if [ -n "$box" ] && [ -n "$box_seen" ]; then prefix=$box/opt; fi
if [ -n "$box" ]; then
  tdir=$box/trainer
  mkdir "$tdir" || fail "cannot make $tdir"
else
  tdir=$(mktemp -d /tmp/ckpt-sandbox-trainer.XXXXXX) || fail "cannot make a trainer directory in /tmp"
fi

# The binaries, the Python package and the trainer's two scripts, where the
# sandbox can see them and the trainer's uid can read them.
mkdir -p "$prefix/daemon" "$prefix/tools" "$prefix/python" "$prefix/tests/gpu" \
         "$prefix/tests/integration" || fail "cannot make $prefix"
if ! { cp "$bin/daemon/ckptd" "$prefix/daemon/" && cp "$bin/tools/ckptctl" "$prefix/tools/" &&
        cp -rL "$bin/python/ckpt" "$prefix/python/" &&
        cp "$top/tests/gpu/torch_gpu_check.py" "$prefix/tests/gpu/" &&
        cp "$top/tests/integration/harness.py" "$prefix/tests/integration/"; }; then
  fail "cannot copy to $prefix"
fi
libpath=
if [ -d "$bin/lib" ]; then
  cp -r "$bin/lib" "$prefix/lib" && libpath=$prefix/lib
fi
chmod -R a+rX "$prefix"
chown "$tuid:$tuid" "$tdir"
chmod 0700 "$tdir"
echo "sandbox: copies in $prefix, trainer directory $tdir; inner waits end by $((deadline - t_start)) s of CKPT_STEP_LIMIT_S=$limit_s"

# ckptd's arguments for data directory $1. A short shutdown grace: the
# stop must fit the 15 s kept for it.
ckptd_args() {
  ckptd_argv=("--socket=$sock" "--data_dir=$1" "--staging_pool_bytes=268435456"
              "--metrics_address=127.0.0.1:0" "--keep_last_events=1" "--keep_every_steps=0"
              "--gc_interval_s=1" "--shutdown_grace_ms=1000")
}
ckptd_argv=()
applied=()
not_shown=()

# ---- with systemd: a transient unit with the unit file's settings ----
unit_properties() {
  local section="" line key
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    line=$(echo "$line" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')
    [ -n "$line" ] || continue
    case "$line" in \[*) section=$line; continue ;; esac
    [ "$section" = "[Service]" ] || continue
    key=${line%%=*}
    case "$key" in
      ExecStart | Restart | RestartSec | RestartPreventExitStatus) continue ;;
      User) line="User=$duid" ;;
      Group) line="Group=$duid" ;;
      RuntimeDirectory) line="RuntimeDirectory=$name" ;;
      StateDirectory) line="StateDirectory=$name" ;;
      ReadWritePaths) line="ReadWritePaths=$state" ;;
      # Bounded by the step: systemd-run --wait waits out a start, and a stop
      # must fit the 15 s kept for it.
      TimeoutStartSec) line="TimeoutStartSec=$(left)" ;;
      TimeoutStopSec) line="TimeoutStopSec=5" ;;
    esac
    echo "$line"
  done <"$unit_file"
}

# refused_key LOG: the key of a setting in props that one of systemd-run's
# own refusal lines in LOG names (not ckptd's output, which shares the log).
refused_key() {
  local lines p k
  lines=$(grep -E '^(Unknown assignment: |Failed to parse |Failed to start transient service unit: )' "$1")
  [ -n "$lines" ] || return 1
  for p in "${props[@]}"; do
    k=${p%%=*}
    if printf '%s\n' "$lines" | grep -Eq "(^|[^A-Za-z0-9])$k([^A-Za-z0-9]|\$)"; then
      echo "$k"
      return 0
    fi
  done
  return 1
}

start_systemd() {
  mapfile -t props < <(unit_properties)
  [ -n "$libpath" ] && props+=("Environment=LD_LIBRARY_PATH=$libpath")
  ckptd_args "$state"
  local dropped=() attempt
  for attempt in 1 2 3 4 5 6; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "sandbox: no time left to start ckptd (attempt $attempt)"; break; }
    local args=()
    for p in "${props[@]}"; do
      case "$p" in TimeoutStartSec=*) p="TimeoutStartSec=$(left)" ;; esac
      args+=(-p "$p")
    done
    : >"$logs/sandbox_ckptd.log"
    used_unit=1
    systemd-run --wait --pipe --collect --unit="$name" \
      --description="ckptd under the sandbox of deploy/systemd/ckptd.service (GPU check)" \
      "${args[@]}" "$prefix/daemon/ckptd" "${ckptd_argv[@]}" \
      </dev/null >>"$logs/sandbox_ckptd.log" 2>&1 &
    runner_pid=$!
    mode=systemd
    wait_for_socket "$runner_pid"
    if [ -S "$sock" ]; then
      applied+=("systemd-run with the ${#props[@]} [Service] settings of deploy/systemd/ckptd.service" \
                "(User=/Group= $duid, RuntimeDirectory=/StateDirectory= $name; TimeoutStartSec= and TimeoutStopSec=5 sized to the step)")
      for d in "${dropped[@]}"; do not_shown+=("$d (this systemd refused it)"); done
      return 0
    fi
    # Not started: the unit stopped (or killed) before systemd-run is reaped.
    stop_unit 3
    wait "$runner_pid" 2>/dev/null
    runner_pid=
    mode=
    # A setting this systemd does not know: drop it and try again.
    local bad
    bad=$(refused_key "$logs/sandbox_ckptd.log")
    case "$bad" in User | Group)  # never run ckptd as root instead
      echo "sandbox: systemd-run refused $bad="; bad=; break ;;
    esac
    # A systemd that wants User= in the user database (the service failed
    # with 217/USER or 216/GROUP): a temporary entry.
    if [ -z "$bad" ] && [ -z "$made_user" ] &&
       grep -Eq '^Main processes terminated with: code=exited/status=21[67]([^0-9]|$)' "$logs/sandbox_ckptd.log" &&
       command -v useradd >/dev/null && command -v groupadd >/dev/null; then
      groupadd --system -g "$duid" "$name" && made_user=$name &&
        useradd --system -u "$duid" -g "$duid" -M -d / -s /usr/sbin/nologin "$name" && continue
    fi
    [ -n "$bad" ] || break
    dropped+=("$bad")
    local kept=()
    for p in "${props[@]}"; do [ "${p%%=*}" = "$bad" ] || kept+=("$p"); done
    props=("${kept[@]}")
  done
  echo "sandbox: systemd-run did not start ckptd:"
  tail -n 5 "$logs/sandbox_ckptd.log" | sed 's/^/  /'
  return 1
}

# ---- without systemd: the same by hand ----
# Runs as root inside the new mount namespace, then becomes ckptd.
# shellcheck disable=SC2016  # expanded by the inner shell
ns_setup='
state=$1 run=$2 newdev=$3; shift 3
ok() { echo "sandbox-setup: applied $*"; }
no() { echo "sandbox-setup: not shown: $1 ($2)"; }
try() { local what=$1 err; shift; err=$("$@" 2>&1) && return 0; no "$what" "$err"; return 1; }
try "StateDirectory/ReadWritePaths" mount --bind "$state" "$state" &&
  try RuntimeDirectory mount --bind "$run" "$run" &&
  ok "StateDirectory=, RuntimeDirectory=, ReadWritePaths= (writable mounts of their own)"
try PrivateTmp=yes mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp &&
  { [ ! -d /var/tmp ] || try PrivateTmp=yes mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp; } &&
  ok "PrivateTmp=yes (empty /tmp and /var/tmp)"
hidden=
for d in /home /root /run/user; do
  [ -d "$d" ] || continue
  try ProtectHome=yes mount -t tmpfs -o mode=000,nosuid,nodev tmpfs "$d" && hidden="$hidden $d"
done
ok "ProtectHome=yes (empty, inaccessible:$hidden)"
if try "DevicePolicy=closed" mount -t tmpfs -o mode=755,nosuid tmpfs "$newdev"; then
  kept=
  for n in null zero full random urandom tty; do
    [ -e "/dev/$n" ] || continue
    touch "$newdev/$n" && mount --bind "/dev/$n" "$newdev/$n" && kept="$kept $n"
  done
  for n in /dev/nvidia*; do
    [ -e "$n" ] || continue
    b=${n#/dev/}
    if [ -d "$n" ]; then mkdir -p "$newdev/$b" && mount --rbind "$n" "$newdev/$b"
    else touch "$newdev/$b" && mount --bind "$n" "$newdev/$b"; fi && kept="$kept $b"
  done
  mkdir -p "$newdev/shm" && { [ ! -d /dev/shm ] || mount --bind /dev/shm "$newdev/shm"; }
  ln -s /proc/self/fd "$newdev/fd"
  for i in 0 1 2; do ln -s "/proc/self/fd/$i" "$newdev/$(echo stdin stdout stderr | cut -d" " -f$((i + 1)))"; done
  try "DevicePolicy=closed" mount --move "$newdev" /dev &&
    ok "DevicePolicy=closed, DeviceAllow=char-nvidia* rw, PrivateDevices=no (emulated by a /dev that holds only:$kept, shm)"
fi
try ProtectProc=invisible mount -t proc -o nosuid,nodev,noexec,hidepid=invisible proc /proc &&
  ok "ProtectProc=invisible (a proc instance with hidepid=invisible)"
try ProtectKernelTunables=yes mount --bind /proc/sys /proc/sys &&
  try ProtectKernelTunables=yes mount -o remount,bind,ro /proc/sys &&
  ok "ProtectKernelTunables=yes, ProtectControlGroups=yes (/proc/sys read-only; /sys and /sys/fs/cgroup below)"
failed=
while read -r m; do
  case "$m" in
    /proc | /proc/* | /dev | /dev/* | /tmp | /var/tmp | "$state" | "$run") continue ;;
  esac
  mount -o remount,bind,ro "$m" 2>/dev/null || failed="$failed $m"
done < <(findmnt -rn -o TARGET)
if [ -z "$failed" ]; then ok "ProtectSystem=strict (every other mount read-only, /sys included)"
else no ProtectSystem=strict "these mounts stayed writable:$failed"; fi
ok "PrivateMounts=yes (a mount namespace of its own)"
if ulimit -l unlimited 2>/dev/null; then ok "LimitMEMLOCK=infinity"
else no LimitMEMLOCK=infinity "the hard limit, $(ulimit -Hl), cannot be raised here"; fi
if ulimit -n 65536 2>/dev/null; then ok "LimitNOFILE=65536"
else no LimitNOFILE=65536 "the hard limit, $(ulimit -Hn), cannot be raised here"; fi
umask 0027 && ok "UMask=0027"
"$@"  # as_uid: execs ckptd
'

start_by_hand() {
  # By hand the state directory need not be /var/lib: the step's TMPDIR.
  if [ -n "$box" ] && [ -n "$box_seen" ]; then state=$box/state; fi
  ckptd_args "$state"
  mkdir -m 0750 "$run" "$state" || return 1
  chown "$duid:$duid" "$run" "$state" || return 1
  mkdir -p "$newdev"
  local env_cmd=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin CKPT_LOG_LEVEL=info)
  [ -n "$libpath" ] && env_cmd+=("LD_LIBRARY_PATH=$libpath")
  local daemon_cmd=(as_uid "$duid" "$duid" "" "${env_cmd[@]}" "$prefix/daemon/ckptd" "${ckptd_argv[@]}")
  : >"$logs/sandbox_ckptd.log"
  local ns_err
  if command -v unshare >/dev/null && ns_err=$(unshare --mount --propagation private true 2>&1); then
    # as_uid is a function: the inner shell gets its definition.
    unshare --mount --propagation private -- bash -c "$(declare -f as_uid); py=$(printf %q "$py"); $ns_setup" \
      ns "$state" "$run" "$newdev" "${daemon_cmd[@]}" >>"$logs/sandbox_ckptd.log" 2>&1 &
    daemon_pid=$!
  else
    not_shown+=("every file-system setting: no mount namespace here (unshare: ${ns_err:-not installed})")
    (ulimit -l unlimited 2>/dev/null || echo "sandbox-setup: not shown: LimitMEMLOCK=infinity (the hard limit cannot be raised here)"
     ulimit -n 65536 2>/dev/null || echo "sandbox-setup: not shown: LimitNOFILE=65536 (the hard limit cannot be raised here)"
     umask 0027 && "${daemon_cmd[@]}") \
      >>"$logs/sandbox_ckptd.log" 2>&1 &
    daemon_pid=$!
  fi
  mode=hand
  wait_for_socket "$daemon_pid"
  [ -S "$sock" ] || { echo "sandbox: ckptd did not start by hand:"; tail -n 8 "$logs/sandbox_ckptd.log" | sed 's/^/  /'; return 1; }
  if command -v setpriv >/dev/null; then
    applied+=("User=/Group= $duid, NoNewPrivileges=yes, CapabilityBoundingSet= and AmbientCapabilities= empty (setpriv)")
  else
    applied+=("User=/Group= $duid, NoNewPrivileges=yes, CapabilityBoundingSet= empty (no setpriv: the same through $py)")
  fi
  while IFS= read -r line; do
    case "$line" in
      "sandbox-setup: applied "*) applied+=("${line#sandbox-setup: applied }") ;;
      "sandbox-setup: not shown: "*) not_shown+=("${line#sandbox-setup: not shown: }") ;;
    esac
  done <"$logs/sandbox_ckptd.log"
  not_shown+=("SystemCallFilter=, SystemCallErrorNumber=, SystemCallArchitectures=, MemoryDenyWriteExecute=, RestrictAddressFamilies=, RestrictNamespaces=, RestrictRealtime=, RestrictSUIDSGID=, LockPersonality= (seccomp filters: systemd makes them, no tool here does)"
              "the device cgroup itself (DevicePolicy=closed is emulated by the contents of /dev only)"
              "ProtectKernelModules=, ProtectKernelLogs=, ProtectClock=, ProtectHostname= beyond what the empty capability set gives"
              "KeyringMode=private, RemoveIPC=yes, Type=notify with WatchdogSec=, TimeoutStartSec=/TimeoutStopSec=, Restart= (service manager behaviour)")
  return 0
}

# ---- ckptd ----
how=
if [ -d /run/systemd/system ] && command -v systemd-run >/dev/null; then
  if start_systemd; then
    how="systemd-run (transient unit $name)"
  else
    not_shown+=("the systemd unit itself: systemd-run failed (see sandbox_ckptd.log); by hand instead")
    rm -rf "$run" "$state"
  fi
fi
if [ -z "$how" ]; then
  if [ -d /run/systemd/system ]; then
    nosd="systemd-run is not installed"
  else
    nosd="no systemd: /run/systemd/system is missing"
  fi
  start_by_hand || fail "ckptd did not start in the sandbox made by hand ($nosd)"
  how="by hand ($nosd)"
fi
gpu_line=$(grep -o 'gpu: .*' "$logs/sandbox_ckptd.log" | head -1)
pool_line=$(grep -o 'staging pool: [0-9]* bytes.*' "$logs/sandbox_ckptd.log" | head -1)
echo "sandbox: ckptd runs $how as uid $duid; its log says: ${gpu_line:-no gpu line}"
cuda_ok=1
if [ "$device" = cuda ] && ! echo "$gpu_line" | grep -Eq '[1-9][0-9]* device'; then
  cuda_ok=0
fi
security=
if [ "$mode" = systemd ]; then
  bg timeout "$(left 10)" systemd-analyze security --no-pager "$name" >"$logs/sandbox_security.log" 2>/dev/null
  security=$(tail -n 1 "$logs/sandbox_security.log" | sed 's/^[^A-Za-z]*//')
  echo "sandbox: systemd-analyze security: ${security:-?}"
fi

# ---- the trainer, as a third uid in the daemon's group ----
tenv=(env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$tdir" TMPDIR="$tdir" PYTHONDONTWRITEBYTECODE=1
      PYTHONPATH="$prefix/python" CKPT_BUILD_DIR="$prefix" OMP_NUM_THREADS=1)
# The bundle's libraries (copied), then the caller's search path (the CUDA toolkit's).
tlib=$libpath${LD_LIBRARY_PATH:+${libpath:+:}$LD_LIBRARY_PATH}
[ -n "$tlib" ] && tenv+=("LD_LIBRARY_PATH=$tlib")
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && tenv+=("CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES")
trainer_uid=$tuid
# The probe and the trainer run in the background (so that SIGTERM's trap
# fires at once); timeout leads a process group the clean-up can kill.
(as_uid "$tuid" "$tuid" "$duid" "${tenv[@]}" timeout -k 2 "$(left 60)" "$py" -c 'import torch, ckpt') \
  >"$logs/sandbox_probe.log" 2>&1 &
trainer_pid=$!
wait "$trainer_pid"
probe_rc=$?
trainer_pid=
if [ "$probe_rc" -ne 0 ]; then
  not_shown+=("a trainer of another uid: uid $tuid cannot run $py with torch and ckpt ($(tail -n 1 "$logs/sandbox_probe.log"); exit $probe_rc); the trainer ran as root")
  trainer_uid=0
fi
trainer=("${tenv[@]}" timeout -k 1 "$(left)" "$py" "$prefix/tests/gpu/torch_gpu_check.py" --part exact
         --device "$device" --socket "$sock" --build-dir "$prefix")
[ "$device" = cpu ] && trainer+=(--quick)  # the CPU run proves the logic: a tiny model
if [ "$trainer_uid" -ne 0 ]; then
  (as_uid "$tuid" "$tuid" "$duid" "${trainer[@]}") >"$logs/sandbox_trainer.log" 2>&1 &
else
  "${trainer[@]}" >"$logs/sandbox_trainer.log" 2>&1 &
fi
trainer_pid=$!
wait "$trainer_pid"
trainer_rc=$?
trainer_pid=
[ "$trainer_rc" -eq 124 ] && echo "sandbox: the trainer ran out of the step's time ($((deadline - t_start)) s of $limit_s)"
result=$(grep '^SUMMARY exact ' "$logs/sandbox_trainer.log" | head -1 | sed 's/^SUMMARY exact //')
bg timeout 3 "$prefix/tools/ckptctl" --socket="$sock" jobs >"$logs/sandbox_jobs.log" 2>&1
jobs_rc=$?

# ---- stop ckptd ----
# First ckptd (SIGTERM, 1 s of grace; SIGKILL after a few seconds), then
# systemd-run, whose exit status is the service's.
if [ "$mode" = systemd ]; then
  stop_unit 6
  wait "$runner_pid"
  daemon_rc=$?
  runner_pid=
  mode=
else
  stop_pid "$daemon_pid" 6
  wait "$daemon_pid"
  daemon_rc=$?
  daemon_pid=
fi

ok=1
[ "$trainer_rc" -eq 0 ] || ok=0
[ "$cuda_ok" -eq 1 ] || ok=0
[ "$daemon_rc" -eq 0 ] || ok=0
echo "SUMMARY sandbox: $([ $ok -eq 1 ] && echo PASS || echo FAIL) $how; ckptd as uid $duid" \
     "(${gpu_line:-no gpu line in its log}; ${pool_line:-no staging pool line}; exit $daemon_rc after SIGTERM)${security:+; systemd-analyze security: $security}"
echo "SUMMARY sandbox: trainer uid $trainer_uid (group $duid) on $device: ${result:-no result (exit $trainer_rc)};" \
     "ckptctl jobs as root (exit $jobs_rc) lists the trainer's job: $(grep -q 'exact-default' "$logs/sandbox_jobs.log" && echo yes || echo no)"
[ "$cuda_ok" -eq 1 ] || echo "SUMMARY sandbox: ckptd inside the sandbox sees no CUDA device"
for a in "${applied[@]}"; do echo "SUMMARY sandbox: applied: $a"; done
for n in "${not_shown[@]}"; do echo "SUMMARY sandbox: not shown: $n"; done
[ "$ok" -eq 1 ] || { tail -n 20 "$logs/sandbox_trainer.log" | sed 's/^/  trainer: /'; exit 1; }
exit 0
