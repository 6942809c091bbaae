"""Large registration tables are charged, bounded and leave others alone.

Reproduced against ckptd: two registrations of 30,000 layers with 1 KiB
names (58.9 MiB of tables) were charged to no quota
(ckpt_uid_index_used_bytes read 0) and made another user's Register and plan
of a 200-layer job 40 and 480 times slower, still after the attacker had
deleted both jobs. Now, with max_index_bytes_per_uid = 16 MiB:
- a table past max_registration_table_bytes (8 MiB) is refused with
  INVALID_ARGUMENT naming the option, before anything is written;
- two 6.6 MB tables are charged to their owner's index quota (the gauge
  shows them), and a third is refused with RESOURCE_EXHAUSTED naming
  max_index_bytes_per_uid, leaving no job behind;
- deleting the jobs gives the bytes back;
- the victim (another uid) registers, trains, plans and restores its
  200-layer job throughout. Its Register and plan times before, during and
  after are printed against each other (a ratio, not asserted).
Needs root and setpriv (two uids); exits 77 otherwise.
"""

import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

VICTIM, ATTACKER, GROUP = 4242, 4243, 0
MiB = 1 << 20
INDEX_QUOTA = 16 * MiB
WIDE = 6000  # layers of each attacking table, 1 KiB names: about 6.6 MB


def setpriv(uid):
    return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % GROUP, "--clear-groups", "--"]


ATTACK = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import ckpt
sock, layers, job = sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = ckpt.Client(sock, call_timeout_s=120.0)
region = client.allocate_region(layers * 64)
spec = {"job_id": job, "layers": [
    {"name": ("n" * 1000) + str(i), "tensors": [
        {"name": "w", "shape": [16], "region": region.index, "offset": i * 64}]}
    for i in range(layers)]}
try:
    client.register(spec)
    print("OK", flush=True)
except ckpt.Error as e:
    print(e.code, e.message, flush=True)
    sys.exit(0)
sys.stdin.read()  # stay registered until told
"""


def victim_round(d, what, n):
    """The victim's n-th round: its 200-layer job registered (restoring the
    rounds before) and trained 2 more steps, then planned, both timed;
    returns (register+restore+train seconds, plan seconds)."""
    t0 = time.time()
    out = subprocess.run(setpriv(VICTIM) + harness.trainer_cmd(
        d, "victim", "--layers=200", "--layer-bytes=4K", "--steps=%d" % (2 * n), "--policy=all",
        "--quiet", *(["--restore"] if n > 1 else [])), capture_output=True, text=True,
        timeout=600)
    train = time.time() - t0
    assert out.returncode == 0, "%s: %s" % (what, out.stderr[-2000:])
    t0 = time.time()
    p = subprocess.run(setpriv(VICTIM) + [harness.CKPTCTL, "--socket=" + d.socket, "plan",
                                          "victim"], capture_output=True, text=True, timeout=600)
    plan = time.time() - t0
    assert p.returncode == 0, p.stderr
    print("victim %-18s register, restore, 2 steps %.2f s; plan %.3f s" % (what, train, plan))
    return train, plan


def main():
    unavailable = harness.other_uids_unavailable(python_client=True)
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    client_dir = os.path.join(harness.BUILD, "python")
    root = harness.tempdir("ckpt-tables-")
    os.chmod(root, 0o755)
    d = harness.Daemon(os.path.join(root, "d"), extra=[
        "--max_index_bytes_per_uid=%d" % INDEX_QUOTA, "--gc_interval_s=0",
        "--max_message_bytes=%d" % (64 * MiB)])
    attackers = []
    try:
        d.start()
        address = d.ctl("status")["metrics_address"]
        script = os.path.join(root, "attack.py")
        with open(script, "w") as f:
            f.write(ATTACK)
        os.chmod(script, 0o644)

        def attack(layers, job):
            p = subprocess.Popen(setpriv(ATTACKER) + [sys.executable, script, client_dir,
                                                      d.socket, str(layers), job],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            answer = p.stdout.readline().strip()
            attackers.append(p)
            return answer

        before = victim_round(d, "before", 1)
        answer = attack(9000, "too-wide")
        check(answer.startswith("INVALID_ARGUMENT") and "max_registration_table_bytes" in answer,
              "a table past max_registration_table_bytes is refused: %s" % answer[:200])
        for job in ("wide-1", "wide-2"):
            answer = attack(WIDE, job)
            check(answer == "OK", "a %d-layer table of uid %d registers: %s"
                  % (WIDE, ATTACKER, answer[:200]))
        used = harness.metric(address, "ckpt_uid_index_used_bytes", 'uid="%d"' % ATTACKER)
        check(used is not None and used > 2 * WIDE * 1000,
              "the two tables count against uid %d's index quota: %s bytes of %d"
              % (ATTACKER, used, INDEX_QUOTA))
        answer = attack(WIDE, "wide-3")
        check(answer.startswith("RESOURCE_EXHAUSTED") and "max_index_bytes_per_uid" in answer,
              "a third is refused by the index quota: %s" % answer[:200])
        p = subprocess.run(setpriv(ATTACKER) + [harness.CKPTCTL, "--socket=" + d.socket, "plan",
                                                "wide-3"], capture_output=True, text=True)
        check(p.returncode != 0 and "does not exist" in p.stderr,
              "the refused registration left no job")
        during = victim_round(d, "while registered", 2)
        for p in attackers:
            p.stdin.close()
            p.wait(timeout=60)
        attackers = []
        for job in ("wide-1", "wide-2"):
            p = subprocess.run(setpriv(ATTACKER) + [harness.CKPTCTL, "--socket=" + d.socket,
                                                    "delete", job],
                               capture_output=True, text=True, timeout=300)
            check(p.returncode == 0, "uid %d deletes %s: %s" % (ATTACKER, job, p.stderr.strip()))
        used = harness.metric(address, "ckpt_uid_index_used_bytes", 'uid="%d"' % ATTACKER) or 0
        check(used == 0, "deleting the jobs gave the bytes back (%d)" % used)
        after = victim_round(d, "after the delete", 3)
        print("FIGURES large_tables: victim register+train %.2f/%.2f/%.2f s, plan "
              "%.3f/%.3f/%.3f s (before/during/after); ratios during/before %.2f, %.2f; "
              "after/before %.2f, %.2f"
              % (before[0], during[0], after[0], before[1], during[1], after[1],
                 during[0] / before[0], during[1] / before[1], after[0] / before[0],
                 after[1] / before[1]))
        assert d.stop() == 0, d.log()[-3000:]
        return 0
    finally:
        for p in attackers:
            p.kill()
            p.wait()
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
