#!/usr/bin/env python3
"""Restore time from ckptd's memory tier, from its disk, and a raw O_DIRECT
read of the same bytes, interleaved in one run (docs/remote.md, "Memory
tier").

  tests/perf/restore_tiers.py [--layers=8] [--layer-mib=64] [--rounds=3]

Each round:
  memory  a trainer "crashes" (exits) and a new one restores: ckptd serves the
          plan from the memory tier; ckptd's read_bytes (/proc/PID/io) are
          recorded around the restore (what remains is RocksDB index blocks);
  disk    ckptd restarts (the memory tier is empty) with the page cache
          dropped, and a new trainer restores from the disk;
  raw     fio reads the layer files the disk restore read with O_DIRECT (4 MiB
          blocks, queue depth 16, io_uring) after the page cache is dropped,
          before the disk restore in odd rounds and after it in even ones.
Prints the median of each, the ratios (also the memory restore's against a
memcpy of the same bytes), and for each disk restore the share
of its time ckptd had a read call under way (from ckptd's log line). Needs
root (drop_caches) and fio.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_bytes(pid):
    with open("/proc/%d/io" % pid) as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def restore(d, args, steps):
    """Runs a restoring trainer; returns (seconds, bytes, bytes_from_memory, ckptd read_bytes)."""
    before = read_bytes(d.proc.pid)
    out = harness.run_trainer(d, "tiers", "--layers=%d" % args.layers,
                              "--layer-bytes=%dM" % args.layer_mib, "--steps=%d" % steps,
                              "--policy=all", "--restore")
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    after = read_bytes(d.proc.pid)
    for line in out.stdout.splitlines():
        if "restore time" in line:
            parts = line.split(",")
            total = int(parts[0].split()[1])
            secs = float([p for p in parts if "restore time" in p][0].split()[2])
            mem = int([p for p in parts if "memory tier" in p][0].split()[0])
            return secs, total, mem, after - before
    raise RuntimeError("no restore line: " + out.stdout)


def reading_share(d):
    """Of ckptd's last restore, the share of its time some thread was in a
    read call (from its log line; RestoreStats::reading_seconds)."""
    lines = [l for l in d.log().splitlines() if "restored job" in l and "read calls under way" in l]
    if not lines:
        return None
    return int(lines[-1].split("read calls under way")[1].split("%")[0]) / 100.0


def fio_read(files):
    drop_caches()
    out = subprocess.run(["fio", "--name=raw", "--rw=read", "--bs=4M", "--iodepth=16",
                          "--file_service_type=sequential",
                          "--ioengine=io_uring", "--direct=1", "--output-format=json",
                          "--filename=" + ":".join(files)], capture_output=True, text=True,
                         check=True)
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return job["io_bytes"] / (job["bw_bytes"] or 1), job["io_bytes"]


def memcpy_gbps(nbytes, rounds=5):
    """The median bandwidth of copying `nbytes` between two buffers whose
    pages are already there (a restore's target is the trainer's
    registered, touched memory), or None without numpy."""
    try:
        import numpy as np
    except ImportError:
        return None
    import time
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    secs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        secs.append(time.perf_counter() - t0)
    return nbytes / statistics.median(secs) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    total_mib = args.layers * args.layer_mib
    # ckptd's default staging chunk (the harness's is 1 MiB), so that its
    # reads are as large as fio's; a version's file (its header and payload)
    # takes one chunk more than its payload.
    chunk_mib = 4
    tier_mib = args.layers * (args.layer_mib + chunk_mib) + 32
    pool = (2 * tier_mib + 64) << 20
    root = harness.tempdir("ckpt-tiers-")
    extra = ["--memory_tier_bytes=%d" % (tier_mib << 20),
             "--staging_chunk_bytes=%d" % (chunk_mib << 20)]
    d = harness.Daemon(root, pool_bytes=pool, extra=extra).start()
    step = 2
    out = harness.run_trainer(d, "tiers", "--layers=%d" % args.layers,
                              "--layer-bytes=%dM" % args.layer_mib, "--steps=%d" % step,
                              "--policy=all")
    assert out.returncode == 0, out.stdout + out.stderr
    files = sorted(glob.glob(os.path.join(root, "data", "jobs", "tiers", "rank-*", "*.ckv")))
    files = [f for f in files if "-S%016x-" % step in f]
    rows = {"memory": [], "disk": [], "raw": []}
    shares = []
    for r in range(args.rounds):
        # The trainer exits; a new one restores (and trains one more step,
        # which goes back into the memory tier).
        step += 1
        secs, nbytes, mem, rb = restore(d, args, step)
        assert mem == nbytes, "every byte from memory (%d of %d)" % (mem, nbytes)
        rows["memory"].append((secs, nbytes, rb))
        # What the disk restore below reads: the files of that new step.
        files = sorted(glob.glob(os.path.join(root, "data", "jobs", "tiers", "rank-*",
                                              "*-S%016x-*.ckv" % step)))
        d.stop()
        # The disk restore and the raw read of the same files take turns at
        # going first: a step's files just written (or just read) may still
        # be cached below this machine, and whichever path reads them first
        # pays for that.
        if r % 2 == 0:
            secs, nbytes = fio_read(files)
            rows["raw"].append((secs, nbytes, nbytes))
        drop_caches()
        d = harness.Daemon(root, pool_bytes=pool, extra=extra).start()
        step += 1
        secs, nbytes, mem, rb = restore(d, args, step)
        assert mem == 0
        rows["disk"].append((secs, nbytes, rb))
        shares.append(reading_share(d))
        if r % 2 == 1:
            secs, nbytes = fio_read(files)
            rows["raw"].append((secs, nbytes, nbytes))
    d.stop()
    med = {k: statistics.median(s for s, _, _ in v) for k, v in rows.items()}
    gbps = {k: rows[k][0][1] / med[k] / 1e9 for k in rows}
    print("restore of %d layers x %d MiB (%d MiB), median of %d interleaved rounds:" %
          (args.layers, args.layer_mib, total_mib, args.rounds))
    for k in ("memory", "disk", "raw"):
        print("  %-6s %.3f s  %.2f GB/s  ckptd read_bytes per restore: %s" %
              (k, med[k], gbps[k], [rb for _, _, rb in rows[k]] if k != "raw" else "-"))
    print("  per round, disk / raw (raw read first in odd rounds): %s" %
          ", ".join("%.2f" % (rw[0] / dk[0]) for dk, rw in zip(rows["disk"], rows["raw"])))
    print("  memory/disk speed-up %.1fx; disk restore / raw O_DIRECT read = %.2f (ratio of medians), "
          "%.2f (median of per-round ratios)" %
          (med["disk"] / med["memory"], med["raw"] / med["disk"],
           statistics.median(rw[0] / dk[0] for dk, rw in zip(rows["disk"], rows["raw"]))))
    mc = memcpy_gbps(total_mib << 20)
    if mc is not None:
        print("  memcpy of the same bytes (numpy, one thread, warm buffers): %.2f GB/s; "
              "memory restore / memcpy = %.2f" % (mc, gbps["memory"] / mc))
    print("  read calls under way during ckptd's disk restores: %s of their time" %
          ", ".join("%.0f%%" % (100 * x) if x is not None else "?" for x in shares))
    # What a memory restore still reads is the index (RocksDB blocks of the
    # plan's records, and whatever a background compaction reads meanwhile:
    # 464 KiB was seen once), never a layer file, which ckptd reads whole.
    harness.check(all(rb < (args.layer_mib << 20) // 4 for _, _, rb in rows["memory"]),
                  "a restore from the memory tier reads no layer file (less than a quarter "
                  "of one: index blocks)")
    import shutil
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
