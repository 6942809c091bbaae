"""The two-node kill matrix: one ckptd dies at each kill point of the commit
protocol while the other commits, and a restore never mixes steps.

Two simulated nodes (two ckptd, each with its own data directory), two
ranks each: four FSDP2 ranks of a small GPT on CPU (gloo), the ranks of
tests/python/test_torch_dist.py, agreeing on the durable step every 2 steps.
For each kill point compiled into ckptd (commit, event and snapshot; GC's
is left to the crash suite), node 1's ckptd is started with
CKPT_KILL_AT=<point>:<n> and dies at that hit, in step 3 or 4, while the
ranks train 12 steps; ranks 2 and 3 train on unprotected (on_daemon_loss="continue"). Then
node 1's ckptd is started again (it recovers its data directory) and four
new ranks restore the job:
- every rank restores the same step, no older than any agreed durable step
  a rank saw during the run (0 lost acknowledged global steps);
- every layer comes from the same step on every rank (0 mixed-step layers:
  a layer's shards are spread over all four ranks);
- with policy `all`, each rank's tensors equal the failure-free run's at
  that step bit for bit, and so does every step trained after it.
snapshot.drift is reached only under LayerCheck: that row runs policy
`layercheck` and checks the first two.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing. A kill point name as argument runs that row alone.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "crash"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import test_torch_dist as job  # noqa: E402
from crash_driver import kill_points  # noqa: E402

STEPS = 12
COMMON = ["--steps", str(STEPS), "--agree-every", "2", "--on-daemon-loss", "continue"]


# Hit once per publish group of versions, not once per version.
PER_GROUP = ("commit.after_datasync", "commit.after_dirsync", "commit.after_index")


def hit(point):
    """Which hit of `point` kills: one in step 3 or 4, once steps are durable
    (node 1 commits 16 layer versions a step: 8 layers on each of 2 ranks,
    published in groups of a few; the other points are hit once a step per
    rank)."""
    if point in PER_GROUP:
        return 12
    return 40 if point.startswith("commit.") else 7


def row(root, point, want):
    policy = "layercheck" if point == "snapshot.drift" else "all"
    name = "km-" + point.replace(".", "-")
    kill_log = os.path.join(root, name + "-kill.log")
    node1 = harness.Daemon(os.path.join(root, name + "-node1"),
                           env={"CKPT_KILL_AT": "%s:%d" % (point, hit(point)),
                                "CKPT_KILL_LOG": kill_log})
    daemons = [harness.Daemon(os.path.join(root, name + "-node0")).start(), node1.start()]
    try:
        logs, _ = job.ranks(root, daemons, name, "fsdp2", COMMON + ["--policy", policy])
        died = node1.proc.poll() is not None
        hits = open(kill_log).read().split() if os.path.exists(kill_log) else []
        check(died and hits and hits[-1] == point,
              "%s: node 1's ckptd died at its kill point while the ranks trained" % point)
        seen = [row.get("agreed") or 0 for p in logs for row in harness.read_jsonl(p)
                if "step" in row]
        acknowledged = max(seen)
        node1.env = None
        node1.start()  # recovers node 1's data directory
        logs, _ = job.ranks(root, daemons, name, "fsdp2",
                            COMMON + ["--policy", policy, "--restore"], tag="-again")
        restored = [[r for r in harness.read_jsonl(p) if "restored" in r][-1] for p in logs]
        target = restored[0]["restored"]
        check(all(r["restored"] == target for r in restored) and target >= acknowledged,
              "%s: every rank restored step %d, no older than the newest agreed durable step "
              "seen during the run (%d)" % (point, target, acknowledged))
        mixed = [l for l in restored[0]["layers"]
                 if len({r["layers"][l] for r in restored}) != 1]
        check(not mixed and all(set(r["layers"]) == set(restored[0]["layers"])
                                for r in restored),
              "%s: every layer restored from one step on all four ranks (0 mixed-step "
              "layers of %d)" % (point, len(restored[0]["layers"])))
        if policy == "all":
            got = [job.hashes(p) for p in logs]
            check(all(r["hash"] == want[i][target] for i, r in enumerate(restored)) and
                  all(got[i][t] == want[i][t] for i in range(job.WORLD)
                      for t in range(target + 1, STEPS + 1)),
                  "%s: bit-exact with the failure-free run at step %d and every step after"
                  % (point, target))
        return target
    finally:
        for d in daemons:
            d.kill()


def main():
    root = harness.tempdir("ckpt-km-")
    points = [p for p in kill_points() if not p.startswith("gc.")]
    if len(sys.argv) > 1:
        points = sys.argv[1:]
    daemons = [harness.Daemon(os.path.join(root, "ref-node%d" % n)).start() for n in range(2)]
    try:
        logs, res = job.ranks(root, daemons, "ref", "fsdp2", COMMON)
        check(all(r["durable"] == STEPS for r in res), "the failure-free run: %d steps durable "
              "on every rank" % STEPS)
        want = [job.hashes(p) for p in logs]
    finally:
        for d in daemons:
            d.kill()
    targets = {p: row(root, p, want) for p in points}
    print("FIGURES kill matrix (kill point: restored step of %d): %s" % (STEPS, targets))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
