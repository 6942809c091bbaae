#!/usr/bin/env python3
"""ckpt_bench end to end on a small case: both write paths and both read paths
run at two ranks, every figure is measured, and the benchmark leaves nothing
behind. (The figures themselves are benchmarks, not test assertions.)"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

BUILD = os.environ.get("CKPT_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
BENCH = os.path.join(BUILD, "tools", "ckpt_bench")


def main():
    root = tempfile.mkdtemp(prefix="ckpt-bench-test-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    try:
        d = os.path.join(root, "b")
        out = subprocess.run([BENCH, "--dir=" + d, "--total-bytes=8M", "--layer-bytes=1M",
                              "--chunk-bytes=256K", "--rounds=2", "--ranks=2", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        j = json.loads(out.stdout)
        assert j["ranks"] == 2 and j["versions_per_round"] == 8, j
        assert len(j["rounds"]) == 2, j
        for r in j["rounds"]:
            for k in ("ckptd_gbps", "raw_gbps", "restore_gbps", "raw_read_gbps"):
                assert r[k] > 0, (k, r)
            share = r["commit_share"]
            parts = share["write"] + share["datasync"] + share["create_rename_dirsync_index"]
            assert abs(parts - 1.0) < 1e-6, share
        assert j["ratio"] > 0 and j["restore_ratio"] > 0, j
        # Only the index directory and the empty job tree remain.
        left = [os.path.join(p, f) for p, _, fs in os.walk(d) for f in fs
                if "/index" not in p]
        assert not left, left
        # Bad input is refused with usage, exit 2.
        bad = subprocess.run([BENCH, "--dir=" + d, "--ranks=0"], capture_output=True, text=True)
        assert bad.returncode == 2 and "--ranks" in bad.stderr, bad.stderr
        bad = subprocess.run([BENCH, "--dir=" + d, "--total-bytes=2M", "--layer-bytes=1M",
                              "--ranks=3"], capture_output=True, text=True)
        assert bad.returncode == 2 and "one --layer-bytes version per rank" in bad.stderr, bad.stderr
        print("ok: ckpt_bench measured writes and restores at 2 ranks and cleaned up")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
