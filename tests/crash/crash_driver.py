"""Crash driver: ckptd dies again and again while a trainer runs.

The trainer keeps training through every daemon death (it continues
unprotected and re-registers when the daemon is back) and appends each durable
acknowledgement to an ack log outside the data directory (the oracle): for
every layer, the newest step staged at or before the acknowledged step. After
each restart the checker requires, for every layer, plan(latest).step >= the
acknowledged step (lost = 0), and at the end every visible version must verify
(torn = 0). Seeds are printed; --seed and --kills reproduce a run.

The kills start once the ack log holds an acknowledged step: until then a
ckptd that died at an armed kill point is started again (a new life, so a new
kill seed), and the driver waits for the trainer's next acknowledgement, not
for a time.

Modes:
  blackbox (default)  SIGKILL at uniform random moments in [min-delay, max-delay].
  --kill-points       also armed to die at random kill points (CKPT_KILL_ODDS);
                      every life of ckptd gets its own CKPT_KILL_SEED (the
                      run's seed * 1000 + the life's number), so one life
                      that dies before its first acknowledgement does not
                      make every later life die at the same hit.
  --whitebox          every kill names its kill point (CKPT_KILL_AT=point:n,
                      n random in 1..5), going round every kill point compiled
                      into ckptd (found in the sources), so all are covered;
                      a point not reached in time is a blackbox kill instead.
                      The run uses LayerCheck (to reach snapshot.drift) and a
                      1 s GC with short retention (to reach gc.before_remove).

Usage: crash_driver.py [--kills=N] [--minutes=M] [--seed=S]
       [--policy=explicit|all|layercheck] [--min-delay=S] [--max-delay=S]
       [--kill-points | --whitebox]
"""

import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import re
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "daemon")


def kill_points():
    """Every CKPT_KILL_POINT("name") in the daemon's sources, sorted; the
    replica service's (replica.*) only fire on a peer, which
    tests/integration/test_peer.py kills at each of them."""
    names = set()
    for dirpath, _, files in os.walk(SOURCES):
        for f in files:
            if f.endswith((".cc", ".h")):
                with open(os.path.join(dirpath, f)) as src:
                    names.update(re.findall(r'CKPT_KILL_POINT\("([^"]+)"\)', src.read()))
    return sorted(n for n in names if not n.startswith("replica."))


