#!/usr/bin/env bash
# A slow disk on this machine, and ckpt_bench on it (docs/throughput.md,
# "On a slow disk"). Needs root.
#
#   tests/perf/slow_disk.sh [--rate=BITS] [--write-delay=MS] [--size=GIB] [-- ckpt_bench args]
#
# The disk: nbdkit's memory plugin (so the host's own disk and page cache
# play no part: the figures repeat), paced by its rate filter
# (--rate, bits per second, default 2000M: 250 MB/s; bursts of at most
# 0.1 s, so an idle spell gives the next writer no head start) and with every write
# request held --write-delay ms (default 2) by its delay filter; nbdfuse
# shows the export as a file, a loop device with direct I/O makes it a
# block device, and it is formatted ext4 and mounted. Every write, flush
# and journal commit of the file system goes through the paced export, so
# the disk is slow the way a network volume is. ckpt_bench then compares
# ckptd's write path with raw O_DIRECT writes on it (default arguments:
# --total-bytes=1G --rounds=5 --no-restore). Everything is removed at the
# end, also when the benchmark fails. nbdkit, libnbd-bin (nbdfuse) and
# fuse3 are installed from Debian's archive when missing.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
rate=2000M
delay=2
size=6
while [ $# -gt 0 ]; do
  case "$1" in
    --rate=*) rate=${1#--rate=} ;;
    --write-delay=*) delay=${1#--write-delay=} ;;
    --size=*) size=${1#--size=} ;;
    --) shift; break ;;
    *) echo "usage: $0 [--rate=BITS] [--write-delay=MS] [--size=GIB] [-- ckpt_bench args]" >&2
       exit 2 ;;
  esac
  shift
done
bench_args=("$@")
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--total-bytes=1G --rounds=5 --no-restore)
bench=${CKPT_BUILD_DIR:-$top/build}/tools/ckpt_bench
if [ "$(id -u)" != 0 ]; then echo "slow_disk: needs root (loop devices, mounts)" >&2; exit 77; fi
[ -x "$bench" ] || { echo "slow_disk: no $bench; build ckptd first" >&2; exit 1; }
if ! command -v nbdkit >/dev/null || ! command -v nbdfuse >/dev/null || ! command -v fusermount3 >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nbdkit libnbd-bin fuse3 >/dev/null
fi

work=$(mktemp -d /var/tmp/ckpt-slow-disk.XXXXXX)
loop=""
cleanup() {
  mountpoint -q "$work/mnt" && umount "$work/mnt"
  [ -n "$loop" ] && losetup -d "$loop"
  mountpoint -q "$work/fuse" && fusermount3 -u "$work/fuse"
  [ -f "$work/nbdkit.pid" ] && kill "$(cat "$work/nbdkit.pid")" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/mnt" "$work/fuse"
nbdkit -U "$work/nbd.sock" -P "$work/nbdkit.pid" --filter=delay --filter=rate \
  memory size="${size}G" rate="$rate" burstiness=0.1 delay-write="${delay}ms"
for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
nbdfuse "$work/fuse/disk" "nbd+unix:///?socket=$work/nbd.sock" &
for _ in $(seq 100); do [ -f "$work/fuse/disk" ] && break; sleep 0.1; done
loop=$(losetup --direct-io=on -f --show "$work/fuse/disk")
mkfs.ext4 -q -F "$loop"
mount "$loop" "$work/mnt"
echo "slow disk: $loop on nbdkit's memory (rate $rate bit/s, every write held ${delay} ms), ext4"
raw=$(dd if=/dev/zero of="$work/mnt/probe" bs=1M count=512 oflag=direct conv=fsync 2>&1 | tail -1)
rm -f "$work/mnt/probe"
echo "dd of 512 MiB with O_DIRECT and fsync: ${raw##*, }"
"$bench" --dir="$work/mnt/bench" "${bench_args[@]}"
