#!/usr/bin/env python3
"""ckptd's memory across cycles of registrations (docs/scaling.md, "Memory
kept after unregistering").

  tests/perf/registration_cycles.py [--ranks=256] [--cycles=36] [--new-jobs]

Each cycle registers --ranks ranks (ckpt_scale_trainer processes of 8 ranks,
16 layers of 64 KiB, 3 steps with policy all), lets them exit and waits
until ckptd has unregistered them; then prints ckptd's anonymous memory and
its ckpt_index_memory_bytes gauge (RocksDB's memtables, block cache and
table readers). The same job ids every cycle unless --new-jobs.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
import sweep  # noqa: E402

PER_PROC = 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--cycles", type=int, default=36)
    ap.add_argument("--new-jobs", action="store_true")
    args = ap.parse_args()
    work = harness.tempdir("ckpt-cycles-")
    d = sweep.start_daemon(os.path.join(work, "d"), pool_mib=64, extra=sweep.MANY_RANKS)
    try:
        address = d.ctl("status")["metrics_address"]

        def report(what):
            anon = sweep.kib(sweep.proc_status(d.proc.pid).get("RssAnon", "0 kB"))
            index = harness.metric(address, "ckpt_index_memory_bytes") or 0
            print("%s: anonymous %.1f MiB, ckpt_index_memory_bytes %.1f MiB" %
                  (what, anon / 2**20, index / 2**20), flush=True)

        report("before")
        for c in range(args.cycles):
            procs = []
            for j in range((args.ranks + PER_PROC - 1) // PER_PROC):
                job = "c%d-%d" % (c if args.new_jobs else 0, j)
                procs.append(subprocess.Popen(
                    [sweep.SCALE_TRAINER, "--socket=" + d.socket, "--job=" + job,
                     "--ranks=%d" % min(PER_PROC, args.ranks - j * PER_PROC), "--layers=16",
                     "--tensor-bytes=65536", "--policy=all", "--steps=3", "--warmup=0",
                     "--out=" + os.path.join(work, "out-%d.json" % j)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            errors = []
            for p in procs:
                _, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    errors.append(err)
            if errors:
                raise AssertionError("cycle %d: trainers failed: %s" % (c + 1, errors))
            deadline = time.time() + 60
            while time.time() < deadline and d.ctl("status").get("registered_ranks", 0) != 0:
                time.sleep(0.1)
            if d.ctl("status").get("registered_ranks", 0) != 0:
                raise AssertionError("cycle %d: ranks still registered after 60 s" % (c + 1))
            report("cycle %d" % (c + 1))
    finally:
        sweep.stop_daemon(d)
    import shutil
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
