#!/usr/bin/env bash
# Sets up ckptd on a Debian 12 host after `cmake --install`:
#   - the system group and user ckptd (no login shell, home /var/lib/ckptd);
#   - the data directory (owned by ckptd, 0750) and the runtime directory of
#     the sockets (ckptd:ckptd 0750; systemd recreates it at every start);
#   - the config, from share/ckptd/ckptd.conf, if none is installed yet (an
#     existing config is never overwritten);
#   - systemctl daemon-reload and enable --now ckptd, when systemd runs;
#     otherwise it prints what to run.
# Running it again changes nothing that is already in place.
#
# Usage: install.sh [--prefix P] [--no-start] [--dry-run]
#   --prefix P   where `cmake --install` put ckptd (default /usr/local, or the
#                prefix this script was installed under, P/share/ckptd)
#   --no-start   enable the unit but do not start (or restart) ckptd
#   --dry-run    print what would be done; changes nothing, needs no root
set -euo pipefail

self_dir=$(cd "$(dirname "$0")" && pwd)
args="$*"
prefix=/usr/local
case "$self_dir" in */share/ckptd) prefix=${self_dir%/share/ckptd} ;; esac
start=1
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a value" >&2; exit 2; }
              prefix=$2; shift ;;
    --prefix=*) prefix=${1#--prefix=} ;;
    --no-start) start=0 ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
prefix=${prefix%/}

if [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: must run as root (it creates a system user and directories);" \
       "try: sudo $0 $args  (or --dry-run to see what it would do)" >&2
  exit 1
fi

# Prints a command, then runs it (or only prints it with --dry-run).
run() {
  if [ "$dry_run" = 1 ]; then
    echo "  would run: $*"
  else
    echo "  + $*"
    "$@"
  fi
}

# ---- what cmake --install put under the prefix ----
ckptd=$prefix/sbin/ckptd
[ -x "$ckptd" ] || { echo "install.sh: no $ckptd; run cmake --install <build> --prefix $prefix first" >&2; exit 1; }
unit=
for dir in "$prefix/lib/systemd/system" /etc/systemd/system /usr/local/lib/systemd/system \
           /usr/lib/systemd/system /lib/systemd/system; do
  if [ -f "$dir/ckptd.service" ] && grep -q "^ExecStart=$ckptd " "$dir/ckptd.service"; then
    unit=$dir/ckptd.service
    break
  fi
done
[ -n "$unit" ] || { echo "install.sh: no ckptd.service whose ExecStart runs $ckptd" >&2; exit 1; }
conf=$(sed -n 's/^ExecStart=.*--config=\([^ ]*\).*/\1/p' "$unit")
[ -n "$conf" ] || { echo "install.sh: $unit names no --config=" >&2; exit 1; }
default_conf=$prefix/share/ckptd/ckptd.conf
[ -f "$default_conf" ] || { echo "install.sh: no $default_conf" >&2; exit 1; }
echo "ckptd $ckptd"
echo "unit  $unit"
echo "conf  $conf"

# ---- user and group ----
echo "user and group ckptd:"
if getent group ckptd >/dev/null; then
  echo "  group ckptd exists"
else
  run groupadd --system ckptd
fi
if getent passwd ckptd >/dev/null; then
  echo "  user ckptd exists"
else
  run useradd --system --gid ckptd --home-dir /var/lib/ckptd --no-create-home \
    --shell /usr/sbin/nologin --comment "ckptd checkpoint daemon" ckptd
fi

# ---- config: installed once, never overwritten ----
echo "config:"
if [ ! -e "$conf" ]; then
  run install -D -m 0644 -o root -g root "$default_conf" "$conf"
elif cmp -s "$conf" "$default_conf"; then
  echo "  $conf is the default"
else
  echo "  $conf kept (differs from the default; compare: diff -u $default_conf $conf)"
fi

# The paths the daemon uses; from the config when it is there yet.
setting() {  # setting KEY DEFAULT
  local v=
  if [ -f "$conf" ]; then
    v=$(sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\(.*[^[:space:]]\)[[:space:]]*$/\1/p" "$conf" | tail -n 1)
  fi
  echo "${v:-$2}"
}
data_dir=$(setting data_dir /var/lib/ckptd)
socket=$(setting socket /run/ckptd/ckptd.sock)
run_dir=$(dirname "$socket")

# ---- directories ----
# The unit's StateDirectory=/RuntimeDirectory= make the same directories at
# start; making them here lets ckptd also run by hand (as user ckptd).
echo "directories:"
ensure_dir() {  # ensure_dir PATH MODE
  local owner
  if [ -d "$1" ]; then
    owner=$(stat -c '%U:%G %a' "$1")
    if [ "$owner" = "ckptd:ckptd ${2#0}" ]; then
      echo "  $1 exists (ckptd:ckptd $2)"
      return
    fi
    echo "  $1 exists as $owner; fixing"
    run chown ckptd:ckptd "$1"
    run chmod "$2" "$1"
  else
    run install -d -o ckptd -g ckptd -m "$2" "$1"
  fi
}
ensure_dir "$data_dir" 0750
ensure_dir "$run_dir" 0750
if [ "$data_dir" != /var/lib/ckptd ]; then
  echo "  note: data_dir is $data_dir, but the unit allows writes only to /var/lib/ckptd;"
  echo "        add ReadWritePaths=$data_dir with: systemctl edit ckptd"
fi
if [ "$run_dir" != /run/ckptd ]; then
  echo "  note: the socket is in $run_dir, but the unit's RuntimeDirectory is /run/ckptd"
fi

# ---- systemd ----
# systemd looks for units only in a few directories; a unit elsewhere (an
# unusual prefix) is linked into /etc/systemd/system.
echo "systemd:"
case "$(dirname "$unit")" in
  /etc/systemd/system|/usr/local/lib/systemd/system|/usr/lib/systemd/system|/lib/systemd/system)
    echo "  $unit is on systemd's unit path" ;;
  *)
    if [ "$(readlink /etc/systemd/system/ckptd.service 2>/dev/null)" = "$unit" ]; then
      echo "  /etc/systemd/system/ckptd.service links to $unit"
    else
      run ln -sfn "$unit" /etc/systemd/system/ckptd.service
    fi ;;
esac
if [ -d /run/systemd/system ]; then
  run systemctl daemon-reload
  if [ "$start" = 1 ]; then
    run systemctl enable --now ckptd
    # An already running ckptd keeps its old binary and config until restarted.
    echo "  after an upgrade: systemctl restart ckptd"
  else
    run systemctl enable ckptd
    echo "  not started (--no-start): systemctl start ckptd"
  fi
else
  echo "  systemd is not running here; on a systemd host run:"
  echo "    systemctl daemon-reload"
  echo "    systemctl enable --now ckptd"
  echo "  or start it by hand as user ckptd (the staging pool is mlock'ed, hence the ulimit):"
  echo "    sh -c 'ulimit -l unlimited && exec setpriv --reuid=ckptd --regid=ckptd --init-groups \\"
  echo "      $ckptd --config=$conf'"
fi
echo "trainers reach ckptd through $socket: add their users to the group ckptd"
echo "  (usermod -aG ckptd USER)"
echo "done"
