#!/usr/bin/python3
"""The remote tier against a real S3 server (a one-node Ceph cluster with
radosgw, tests/daemon/remote/ceph_rgw.py), in one run (docs/remote.md, "Figures"):

  /usr/bin/python3 tests/perf/remote_upload.py [--layers=8] [--layer-mib=32] [--rounds=3]

1. Upload throughput, interleaved rounds: ckptd uploads one step of the
   example trainer (policy all: every layer), timed by its own
   ckpt_remote_upload_seconds; then boto3 uploads the very same layer files
   as multipart PUTs to other keys, with ckptd's part size and parallelism
   (4 files at once, 4 parts each). Median of each and the ratio ckptd / raw.
2. Remote lag under steady training: the trainer runs for --steady-s with
   --compute-ms between steps; the lag in steps is sampled every 0.5 s.
3. Restore on a replacement node: ckptd is killed, its data directory
   deleted, a fresh one started; a new trainer restores (ckptd pulls from
   the store, then restores).

Runs under Debian's /usr/bin/python3 (boto3 is the raw baseline). Needs
the ceph packages (deploy/install_deps.sh).
"""

import argparse
import glob
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "daemon", "remote"))
import ceph_rgw  # noqa: E402
import harness  # noqa: E402

PART = 16 << 20
PARALLEL = 4


def scrape(d):
    return harness.scrape(d.ctl("status")["metrics_address"])


def upload_seconds(d):
    m = scrape(d)
    return m.get(("ckpt_remote_upload_seconds_sum", ""), 0.0), m.get(
        ("ckpt_remote_upload_seconds_count", ""), 0.0)


def wait_remote(d, job, step, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for j in d.ctl("jobs")["jobs"]:
            if j["job_id"] == job and j["ranks"][0]["remote_step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError("step %d of %s not remote-durable" % (step, job))


def trainer(d, args, steps, *extra):
    out = harness.run_trainer(d, "up", "--layers=%d" % args.layers,
                              "--layer-bytes=%dM" % args.layer_mib, "--steps=%d" % steps,
                              "--policy=all", *extra)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady-s", type=float, default=30)
    ap.add_argument("--compute-ms", type=int, default=1000)
    args = ap.parse_args()
    import boto3
    from boto3.s3.transfer import TransferConfig
    root = harness.tempdir("ckpt-upload-")
    rgw = ceph_rgw.CephRgw(os.path.join(root, "ceph"))
    try:
        rgw.start()
        creds = os.path.join(root, "cred")
        rgw.write_credentials(creds)
        extra = ["--remote_kind=s3", "--remote_key_file=" + harness.remote_key(root),
                 "--remote_endpoint=" + rgw.endpoint,
                 "--remote_bucket=" + rgw.bucket, "--remote_region=" + rgw.region,
                 "--remote_credentials_file=" + creds, "--remote_part_bytes=%d" % PART,
                 "--remote_parallel_parts=%d" % PARALLEL]
        pool = (2 * args.layers * args.layer_mib + 64) << 20
        d = harness.Daemon(os.path.join(root, "a"), pool_bytes=pool, extra=extra).start()
        s3 = boto3.client("s3", endpoint_url=rgw.endpoint, region_name=rgw.region,
                          aws_access_key_id=rgw.access_key, aws_secret_access_key=rgw.secret_key)
        config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                max_concurrency=PARALLEL, use_threads=True)
        step = 0
        ours, raw = [], []
        nbytes = 0
        for r in range(args.rounds + 1):  # round 0 warms the cluster up
            s0, c0 = upload_seconds(d)
            step += 1
            trainer(d, args, step, *(["--restore"] if step > 1 else []))
            wait_remote(d, "up", step)
            s1, c1 = upload_seconds(d)
            files = sorted(glob.glob(os.path.join(root, "a", "data", "jobs", "up", "rank-*",
                                                  "*-S%016x-*.ckv" % step)))
            nbytes = sum(os.path.getsize(f) for f in files)
            t0 = time.time()
            # As many files at once as ckptd uploads versions at once
            # (remote_upload_threads, default 4), each with PARALLEL parts.
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda f: s3.upload_file(
                    f, rgw.bucket, "raw/%d/%s" % (r, os.path.basename(f)), Config=config), files))
            t_raw = time.time() - t0
            if r > 0:
                ours.append((s1 - s0) / max(c1 - c0, 1))
                raw.append(t_raw)
        mo, mr = statistics.median(ours), statistics.median(raw)
        print("upload of one step: %d layers, %.0f MiB; median of %d interleaved rounds" %
              (args.layers, nbytes / 2**20, args.rounds))
        print("  ckptd   %.2f s  %.0f MiB/s   %s" % (mo, nbytes / mo / 2**20,
                                                  ["%.2f" % x for x in ours]))
        print("  boto3   %.2f s  %.0f MiB/s   %s" % (mr, nbytes / mr / 2**20,
                                                  ["%.2f" % x for x in raw]))
        print("  ckptd / raw multipart PUT throughput = %.2f" % (mr / mo))

        # Steady training.
        import subprocess
        proc = subprocess.Popen(
            harness.trainer_cmd(d, "up", "--layers=%d" % args.layers,
                                "--layer-bytes=%dM" % args.layer_mib, "--steps=100000",
                                "--policy=all", "--restore", "--compute-ms=%d" % args.compute_ms),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lags = []
        t0 = time.time()
        while time.time() - t0 < args.steady_s:
            lags.append(scrape(d).get(("ckpt_remote_lag_steps", ""), 0))
            time.sleep(0.5)
        proc.kill()
        proc.wait()
        print("steady training (one %.0f MiB step every ~%d ms of compute): remote lag in steps "
              "median %.0f, max %.0f over %.0f s" % (nbytes / 2**20, args.compute_ms,
                                                   statistics.median(lags), max(lags),
                                                   args.steady_s))
        last = max(j["ranks"][0]["latest_durable_step"] for j in d.ctl("jobs")["jobs"])
        wait_remote(d, "up", last)

        # Replacement node.
        d.kill()
        shutil.rmtree(os.path.join(root, "a"))
        b = harness.Daemon(os.path.join(root, "b"), pool_bytes=pool, extra=extra).start()
        t0 = time.time()
        out = trainer(b, args, last, "--restore")
        wall = time.time() - t0
        restore_line = [l for l in out.stdout.splitlines() if "restore time" in l][0]
        pulled = [l for l in b.log().splitlines() if "pulled job" in l]
        print("replacement node: trainer register + pull + restore of step %d in %.2f s wall" %
              (last, wall))
        print("  " + (pulled[0].split("] ", 1)[1] if pulled else "(no pull logged)"))
        print("  restore itself:" + restore_line.split(",", 2)[2])
        b.stop()
    finally:
        rgw.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