class CrashDaemon(harness.Daemon):
    """A ckptd whose every start is a new life: armed with CKPT_KILL_ODDS, a
    life gets CKPT_KILL_SEED = kill_seed * 1000 + its number. One seed for
    every life would make every life die at the same hit of a kill point, so a
    run whose seed dies within the first step's hits would never acknowledge
    a step at all."""

    def __init__(self, *args, kill_seed=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.kill_seed = kill_seed
        self.lives = 0

    def start(self, timeout=30.0):
        self.lives += 1
        if self.env and "CKPT_KILL_ODDS" in self.env:
            self.env = dict(self.env, CKPT_KILL_SEED=str(self.kill_seed * 1000 + self.lives))
        return super().start(timeout)


def start(daemon, attempts=20):
    """Starts ckptd; an armed kill point may kill it during start-up
    (recovery runs the commit and GC paths too): that is a death like any
    other, so it is started again."""
    for _ in range(attempts):
        try:
            return daemon.start()
        except RuntimeError:
            if daemon.proc is None or daemon.proc.returncode != -9:
                raise
    raise AssertionError("ckptd died at start-up %d times in a row" % attempts)


def check(daemon, job, ack_rows, layers):
    """Returns the number of layers whose latest durable version is older than acked."""
    if not ack_rows:
        return 0, None
    acked = ack_rows[-1]
    plan = None
    for _ in range(20):
        plan = daemon.ctl("plan", job, check=False)
        if plan is not None:
            break
        if daemon.proc.poll() is not None:  # died at an armed kill point meanwhile
            start(daemon)
        else:
            time.sleep(0.05)
    if plan is None:
        raise AssertionError("no plan after an acknowledged step %d" % acked["durable"])
    lost = 0
    for lp in plan["layers"]:
        want = acked["layers"][lp["layer"]]
        if want > 0 and (not lp["has_version"] or lp["step"] < want):
            print("LOST: layer %d acked at step %d, latest durable %s" %
                  (lp["layer"], want, lp.get("step")))
            lost += 1
    if plan["target_step"] < acked["durable"]:
        print("LOST: latest durable step %d < acknowledged %d" % (plan["target_step"], acked["durable"]))
        lost += 1
    return lost, plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--policy", default="explicit")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--min-delay", type=float, default=0.1)
    ap.add_argument("--max-delay", type=float, default=1.0)
    ap.add_argument("--kill-points", action="store_true")
    ap.add_argument("--kill-odds", type=int, default=1500)
    ap.add_argument("--whitebox", action="store_true")
    ap.add_argument("--minutes", type=float, default=0,
                    help="stop killing after this long (0 = run all --kills)")
    args = ap.parse_args()
    points = kill_points() if args.whitebox else []
    if args.whitebox:
        args.policy = "layercheck"
        print("kill points (%d): %s" % (len(points), " ".join(points)), flush=True)
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % 1000000007
    print("crash_driver seed=%d kills=%d policy=%s" % (seed, args.kills, args.policy), flush=True)
    rng = random.Random(seed)

    root = harness.tempdir("ckpt-crash-")
    oracle_dir = harness.tempdir("ckpt-oracle-")  # outside the daemon's data directory
    ack_log = os.path.join(oracle_dir, "acks.jsonl")
    kill_log = os.path.join(oracle_dir, "killpoints.log")
    job = "crash"
    env = {}
    extra = []
    if args.kill_points:
        env = {"CKPT_KILL_ODDS": str(args.kill_odds), "CKPT_KILL_LOG": kill_log}
    if args.whitebox:
        extra = ["--gc_interval_s=1", "--keep_last_events=3", "--keep_every_steps=0"]
    daemon = CrashDaemon(root, pool_bytes=64 << 20, env=env, extra=extra, kill_seed=seed)
    not_reached = collections.Counter()
    trainer = None
    lost_total = 0
    checks = 0
    restarts = 0
    point_deaths = 0
    try:
        start(daemon)
        trainer = subprocess.Popen(
            harness.trainer_cmd(daemon, job, "--layers=%d" % args.layers,
                                "--layer-bytes=64K,256K,512K", "--steps=100000000",
                                "--policy=" + args.policy, "--durable-every=1",
                                *(["--optimizer=adamw", "--warmup=0", "--k0=1e-3"]
                                  if args.policy == "layercheck" else []),
                                "--ack-log=" + ack_log, "--on-daemon-loss=continue", "--reconnect-ms=30",
                                "--compute-ms=2", "--quiet" if not os.environ.get("CKPT_KEEP_TMP") else "--compute-ms=2", "--seed=%d" % (seed % 1000)),
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(oracle_dir, "trainer.err"), "w"),
            text=True)
        # The first kill only once the trainer registered and a step was
        # acknowledged. Armed with kill points, ckptd may die before that: it
        # is started again (a new life, a new kill seed) and the trainer
        # re-registers, rather than being left dead while the driver waits.
        # The bound only stops a hang; deaths at kill points do not use it up.
        first_lives = 0
        deadline = time.time() + 300
        while not harness.read_jsonl(ack_log):
            if trainer.poll() is not None:
                with open(os.path.join(oracle_dir, "trainer.err")) as f:
                    raise AssertionError("trainer died (%s) before its first acknowledgement:\n%s" %
                                         (trainer.returncode, f.read()[-3000:]))
            if daemon.proc.poll() is not None:  # died at an armed kill point
                if daemon.proc.returncode != -9:
                    raise AssertionError("ckptd exited with %d before the first acknowledgement; log:\n%s"
                                         % (daemon.proc.returncode, daemon.log()[-3000:]))
                first_lives += 1
                if first_lives > 50:  # about 6 % of lives die within the first two steps
                    raise AssertionError("ckptd died at kill points %d lives in a row before any "
                                         "acknowledgement (seed=%d)" % (first_lives, seed))
                start(daemon)
                deadline = time.time() + 300
            elif time.time() > deadline:
                raise AssertionError("no acknowledgement from a live ckptd in 300 s (a hang); log:\n%s"
                                     % daemon.log()[-3000:])
            time.sleep(0.02)
        if first_lives:
            print("  %d lives died at kill points before the first acknowledgement" % first_lives,
                  flush=True)
        started = time.time()
        for i in range(args.kills):
            if args.minutes and time.time() - started > 60 * args.minutes:
                print("  time is up after %d kills" % i, flush=True)
                args.kills = i
                break
            delay = rng.uniform(args.min_delay, args.max_delay)
            point = points[i % len(points)] if points else None
            if point:
                # Armed for this life only: die at the n-th hit of `point`.
                daemon.kill()
                daemon.env = {"CKPT_KILL_AT": "%s:%d" % (point, rng.randint(1, 5)),
                              "CKPT_KILL_LOG": kill_log}
                try:
                    daemon.start()
                except RuntimeError:  # died at the point during start-up recovery
                    if daemon.proc.returncode != -9:
                        raise
                delay = max(delay, 3.0)  # rare points need a few steps
            deadline = time.time() + delay
            while time.time() < deadline and daemon.proc.poll() is None:
                time.sleep(0.005)
            if daemon.proc.poll() is not None:
                point_deaths += 1  # died at an armed kill point
            else:
                if point:
                    not_reached[point] += 1
                daemon.kill()
            if trainer.poll() is not None:
                with open(os.path.join(oracle_dir, "trainer.err")) as f:
                    raise AssertionError("trainer died (%s):\n%s" % (trainer.returncode, f.read()[-3000:]))
            acks = harness.read_jsonl(ack_log)
            if point:
                daemon.env = None  # the check runs on a disarmed daemon
            start(daemon)
            restarts += 1
            lost, plan = check(daemon, job, acks, args.layers)
            lost_total += lost
            checks += 1
            if (i + 1) % 10 == 0:
                print("  %d kills, %d acks so far, latest durable %s, lost %d" %
                      (i + 1, len(acks), plan["target_step"] if plan else None, lost_total),
                      flush=True)
        # Let the trainer make progress on a healthy daemon, then stop it.
        time.sleep(1.0)
        trainer.kill()
        trainer.wait()
        trainer = None
        # The final check runs on a daemon without armed kill points.
        daemon.kill()
        daemon.env = None
        daemon.start()
        acks = harness.read_jsonl(ack_log)
        lost, _ = check(daemon, job, acks, args.layers)
        lost_total += lost
        verify = daemon.ctl("verify", job, "--deep", timeout=1800)
        torn = len(verify["failures"])
        for f in verify["failures"]:
            print("TORN: %s" % f)
        log = daemon.log()
        recon = collections.Counter()
        for line in log.splitlines():
            if "reconciled:" in line:
                parts = line.split("reconciled:")[1].replace(" and ", ", ").split(",")
                for p in parts:
                    words = p.split()
                    if words and words[0].isdigit():
                        recon[" ".join(words[1:3])] += int(words[0])
        print("kills=%d restarts=%d checks=%d acked_steps=%d versions_verified=%d "
              "lost=%d torn=%d" % (args.kills, restarts, checks, len(acks),
                                   verify["versions_checked"], lost_total, torn))
        print("start-up cleanup totals: %s" % dict(recon))
        hits = collections.Counter()
        if os.path.exists(kill_log):
            with open(kill_log) as f:
                hits = collections.Counter(l.strip() for l in f if l.strip())
            print("deaths at kill points: %d %s" % (sum(hits.values()), dict(hits)))
        if args.whitebox:
            missed = [p for p in points if hits[p] == 0]
            print("kill points hit: %d of %d%s; armed but not reached in time: %s" % (
                len(points) - len(missed), len(points),
                " (never: %s)" % " ".join(missed) if missed else "", dict(not_reached)))
            if missed and args.kills >= 3 * len(points):
                print("FAILED: kill points never hit (seed=%d)" % seed)
                return 1
        if len(acks) == 0:
            raise AssertionError("no step was ever acknowledged; the test proved nothing")
        if lost_total or torn:
            print("FAILED (seed=%d)" % seed)
            return 1
        return 0
    finally:
        if trainer is not None:
            trainer.kill()
        daemon.kill()
        # No `return` here: it would swallow a failure and exit 0.
        if os.environ.get("CKPT_KEEP_TMP"):
            print("kept %s and %s" % (root, oracle_dir))
        else:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(oracle_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
