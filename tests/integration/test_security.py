"""Security: identity from SO_PEERCRED, job ownership by uid, socket and
directory permissions, name validation (docs/reliability.md).

ckptd runs as root on a private socket. Clients run as other users through
`setpriv` (no accounts needed): uid 4242 owns a job; uid 4243 is in the same
group (so it can reach the socket) but must not read, plan, restore, export,
verify, collect or register into 4242's job; uid 4244 is in no permitted
group and cannot reach the socket at all. Every attempt is counted; the test
fails on any unauthorised success. Skips (77) when not root or without
setpriv.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

import harness

OWNER, INTRUDER, OUTSIDER = 4242, 4243, 4244
GROUP = 0  # the socket directory's group: root's, as in the test layout


def as_user(uid, gid, cmd, timeout=120):
    return subprocess.run(["setpriv", "--reuid=%d" % uid, "--regid=%d" % gid, "--clear-groups",
                           "--"] + cmd, capture_output=True, text=True, timeout=timeout)


class Tally:
    def __init__(self):
        self.attempts = 0
        self.unauthorised = 0

    def refused(self, what, proc, *needles):
        """Counts an attempt that must fail with one of `needles` in its output."""
        self.attempts += 1
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or not any(n in out for n in needles):
            self.unauthorised += proc.returncode == 0
            raise AssertionError("%s: exit %d, expected a refusal containing %r:\n%s"
                                 % (what, proc.returncode, needles, out))
        print("ok: refused: %s" % what)


def flood(daemon, ctl, tally):
    """uid INTRUDER floods ckptd with deep verifies and status calls of its own
    job while the owner trains: the heavy calls beyond max_heavy_calls are
    refused at once, and the owner's training never fails or times out."""
    p = as_user(INTRUDER, GROUP, harness.trainer_cmd(
        daemon, "theirs", "--layers=6", "--layer-bytes=1M", "--steps=20", "--policy=all",
        "--quiet"))
    assert p.returncode == 0, p.stderr
    victim = subprocess.Popen(
        ["setpriv", "--reuid=%d" % OWNER, "--regid=%d" % GROUP, "--clear-groups", "--"] +
        harness.trainer_cmd(daemon, "victim", "--layers=4", "--layer-bytes=256K", "--steps=150",
                            "--compute-ms=5", "--policy=all", "--quiet"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    flooders = []
    rounds = 0
    while victim.poll() is None and rounds < 40:
        rounds += 1
        for i in range(12):
            args = ["verify", "theirs", "--deep"] if i % 2 == 0 else ["status"]
            flooders.append(subprocess.Popen(
                ["setpriv", "--reuid=%d" % INTRUDER, "--regid=%d" % GROUP, "--clear-groups", "--"]
                + ctl + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for f in flooders[-12:]:
            f.wait(timeout=120)
    out, err = victim.communicate(timeout=300)
    exhausted = sum("RESOURCE_EXHAUSTED" in f.stderr.read() for f in flooders)
    if victim.returncode != 0:
        raise AssertionError("the owner's training failed under the flood:\n" + err[-3000:])
    tally.attempts += len(flooders)
    assert exhausted > 0, "no call was ever refused for max_heavy_calls"
    print("ok: %d flooding calls in %d rounds, %d refused (RESOURCE_EXHAUSTED); the owner's "
          "150 steps all went through" % (len(flooders), rounds, exhausted))


def main():
    unavailable = harness.other_uids_unavailable()
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    root = harness.tempdir("ckpt-sec-")
    os.chmod(root, 0o750)  # group 0 may traverse to the socket directory
    work = os.path.join(root, "work")
    os.makedirs(work)
    os.chmod(work, 0o777)  # scratch space the test users write to
    daemon = harness.Daemon(root, extra=["--max_heavy_calls=2"]).start()
    tally = Tally()
    try:
        sock_dir = os.path.dirname(daemon.socket)
        mode = stat.S_IMODE(os.stat(sock_dir).st_mode)
        sock_mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
        assert mode == 0o750, "socket directory mode %o" % mode
        assert sock_mode == 0o660, "socket mode %o" % sock_mode
        assert stat.S_IMODE(os.stat(daemon.socket + ".fds").st_mode) == 0o660
        print("ok: socket 0660 in a 0750 directory")

        ctl = [harness.CKPTCTL, "--socket=" + daemon.socket]
        trainer = harness.trainer_cmd(daemon, "owned", "--layers=3", "--layer-bytes=64K",
                                      "--steps=12", "--policy=all", "--quiet")
        p = as_user(OWNER, GROUP, trainer)
        assert p.returncode == 0, p.stderr
        p = as_user(OWNER, GROUP, ctl + ["--json", "plan", "owned"])
        assert p.returncode == 0 and json.loads(p.stdout)["target_step"] == 12, p.stderr
        print("ok: the owner trains and plans its job")

        out = os.path.join(work, "stolen")
        for args in (["layers", "owned"], ["plan", "owned"], ["history", "owned"],
                     ["verify", "owned"], ["restore", "owned", "--out=" + out],
                     ["export", "owned", "--out=" + out + ".st"], ["gc", "owned"],
                     ["release", "owned"], ["delete", "owned"]):
            p = as_user(INTRUDER, GROUP, ctl + args)
            tally.refused("uid %d: ckptctl %s" % (INTRUDER, " ".join(args[:2])), p,
                          "does not exist")
            # Word for word what a job that does not exist gets: the refusal
            # does not tell the intruder that the id is in use.
            missing = as_user(INTRUDER, GROUP, ctl + [args[0], "nosuchjob"] + args[2:])
            assert (p.returncode, (p.stdout + p.stderr).replace("owned", "JOB")) == \
                (missing.returncode, (missing.stdout + missing.stderr).replace("nosuchjob", "JOB")), \
                (p.stderr, missing.stderr)
        assert not os.path.exists(out) and not os.path.exists(out + ".st"), "bytes were written"
        p = as_user(INTRUDER, GROUP, ctl + ["--json", "jobs"])
        assert p.returncode == 0 and "owned" not in p.stdout, p.stdout
        print("ok: uid %d does not see the job in `jobs`" % INTRUDER)
        for rank in ("0", "1"):  # take over the owner's rank, or join the job
            tally.refused("uid %d: register rank %s of the job" % (INTRUDER, rank),
                          as_user(INTRUDER, GROUP, harness.trainer_cmd(
                              daemon, "owned", "--rank=" + rank, "--layers=3",
                              "--layer-bytes=64K", "--steps=2", "--quiet")),
                          "belongs to another user")
        tally.refused("uid %d: reach the socket at all" % OUTSIDER,
                      as_user(OUTSIDER, OUTSIDER, ctl + ["status"]), "cannot reach ckptd")

        # The owner's job is intact, and root (the operator) may read it.
        p = subprocess.run(ctl + ["--json", "plan", "owned"], capture_output=True, text=True)
        assert p.returncode == 0 and json.loads(p.stdout)["target_step"] == 12, p.stderr
        p = subprocess.run(ctl + ["verify", "owned", "--deep"], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        print("ok: the job is intact and root can read it")

        flood(daemon, ctl, tally)

        # Names that would leave the job directory are refused before any file access.
        for bad in ("..", "../owned", "a/b", "/etc", "x\u0301", "j" * 300):
            tally.refused("job id %r" % bad, as_user(OWNER, GROUP, ctl + ["plan", bad]),
                          "job id")
    finally:
        daemon.stop()

    # ckptd refuses to serve from a directory other users could write to.
    loose = os.path.join(root, "loose")
    os.makedirs(loose)
    os.chmod(loose, 0o777)
    p = subprocess.run([harness.CKPTD, "--socket=" + os.path.join(loose, "ckptd.sock"),
                        "--data_dir=" + os.path.join(root, "data2"), "--metrics_address=",
                        "--staging_pool_bytes=16777216", "--lock_staging_memory=false"],
                       capture_output=True, text=True, timeout=60)
    tally.attempts += 1
    assert p.returncode != 0 and "writable by group or others" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(loose, "ckptd.sock"))
    print("ok: refused to serve from a world-writable socket directory")

    print("security: %d attempts, %d unauthorised successes" % (tally.attempts, tally.unauthorised))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
