"""A job's life against a real ckptd: stale ranks, `ckptctl release`,
`ckptctl delete`, and job ids that are not squatted forever.

uid 4242 trains job "life"; its trainer is killed with SIGKILL. ckptd
releases the rank's memory at once but the rank stays registered: `jobs`
says stale and the gauge ckpt_stale_ranks counts it. The owner releases it.
Then a live trainer's job cannot be deleted; once it is gone, its owner
deletes the job (every file and record), and uid 4243, which could not
register under the id while it was taken, takes it. uid 4243's attempts on
4242's job read exactly like attempts on a job that does not exist.
Last, a squatting trainer that registers again as soon as it is released
is evicted by root and the job deleted (evicted_squatter). Skips (77) when
not root or without setpriv.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

OWNER, OTHER = 4242, 4243
GROUP = 0  # the socket directory's group (root's), as in the test layout
TRAIN = ["--layers=3", "--layer-bytes=32K", "--policy=all", "--compute-ms=20", "--quiet"]


def setpriv(uid):
    return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % GROUP, "--clear-groups", "--"]


def ctl(d, uid, *args):
    return subprocess.run(setpriv(uid) + [harness.CKPTCTL, "--socket=" + d.socket] + list(args),
                          capture_output=True, text=True, timeout=120)


def rank0(d):
    jobs = d.ctl("jobs")["jobs"]
    job = [j for j in jobs if j["job_id"] == "life"]
    return job[0]["ranks"][0] if job and job[0]["ranks"] else None


def wait_for(what, fn, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)  # a poll with a deadline
    raise AssertionError("timed out waiting for " + what)


def gauge(d, name):
    address = d.ctl("status")["metrics_address"]
    with urllib.request.urlopen("http://%s/metrics" % address, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError("no metric " + name)


def start_trainer(d, uid, *extra):
    return subprocess.Popen(setpriv(uid) + harness.trainer_cmd(d, "life", "--steps=1000000",
                                                               *(TRAIN + list(extra))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def squat_rank(d):
    job = [j for j in d.ctl("jobs")["jobs"] if j["job_id"] == "squat"]
    return job[0]["ranks"][0] if job and job[0]["ranks"] else None


def suggested(stderr, needle):
    """The command in backquotes in `stderr` that contains `needle`, as
    arguments after `ckptctl`."""
    found = [c for c in re.findall(r"`(ckptctl [^`]*)`", stderr) if needle in c]
    assert found, "no suggested command with %r in: %s" % (needle, stderr)
    return found[0].split()[1:]


def evicted_squatter(d):
    """7. A trainer that keeps coming back. uid 4243's trainer runs on
    through the loss of its registration (--on-daemon-loss=continue) and
    registers again at once after root releases it, so the job could never
    be deleted. Every command ckptd suggests is run as suggested: the plain
    release (`--rank=`), then root's `--evict`, after which the trainer's
    next registration is refused and the job is deleted."""
    squatter = subprocess.Popen(
        setpriv(OTHER) + harness.trainer_cmd(d, "squat", "--steps=1000000",
                                             "--on-daemon-loss=continue", *TRAIN),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = wait_for("the squatter's first durable step",
                         lambda: (squat_rank(d) or {}).get("latest_durable_step", 0) >= 1 and
                         squat_rank(d))
        refused = d.ctl_raw("delete", "squat")
        assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr, refused.stderr
        p = d.ctl_raw(*suggested(refused.stderr, "--rank="))
        assert p.returncode == 0 and "released job squat rank 0" in p.stdout, p.stdout + p.stderr
        back = wait_for("the squatter to register again",
                        lambda: (squat_rank(d) or {}).get("registered") and
                        squat_rank(d)["generation"] > first["generation"] and squat_rank(d))
        print("ok: a plain release does not keep it out: registered again (generation %d -> %d)"
              % (first["generation"], back["generation"]))
        p = ctl(d, OTHER, "release", "squat", "--evict")
        assert p.returncode == 1 and "PERMISSION_DENIED" in p.stderr, p.stdout + p.stderr
        refused = d.ctl_raw("delete", "squat")
        assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr, refused.stderr
        p = d.ctl_raw(*suggested(refused.stderr, "--evict"))
        assert p.returncode == 0 and "evicted job squat: 1 registrations" in p.stdout, \
            p.stdout + p.stderr
        _, err = squatter.communicate(timeout=120)
        assert "was evicted by root" in err, err[-2000:]
        print("ok: evicted by root; the squatter's next registration was refused and it stopped "
              "(exit %d)" % squatter.returncode)
        squatter = None
        assert not squat_rank(d)["registered"], squat_rank(d)
        p = d.ctl_raw("delete", "squat")
        assert p.returncode == 0, p.stderr
        print("ok: the evicted job is deleted")
    finally:
        if squatter is not None:
            squatter.kill()
            squatter.wait()


def main():
    unavailable = harness.other_uids_unavailable()
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    root = harness.tempdir("ckpt-life-")
    d = harness.Daemon(os.path.join(root, "d"), extra=["--gc_interval_s=0"])
    trainer = None
    try:
        d.start()
        os.chmod(root, 0o755)

        # 1. A trainer killed outright leaves a stale registration.
        trainer = start_trainer(d, OWNER)
        wait_for("two durable steps", lambda: (rank0(d) or {}).get("latest_durable_step", 0) >= 2)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        r = wait_for("the rank to turn stale", lambda: (rank0(d) or {}).get("stale") and rank0(d))
        assert r["registered"], r
        assert gauge(d, "ckpt_stale_ranks") == 1
        p = ctl(d, OWNER, "jobs")
        assert p.returncode == 0 and "STALE" in p.stdout, p.stdout + p.stderr
        print("ok: a killed trainer's rank is stale (ckpt_stale_ranks 1)")

        # 2. Another uid cannot release or delete it; it reads as missing.
        for args in (["release", "life"], ["delete", "life"]):
            theirs = ctl(d, OTHER, *args)
            missing = ctl(d, OTHER, args[0], "nosuchjob")
            assert theirs.returncode == 1 and "does not exist" in theirs.stderr, theirs.stderr
            assert theirs.stderr.replace("life", "JOB") == missing.stderr.replace("nosuchjob", "JOB")
        print("ok: uid %d's release and delete read like a missing job" % OTHER)

        # 3. The owner releases the stale rank.
        p = ctl(d, OWNER, "release", "life")
        assert p.returncode == 0 and "released job life rank 0" in p.stdout, p.stdout + p.stderr
        r = rank0(d)
        assert not r["registered"] and not r["stale"], r
        assert gauge(d, "ckpt_stale_ranks") == 0
        p = ctl(d, OWNER, "release", "life")
        assert p.returncode == 1 and "NOT_FOUND" in p.stderr, p.stderr
        print("ok: released; ckpt_stale_ranks 0; a second release is NOT_FOUND")

        # 4. While a trainer holds a rank the job cannot be deleted, and the
        #    id cannot be taken by another uid.
        trainer = start_trainer(d, OWNER, "--restore")
        before = rank0(d)["latest_durable_step"]
        try:
            wait_for("a step of the new trainer",
                     lambda: (rank0(d) or {}).get("latest_durable_step", 0) > before and
                     not rank0(d)["stale"])
        except AssertionError:
            trainer.kill()
            raise AssertionError("trainer: %s\n%s" % (trainer.communicate()[1], rank0(d)))
        p = ctl(d, OWNER, "delete", "life")
        assert p.returncode == 1 and "FAILED_PRECONDITION" in p.stderr, p.stderr
        squat = subprocess.run(setpriv(OTHER) + harness.trainer_cmd(d, "life", "--steps=2", *TRAIN),
                               capture_output=True, text=True, timeout=120)
        assert squat.returncode != 0 and "PERMISSION_DENIED" in squat.stderr, squat.stderr
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        trainer = None
        wait_for("the rank to turn stale again", lambda: rank0(d)["stale"])

        # 5. The owner deletes the job: every file and record goes.
        p = ctl(d, OWNER, "--json", "delete", "life")
        assert p.returncode == 0, p.stderr
        deleted = json.loads(p.stdout)
        assert deleted["ranks"] == 1 and deleted["versions_deleted"] > 0, deleted
        assert rank0(d) is None
        assert not os.path.exists(os.path.join(d.data, "jobs", "life"))
        p = ctl(d, OWNER, "plan", "life")
        assert p.returncode == 1 and "does not exist" in p.stderr, p.stderr
        print("ok: deleted %d versions (%d bytes) and %d events; nothing of the job is left"
              % (deleted["versions_deleted"], deleted["bytes_deleted"], deleted["events_deleted"]))

        # 6. The id is free: uid 4243 takes it, with no history.
        taken = subprocess.run(setpriv(OTHER) + harness.trainer_cmd(d, "life", "--steps=2", *TRAIN),
                               capture_output=True, text=True, timeout=120)
        assert taken.returncode == 0, taken.stderr
        job = [j for j in d.ctl("jobs")["jobs"] if j["job_id"] == "life"][0]
        assert job["owner_uid"] == OTHER and job["ranks"][0]["latest_durable_step"] == 2, job
        print("ok: uid %d took the freed id" % OTHER)
        evicted_squatter(d)
        return 0
    finally:
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
