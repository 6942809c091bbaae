#!/usr/bin/python3
"""Runs s3_store_rgw_test against a real S3 server: a one-node Ceph cluster
with radosgw (ceph_rgw.py) in a temporary directory, stopped afterwards
whatever happens.

Usage: run_s3_store_rgw.py PATH/TO/s3_store_rgw_test [gtest arguments...]
Exits with the test binary's status; 77 (skipped) when Ceph's daemons are
not installed (Debian's ceph-mon, ceph-osd, radosgw, ceph-common).
Standard library only.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ceph_rgw  # noqa: E402

NEEDED = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph-authtool",
          "monmaptool", "ceph")
SEARCH = "/usr/sbin:/usr/bin:/sbin:/bin:" + os.environ.get("PATH", "")
TEST_TIMEOUT_S = 200


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    binary, gtest_args = argv[1], argv[2:]
    missing = [n for n in NEEDED if shutil.which(n, path=SEARCH) is None]
    if missing:
        print(f"SKIP: Ceph is not installed (missing {', '.join(missing)})")
        return 77

    root = tempfile.mkdtemp(prefix="ckpt_s3_rgw.")
    cluster = ceph_rgw.CephRgw(root)
    try:
        t0 = time.monotonic()
        try:
            cluster.start(timeout=120)
        except ceph_rgw.CephRgwError as e:
            print(f"FAIL: the Ceph cluster did not start: {e}")
            return 1
        print(f"Ceph RGW at {cluster.endpoint} ready in {time.monotonic() - t0:.1f} s",
              flush=True)
        env = dict(os.environ)
        env.update({
            "CKPT_S3_ENDPOINT": cluster.endpoint,
            "CKPT_S3_BUCKET": cluster.bucket,
            "CKPT_S3_ACCESS_KEY": cluster.access_key,
            "CKPT_S3_SECRET_KEY": cluster.secret_key,
            "CKPT_S3_REGION": cluster.region,
        })
        try:
            return subprocess.run([binary] + gtest_args, env=env,
                                  timeout=TEST_TIMEOUT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            print(f"FAIL: {binary} ran over {TEST_TIMEOUT_S} s")
            return 1
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
