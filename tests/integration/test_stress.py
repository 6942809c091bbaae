"""ckpt_stress against a real ckptd with a 1 s GC and short retention: many
ranks and jobs register, step, restore, plan, collect and unregister at
random; every response is checked against the oracle of acknowledged steps
(docs/reliability.md). `--seconds` sets the length (CI: 20 s)."""

import argparse
import os
import shutil
import subprocess
import sys

import harness


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=20261130)
    args = ap.parse_args()
    root = harness.tempdir("ckpt-stress-")
    daemon = harness.Daemon(root, pool_bytes=32 << 20,
                            extra=["--gc_interval_s=1", "--keep_last_events=2",
                                   "--keep_every_steps=0", "--drain_timeout_ms=20000"]).start()
    try:
        p = subprocess.run([os.path.join(harness.BUILD, "tools", "ckpt_stress"),
                            "--socket=" + daemon.socket, "--jobs=4", "--ranks=2", "--threads=4",
                            "--seconds=%d" % args.seconds, "--seed=%d" % args.seed],
                           capture_output=True, text=True, timeout=args.seconds + 600)
        print(p.stdout)
        print(p.stderr[-5000:])
        if p.returncode != 0:
            print("FAILED (exit %d)" % p.returncode)
            return 1
        for job in ("stress-%d" % j for j in range(4)):
            verify = daemon.ctl("verify", job, "--deep", timeout=600)
            if verify["failures"]:
                print("verify failures in %s: %s" % (job, verify["failures"]))
                return 1
            print("%s: %d versions verified" % (job, verify["versions_checked"]))
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
