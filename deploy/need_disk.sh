#!/usr/bin/env bash
# Fails at once, saying what is needed and what is free, when the file
# system that holds DIR (or its nearest existing parent) has less than GIB
# GiB free: a pip install that runs out of space stops minutes in with only
# "No space left on device", and leaves a broken environment behind.
#
#   deploy/need_disk.sh DIR GIB WHAT
set -euo pipefail
dir=$1 gib=$2 what=$3
probe=$dir
while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
free_kib=$(df -Pk "$probe" | awk 'NR == 2 { print $4 }')
need_kib=$((gib * 1024 * 1024))
if [ "$free_kib" -lt "$need_kib" ]; then
  echo "need_disk: $what needs about $gib GiB free on the file system of $probe;" \
    "it has $((free_kib / 1024)) MiB free ($(df -Ph "$probe" | awk 'NR == 2 { print $6 }'))." \
    "Free some space, or point it elsewhere (CKPT_VENV, CKPT_TORCH_NEWEST_VENV, TMPDIR)." >&2
  exit 1
fi
