"""A full disk under a running trainer (docs/reliability.md).

ckptd's data directory is a 64 MiB tmpfs. The example trainer saves two 4 MiB
layers every 10th step; once a few steps are durable the disk is filled to
~95% while saves are in flight, leaving less than one layer file free. Then:
  - the saves that do not fit fail cleanly: the trainer's durability wait
    reports the failed or skipped layers (a clear error), the daemon counts
    them (status write_errors, ckpt_versions_failed_total,
    ckpt_errors_total{kind="disk_full"}), and training goes on;
  - no temp file is left and no byte leaks (the .ckv files on disk are exactly
    the versions the index holds), the committed versions verify;
  - once the filler is deleted, saves are durable again in the same trainer
    process without restarting ckptd (time to resume printed);
  - a new process restores the composite checkpoint bit-exactly.
Needs root (mount); exits 77 (skipped) without it or when tmpfs cannot be
mounted. The tmpfs is unmounted in every case.

Not covered here: a file system filled to 100%, where RocksDB's own writes
fail. Debian's librocksdb 7.8.3 is built with assertions and used to abort
ckptd there (its info LOG, then its WAL, written again after a failure); the
index now keeps its info log in ckptd's log and reopens after a failed
write, which tests/daemon/engine/engine_durable_test.cc
(EnospcFromTheIndexDoesNotCrashAndRecovers) checks with RocksDB's file
system failing every write. This test leaves the index its headroom: the
free space left is less than one layer file, so layer writes fail at
fallocate and never eat it."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import harness

SIZE_MB = 64
TRAINER = ["--layers=2", "--layer-bytes=4M", "--policy=every_n:10"]
LAYER_FILE = (4 << 20) + 4096  # one layer version's file


def statvfs(path):
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def fill(path, target_used):
    """Grows a filler file until the file system is target_used full."""
    filler = os.path.join(path, "filler")
    chunk = b"\xa5" * (256 << 10)
    with open(filler, "ab") as f:
        while True:
            total, free = statvfs(path)
            if total - free >= target_used * total:
                break
            try:
                f.write(chunk)
                f.flush()
            except OSError:
                break
    return filler


def acks(path):
    return [r["durable"] for r in harness.read_jsonl(path)]


def last_step(path):
    rows = harness.read_jsonl(path)
    return rows[-1]["step"] if rows else 0


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def files_under(path, pred):
    out = []
    for dirpath, _, names in os.walk(path):
        out += [os.path.join(dirpath, n) for n in names if pred(n)]
    return out


def run(root, data):
    # A 1 MiB reserve (the default is 64 MiB): the file system here is 64 MiB.
    d = harness.Daemon(root, extra=["--gc_interval_s=0", "--min_free_disk_bytes=1048576"]).start()
    trainer = None
    try:
        job = "nospc"
        log, ack_log = os.path.join(root, "steps.jsonl"), os.path.join(root, "acks.jsonl")
        errf = open(os.path.join(root, "trainer.err"), "w")
        trainer = subprocess.Popen(
            harness.trainer_cmd(d, job, "--steps=1000000", "--compute-ms=30", "--durable-every=1",
                                "--log=" + log, "--ack-log=" + ack_log, *TRAINER),
            stdout=subprocess.DEVNULL, stderr=errf)
        wait_for(lambda: len(acks(ack_log)) >= 3, 60, "the first durable steps")

        # The disk fills while saves are in flight.
        filler = fill(data, 0.95)
        total, free = statvfs(data)
        print("filled: %.1f of %.1f MiB used" % ((total - free) / 2**20, total / 2**20))
        assert free < LAYER_FILE, "the filler left room for a layer file: %d bytes free" % free
        wait_for(lambda: d.ctl("status")["write_errors"] >= 8, 60, "saves failing on a full disk")
        full_at = last_step(log)
        acked_full = acks(ack_log)[-1]
        # Training goes on while saves fail.
        wait_for(lambda: last_step(log) >= full_at + 30, 60, "training to go on")
        assert trainer.poll() is None, "the trainer stopped on a full disk"
        st = d.ctl("status")
        failed_versions = st["write_errors"]
        disk_full = harness.metric(st["metrics_address"], "ckpt_errors_total",
                                   'kind="disk_full"') or 0.0
        failed_metric = harness.metric(st["metrics_address"], "ckpt_versions_failed_total") or 0.0
        assert disk_full > 0 and failed_metric > 0, (disk_full, failed_metric)
        # Refused by the free-space reserve, or by fallocate when a version
        # slips under it.
        assert re.search(r"version failed, previous version stays: RESOURCE_EXHAUSTED: .*"
                         r"(No space left on device|min_free_disk_bytes)", d.log()), d.log()[-2000:]
        # Committed versions stay intact on the full disk.
        v = d.ctl("verify", job, "--deep")
        assert v["failures"] == [], v

        # Space comes back: saves resume in the same trainer, same daemon.
        freed_at = time.time()
        os.unlink(filler)
        step_at_free = last_step(log)
        wait_for(lambda: acks(ack_log)[-1] > max(acked_full, step_at_free), 60,
                 "saves to become durable again after freeing space")
        resume_s = time.time() - freed_at
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        errf.close()
        with open(os.path.join(root, "trainer.err")) as f:
            err = f.read()
        assert "failed or were skipped" in err, err[-2000:]

        # Quiet: whatever was staged is written; then the state is clean.
        plan = d.stable_plan(job)
        temps = files_under(os.path.join(data, "jobs"), lambda n: n.startswith("tmp."))
        assert temps == [], temps
        on_disk = sum(os.path.getsize(p) for p in files_under(os.path.join(data, "jobs"),
                                                              lambda n: n.endswith(".ckv")))
        indexed = d.ctl("jobs")["jobs"][0]["bytes"]
        assert on_disk == indexed, "leaked bytes: %d on disk, %d in the index" % (on_disk, indexed)
        v = d.ctl("verify", job, "--deep")
        assert v["failures"] == [], v
        out = harness.run_trainer(d, job, "--restore", "--steps=0", "--verify-log=" + log, *TRAINER)
        assert out.returncode == 0 and "verify: 2 of 2 layers match" in out.stdout, \
            out.stdout + out.stderr
        print("FIGURES enospc: versions_failed=%d disk_full_errors=%d steps_trained_while_full>=30 "
              "acked_before_full=%d durable_after_free=%d resume_seconds=%.2f temps_left=0 "
              "leaked_bytes=%d restored_step=%d" %
              (failed_versions, disk_full, acked_full, acks(ack_log)[-1], resume_s,
               on_disk - indexed, plan["target_step"]))
        assert d.stop() == 0, d.log()[-2000:]
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        d.kill()


def main():
    if os.geteuid() != 0:
        print("not root: cannot mount a tmpfs; skipping")
        return 77
    root = harness.tempdir("ckpt-nospc-")
    data = os.path.join(root, "data")
    os.makedirs(data)
    mounted = False
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dm,mode=0750" % SIZE_MB, "tmpfs",
                            data], capture_output=True, text=True)
        if r.returncode != 0:
            print("cannot mount tmpfs (%s); skipping" % r.stderr.strip())
            return 77
        mounted = True
        run(root, data)
        return 0
    finally:
        if mounted:
            if subprocess.run(["umount", data]).returncode != 0:
                subprocess.run(["umount", "-l", data])
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
