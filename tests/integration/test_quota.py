"""Per-uid quotas against a flood of aux blobs.

ckptd runs as root with max_index_bytes_per_uid = 24 MiB and small queued-step
bounds. uid 4243 floods StepDone with 1 MiB aux blobs (the largest allowed)
as fast as it can, never waiting for a snapshot, from a Python client; while
it does, uid 4242 trains 150 steps with the example trainer and waits for
every step to become durable. Then:
  - the flooder is refused with RESOURCE_EXHAUSTED naming
    max_index_bytes_per_uid (or a queued-steps bound) and its index usage
    (ckpt_uid_index_used_bytes) stays at or under its quota;
  - the other uid's trainer never sees an error, and every one of its steps
    is acknowledged durable;
  - the index directory and ckptd's RSS stay under bounds derived from the
    configuration (the numbers are printed).
Needs root and setpriv (to run as two uids); exits 77 otherwise."""

import json
import os
import shutil
import subprocess
import sys
import time

import harness

VICTIM, FLOODER, GROUP = 4242, 4243, 0
INDEX_QUOTA = 24 << 20
QUEUED_PER_RANK, QUEUED_PER_UID = 8, 16
POOL = 32 << 20
STEPS = 150

FLOOD = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import ckpt
client = ckpt.Client(sys.argv[2])
region = client.allocate_region(4096)
client.register({"job_id": "flood", "layers": [{"name": "l0", "tensors": [
    {"name": "w", "shape": [1024], "region": region.index, "offset": 0}]}]})
aux = os.urandom(1 << 20)
ok = refused = 0
kinds = {}
deadline = time.time() + float(sys.argv[3])
t = 0
while time.time() < deadline:
    t += 1
    try:
        client.step_done(t, 0.1, aux)
        ok += 1
    except ckpt.Error as e:
        if e.code != "RESOURCE_EXHAUSTED":
            raise
        refused += 1
        for option in ("max_index_bytes_per_uid", "max_queued_steps_per_rank",
                       "max_queued_steps_per_uid", "max_disk_bytes_per_uid"):
            if option in e.message:
                kinds[option] = kinds.get(option, 0) + 1
print(json.dumps({"accepted": ok, "refused": refused, "by_option": kinds}))
'''


def as_user(uid, cmd, **kw):
    return subprocess.Popen(["setpriv", "--reuid=%d" % uid, "--regid=%d" % GROUP,
                             "--clear-groups", "--"] + cmd, **kw)


def main():
    unavailable = harness.other_uids_unavailable(python_client=True)
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    root = harness.tempdir("ckpt-quota-")
    os.chmod(root, 0o750)
    work = os.path.join(root, "work")
    os.makedirs(work)
    os.chmod(work, 0o777)
    flood_py = os.path.join(work, "flood.py")
    with open(flood_py, "w") as f:
        f.write(FLOOD)
    d = harness.Daemon(root, pool_bytes=POOL, extra=[
        "--gc_interval_s=0", "--max_index_bytes_per_uid=%d" % INDEX_QUOTA,
        "--max_queued_steps_per_rank=%d" % QUEUED_PER_RANK,
        "--max_queued_steps_per_uid=%d" % QUEUED_PER_UID]).start()
    flooder = victim = None
    try:
        address = d.ctl("status")["metrics_address"]
        rss_start = harness.rss_bytes(d.proc.pid)
        flooder = as_user(FLOODER, [sys.executable, flood_py, os.path.join(harness.BUILD, "python"),
                                    d.socket, "15"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ack_log = os.path.join(work, "acks.jsonl")
        victim = as_user(VICTIM, harness.trainer_cmd(
            d, "victim", "--layers=4", "--layer-bytes=256K", "--steps=%d" % STEPS,
            "--compute-ms=20", "--policy=all", "--durable-every=1", "--ack-log=" + ack_log),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rss_max = index_max = 0
        index_dir = os.path.join(d.data, "index")
        while flooder.poll() is None or victim.poll() is None:
            rss_max = max(rss_max, harness.rss_bytes(d.proc.pid))
            index_max = max(index_max, harness.dir_bytes(index_dir))
            time.sleep(0.1)
        fout, ferr = flooder.communicate(timeout=60)
        vout, verr = victim.communicate(timeout=60)
        assert flooder.returncode == 0, ferr[-3000:]
        flood = json.loads(fout.strip().splitlines()[-1])
        assert victim.returncode == 0, "the victim's training failed:\n" + verr[-3000:]
        acked = sorted(set(r["durable"] for r in harness.read_jsonl(ack_log)))
        missing = sorted(set(range(1, STEPS)) - set(acked))
        assert not missing, "victim steps not durable: %s" % missing[:20]
        assert flood["by_option"].get("max_index_bytes_per_uid", 0) > 0, flood
        used = harness.metric(address, "ckpt_uid_index_used_bytes", 'uid="%d"' % FLOODER)
        limit = harness.metric(address, "ckpt_uid_index_limit_bytes")
        assert used is not None and used <= INDEX_QUOTA and limit == INDEX_QUOTA, (used, limit)
        refused_index = harness.metric(address, "ckpt_quota_refused_total", 'kind="index"')
        # Bounds from the configuration: the flooder's records plus the
        # victim's (150 events, 600 versions) plus RocksDB's own files.
        index_bound = INDEX_QUOTA + (8 << 20)
        # Queued aux blobs, a memtable holding the quota's worth of records,
        # the staging pool, and slack for gRPC buffers and RocksDB.
        rss_bound = rss_start + QUEUED_PER_UID * (1 << 20) + INDEX_QUOTA + POOL + (96 << 20)
        print("FIGURES quota: flood_accepted=%d flood_refused=%d by_option=%s "
              "flooder_index_used=%d index_quota=%d refused_index_metric=%d "
              "victim_steps_acked_durable=%d of %d index_dir_max=%d (bound %d) rss_start=%d rss_max=%d "
              "(bound %d)" % (flood["accepted"], flood["refused"], json.dumps(flood["by_option"]),
                              used, INDEX_QUOTA, refused_index, len(acked), STEPS, index_max,
                              index_bound, rss_start, rss_max, rss_bound))
        assert index_max <= index_bound, (index_max, index_bound)
        assert rss_max <= rss_bound, (rss_max, rss_bound)
        assert d.stop() == 0, d.log()[-2000:]
        return 0
    finally:
        harness.kill_processes([flooder, victim])
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
