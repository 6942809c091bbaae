"""Nobody takes another user's job on any node, and a remote tier never
serves what a ckptd of the cluster did not write.

Several ckptd processes ("nodes", each with its own data directory) share one
POSIX remote tier and one cluster key, as the nodes of a cluster would:

1. uid 4242 trains job "victim" rank 0 on node A until it is in the remote
   tier. On fresh node B, uid 4243 registers "victim" rank 1 (a rank no node
   holds): refused, and nothing of it reaches the victim's prefix. On fresh
   node C, uid 4243's `ckptctl plan victim --rank=1` finds no such job. uid
   4242 restores rank 0 on node B bit-exact and `ckptctl jobs` lists it.
2. A new job id is claimed once for the whole cluster: uid 4243 creates
   "claimed" on node B; uid 4242 cannot register it on node C.
3. A forged history: a ckptd with another key builds job "victim" (labelled
   as uid 4242's) up to a later step, and its manifests and new objects are
   planted in the real remote tier. A fresh node restores the genuine newest
   step (every layer equal to what the genuine trainer logged), never the
   forged one, and counts the forged manifests as corrupt.
4. A FIFO planted in place of a version object of the newest step: the pull
   on a fresh node does not block; it restores the step before bit-exact,
   and ckptd stops at once on SIGTERM.
5. A remote directory others can write is refused at start-up, with the
   reason.

Needs root and setpriv; exits 77 otherwise.
"""

import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

VICTIM, ATTACKER, GROUP = 4242, 4243, 0
LAYERS = 4
TRAIN = ["--layers=%d" % LAYERS, "--layer-bytes=64K", "--policy=all", "--quiet"]


def setpriv(uid):
    return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % GROUP, "--clear-groups", "--"]


def trainer(d, uid, job, *args, timeout=300):
    return subprocess.run(setpriv(uid) + harness.trainer_cmd(d, job, *TRAIN, *args),
                          capture_output=True, text=True, timeout=timeout)


def ctl(d, uid, *args):
    return subprocess.run(setpriv(uid) + [harness.CKPTCTL, "--socket=" + d.socket, "--json"] +
                          list(args), capture_output=True, text=True, timeout=120)


def node(root, name, remote, key):
    d = harness.Daemon(os.path.join(root, name),
                       extra=["--remote_kind=posix", "--remote_path=" + remote,
                              "--remote_key_file=" + key])
    d.start()
    # Trainers of other uids reach the sockets (the test layout's group is root's).
    os.chmod(d.root, 0o755)
    return d


def wait_remote(d, job, step, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for j in d.ctl("jobs")["jobs"]:
            if j["job_id"] == job and all(r.get("remote_step", 0) >= step for r in j["ranks"]):
                return
        time.sleep(0.1)  # a poll with a deadline
    raise AssertionError("%s did not reach the remote tier up to step %d:\n%s" %
                         (job, step, d.log()[-2000:]))


def restored_step(out):
    for line in out.stdout.splitlines():
        if line.startswith("composite restore"):
            return int(line.split("to step ")[1].split()[0])
    raise AssertionError("no restore printed: %s %s" % (out.stdout, out.stderr))


def main():
    unavailable = harness.other_uids_unavailable()
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    root = harness.tempdir("ckpt-remote-trust-")
    os.chmod(root, 0o755)
    remote = os.path.join(root, "remote")
    key = harness.remote_key(root)
    nodes = []
    try:
        # 1. Ownership across nodes.
        a = node(root, "a", remote, key)
        nodes.append(a)
        log = os.path.join(root, "victim.jsonl")
        open(log, "w").close()
        os.chmod(log, 0o666)
        out = trainer(a, VICTIM, "victim", "--steps=12", "--log=" + log)
        harness.check(out.returncode == 0, "the victim trains on node A: %s" % out.stderr)
        wait_remote(a, "victim", 12)
        b = node(root, "b", remote, key)
        nodes.append(b)
        take = trainer(b, ATTACKER, "victim", "--rank=1", "--steps=3")
        harness.check(take.returncode != 0 and "PERMISSION_DENIED" in take.stderr,
                      "uid 4243 cannot register a rank of uid 4242's job on a fresh node: %s %s" %
                      (take.returncode, take.stderr[-400:]))
        harness.check(not os.path.exists(os.path.join(remote, "jobs", "victim", "rank-00000001")),
                      "nothing of the refused rank reached the victim's prefix")
        c = node(root, "c", remote, key)
        nodes.append(c)
        plan = ctl(c, ATTACKER, "plan", "victim", "--rank=1")
        harness.check(plan.returncode != 0 and "does not exist" in plan.stderr,
                      "uid 4243's plan of the victim's job on a third node finds no job: %s" %
                      plan.stderr)
        back = trainer(b, VICTIM, "victim", "--steps=14", "--restore", "--verify-log=" + log,
                       "--log=" + log)
        harness.check(back.returncode == 0 and restored_step(back) == 12 and
                      "verify: %d of %d layers match" % (LAYERS, LAYERS) in back.stdout,
                      "uid 4242 restores its job on node B bit-exact: %s %s" %
                      (back.stdout[-600:], back.stderr[-400:]))
        listed = ctl(b, VICTIM, "jobs")
        harness.check(listed.returncode == 0 and '"victim"' in listed.stdout,
                      "uid 4242's ckptctl jobs on node B lists its job")
        wait_remote(b, "victim", 14)
        print("ownership: the other uid's register on B refused, its plan on C NOT_FOUND; the "
              "owner restored step 12 on B bit-exact and trained on to 14")

        # 2. A new job id belongs to its first user on every node.
        first = trainer(b, ATTACKER, "claimed", "--steps=2")
        harness.check(first.returncode == 0, "uid 4243 creates job claimed on B: %s" % first.stderr)
        second = trainer(c, VICTIM, "claimed", "--steps=2")
        harness.check(second.returncode != 0 and "PERMISSION_DENIED" in second.stderr,
                      "uid 4242 cannot take job claimed on C: %s" % second.stderr[-400:])
        print("claim: a job id created on B is refused to another uid on C")

        # 3. A forged history, built with another key and planted.
        forge_remote = os.path.join(root, "forge-remote")
        forge_key = harness.remote_key(root, "forge.key")
        f = node(root, "forger", forge_remote, forge_key)
        nodes.append(f)
        forged = trainer(f, VICTIM, "victim", "--steps=30", "--seed=99")
        harness.check(forged.returncode == 0, "the forger builds its own victim: %s" % forged.stderr)
        wait_remote(f, "victim", 30)
        real_rank = os.path.join(remote, "jobs", "victim", "rank-00000000")
        planted = 0
        for path in sorted(glob.glob(os.path.join(forge_remote, "jobs", "victim",
                                                  "rank-00000000", "*", "*"))):
            target = os.path.join(real_rank, os.path.relpath(path, os.path.dirname(
                os.path.dirname(path))))
            if not os.path.exists(target):
                shutil.copy2(path, target)
                planted += 1
        harness.check(planted > 0, "forged manifests and objects planted (%d)" % planted)
        e = node(root, "e", remote, key)
        nodes.append(e)
        got = trainer(e, VICTIM, "victim", "--steps=15", "--restore", "--verify-log=" + log,
                      "--log=" + log)
        harness.check(got.returncode == 0 and restored_step(got) == 14 and
                      "verify: %d of %d layers match" % (LAYERS, LAYERS) in got.stdout,
                      "a fresh node restores the genuine step 14, not the forged 30: %s %s" %
                      (got.stdout[-600:], got.stderr[-400:]))
        corrupt = harness.metric(e.ctl("status")["metrics_address"], "ckpt_remote_failures_total",
                                 'reason="corrupt"') or 0
        harness.check(corrupt > 0, "the forged manifests are counted as corrupt (%d)" % corrupt)
        harness.check("MAC" in e.log(), "the log says why the forged manifests were refused")
        print("forgery: %d forged files planted; the fresh node restored the genuine step 14 "
              "(%d corrupt manifests refused)" % (planted, corrupt))

        # 4. A FIFO in place of an object of the newest step (15, from node E).
        wait_remote(e, "victim", 15)
        fifo_remote = os.path.join(root, "fifo-remote")
        shutil.copytree(remote, fifo_remote, symlinks=True)
        newest = sorted(glob.glob(os.path.join(fifo_remote, "jobs", "victim", "rank-00000000",
                                               "v", "L00000000-S%016x-*" % 15)))
        harness.check(newest, "the object of layer 0 at step 15 exists")
        os.unlink(newest[0])
        os.mkfifo(newest[0], 0o640)
        g = node(root, "g", fifo_remote, key)
        nodes.append(g)
        start = time.time()
        pulled = trainer(g, VICTIM, "victim", "--steps=0", "--restore", timeout=120)
        took = time.time() - start
        harness.check(pulled.returncode != 0 and "lost its version of step 15" in pulled.stderr,
                      "a FIFO object loses its version: step 15 is refused: %s" %
                      pulled.stderr[-400:])
        pulled = trainer(g, VICTIM, "victim", "--steps=16", "--restore", "--older-within=1000",
                         "--verify-log=" + log, timeout=120)
        harness.check(pulled.returncode == 0 and restored_step(pulled) == 15 and
                      "(step 15 was lost)" in pulled.stdout and
                      "verify: %d of %d layers match" % (LAYERS, LAYERS) in pulled.stdout,
                      "asked to, step 15 with layer 0's previous version: %s %s" %
                      (pulled.stdout[-600:], pulled.stderr[-400:]))
        t0 = time.time()
        rc = g.stop(timeout=30)
        harness.check(rc == 0, "ckptd stops on SIGTERM with the FIFO there (exit %s)" % rc)
        print("fifo: the pull went on past it in %.1f s; ckptd stopped in %.1f s" %
              (took, time.time() - t0))

        # 5. A remote directory others can write.
        open_dir = os.path.join(root, "open-remote")
        os.makedirs(open_dir)
        os.chmod(open_dir, 0o777)
        h = harness.Daemon(os.path.join(root, "h"),
                           extra=["--remote_kind=posix", "--remote_path=" + open_dir,
                                  "--remote_key_file=" + key])
        try:
            h.start()
            refused = False
        except RuntimeError as err:
            refused = "another user" in str(err)
        harness.check(refused, "ckptd refuses a world-writable remote directory:\n%s" % h.log())
        print("open directory: refused at start-up")
        for n in nodes:
            harness.check(n.stop() in (0, None), "ckptd %s stops cleanly" % n.root)
        print("remote trust: all checks passed")
        return 0
    finally:
        for n in nodes:
            n.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
