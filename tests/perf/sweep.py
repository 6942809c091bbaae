#!/usr/bin/python3
"""How ckptd's cost grows (docs/scaling.md): four sweeps against a real
ckptd with real trainer processes (tools/scale_trainer.cc), written as one
JSON document and, with --plots, as PNG plots with the growth order of
every curve.

  python3 tests/perf/sweep.py [--quick] [--only=layers,history,ranks,memory]
                              [--out=FILE.json] [--plots=DIR] [--work=DIR]

1. layers: layers per rank 10 .. 10,000 x tensors per layer 1 .. 64, policy
   explicit (8 layers per step: the bytes per step stay the same, so what
   grows is the per-layer bookkeeping) and policy all (every layer every
   step): StepDone latency, fence wait (WaitSnapshot), ckptd's CPU per step
   (/proc/PID/stat utime + stime around the measured steps), Register.
2. history: one rank's history grown to 1,000,000 layer versions
   (tools/history_gen.cc, through the store's own commit code with one sync
   at the end; the real commit path's rate is measured first): at each
   length ckptd is restarted (start-up and reconcile time) and the real
   daemon is timed: Plan, Restore (with discard_later), StepDone, fence and
   CPU per step, `ckptctl layers`, `history`, `history --limit`, `jobs`,
   `gc --dry-run` (retention that would delete almost everything: GC's
   planning over the whole history), the RocksDB size.
3. ranks: jobs 1 .. 64 x ranks per job 1 .. 8 sharing one ckptd: aggregate
   throughput, per-rank throughput (max/min), per-rank p50/p99 of StepDone,
   fence and WaitDurable; closed loop (WaitDurable every step, as a trainer
   that keeps its checkpoints current) and, at the largest point, open loop
   (no WaitDurable: the disk cannot keep up and admission decides).
4. memory: ckptd's RSS, open descriptors and threads with 1 .. 512
   registered ranks (held after a few steps), and after they are gone.

Growth order: the slope of log(y) over log(x) by least squares, named
O(1) below 0.15, O(n^a) otherwise (O(n) for 0.85 .. 1.15).

--quick runs a small version of every sweep (under 2 minutes) and checks
what must hold whatever the machine: every trainer call succeeded, the
daemon answered every query with what the history holds, every rank made
progress. The CTest test perf.sweep_quick runs it.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402

TOOLS = os.path.join(harness.BUILD, "tools")
SCALE_TRAINER = os.path.join(TOOLS, "ckpt_scale_trainer")
HISTORY_GEN = os.path.join(TOOLS, "ckpt_history_gen")

# Limits raised so that 512 ranks of one uid may register and wait at once
# (each default is per uid: 256 registrations, 64 calls, 64 connections).
MANY_RANKS = ["--max_registrations_per_uid=2048", "--max_calls_per_uid=4096",
              "--max_connections_per_uid=4096", "--max_connections=8192",
              "--handover_max_connections_per_uid=256", "--handover_max_pending_per_uid=1024"]


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def fd_kinds(pid):
    """Open descriptors of `pid` by what they refer to (socket, memfd,
    directory, anon_inode:..., file)."""
    kinds = {}
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:"):
            k = "socket"
        elif target.startswith("/memfd:"):
            k = "memfd"
        elif target.startswith("anon_inode:"):
            k = target
        elif os.path.isdir(target):
            k = "directory"
        else:
            k = "file"
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def kib(v):
    return int(v.split()[0]) * 1024


def growth(xs, ys):
    """(slope, name) of y over x on log-log axes; None when not measurable."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    if slope < 0.15:
        name = "O(1)"
    elif 0.85 <= slope <= 1.15:
        name = "O(n)"
    elif 1.85 <= slope <= 2.15:
        name = "O(n^2)"
    else:
        name = "O(n^%.2f)" % slope
    return {"slope": round(slope, 3), "order": name}


def summary_of(values):
    if not values:
        return None
    v = sorted(values)
    q = lambda p: v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]
    return {"n": len(v), "p50": q(0.5), "p99": q(0.99), "max": v[-1], "min": v[0],
            "mean": sum(v) / len(v)}


class Checks:
    """What --quick asserts; every failure is listed, then the run fails."""

    def __init__(self):
        self.failed = []

    def __call__(self, cond, what):
        if cond:
            print("ok:", what)
        else:
            print("FAILED:", what)
            self.failed.append(what)


def start_daemon(root, pool_mib=256, extra=()):
    args = ["--staging_chunk_bytes=4096", "--gc_interval_s=0", "--lock_staging_memory=false"]
    args += list(extra)
    d = harness.Daemon(root, pool_bytes=pool_mib << 20, extra=args)
    t0 = time.time()
    d.start(timeout=1800)
    d.start_s = time.time() - t0
    return d


def stop_daemon(d):
    """SIGTERM, or SIGKILL when ckptd is still busy (a call that ran past
    its caller's deadline) after two minutes."""
    try:
        d.stop(timeout=120)
    except subprocess.TimeoutExpired:
        d.kill()


def trainer(d, job, *args, timeout=1800):
    """Runs one scale trainer process and returns its JSON document."""
    out = os.path.join(d.root, "trainer-%s-%d.json" % (job, time.monotonic_ns()))
    p = subprocess.run([SCALE_TRAINER, "--socket=" + d.socket, "--job=" + job,
                        "--daemon-pid=%d" % d.proc.pid, "--out=" + out] + list(args),
                       capture_output=True, text=True, timeout=timeout)
    doc = json.load(open(out)) if os.path.exists(out) else {"ranks": []}
    doc["rc"] = p.returncode
    doc["stderr"] = p.stderr[-2000:]
    return doc


def rank_steps(doc):
    return sum(r.get("steps", 0) for r in doc["ranks"])


def timed_ctl(d, *args, timeout=900):
    """(seconds, parsed reply) of one ckptctl --json call; (None, None) when
    it did not finish within `timeout`."""
    t0 = time.time()
    try:
        out = subprocess.run([harness.CKPTCTL, "--socket=" + d.socket, "--json",
                              "--timeout=%d" % timeout] + list(args),
                             capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return None, None
    s = time.time() - t0
    if out.returncode != 0 and "DEADLINE_EXCEEDED" in out.stderr:
        return None, None
    if out.returncode != 0:
        raise RuntimeError("ckptctl %s: %s" % (args, out.stderr))
    return s, json.loads(out.stdout) if out.stdout.strip() else None


def log_times(log_text):
    """Seconds from 'ckptd starting' to 'reconciled' and to 'ready', from
    ckptd's log (the last start in it)."""
    def stamp(line):
        m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)", line)
        if not m:
            return None
        t = time.strptime(m.group(1).split(".")[0], "%Y-%m-%dT%H:%M:%S")
        return time.mktime(t) + float("0." + m.group(1).split(".")[1])
    start = rec = ready = quotas = None
    for line in log_text.splitlines():
        if "ckptd starting" in line:
            start, rec, ready, quotas = stamp(line), None, None, None
        elif "reconciled:" in line and rec is None:
            rec = stamp(line)
        elif "per-uid quotas" in line and quotas is None:
            quotas = stamp(line)
        elif "ckptd ready" in line:
            ready = stamp(line)
    out = {}
    if start and rec:
        out["reconcile_s"] = rec - start
    if start and ready:
        out["ready_s"] = ready - start
    return out


# ---------------------------------------------------------------- sweep 1

def sweep_layers(work, quick, check):
    layers = [10, 100, 1000] if quick else [10, 100, 1000, 10000]
    tensors = [1] if quick else [1, 8, 64]
    steps = 30 if quick else 200
    d = start_daemon(os.path.join(work, "layers"), pool_mib=512)
    rows = []
    try:
        for mode in ("explicit:8", "all"):
            rounds = 1 if quick else (3 if mode != "all" else 2)
            for t in tensors:
                for l in layers:
                    if mode == "all" and l > (100 if quick else 1000):
                        continue  # 10,000 versions per step: a minute of disk per step here
                    # policy all writes every layer each step (and waits for it).
                    n = steps if mode != "all" else (10 if quick else max(5, min(steps, 5000 // l)))
                    job = "L%d-T%d-%s" % (l, t, mode.replace(":", ""))
                    per = []
                    for r in range(rounds):
                        # One job per point: later rounds restore it, so their
                        # first step does not write every layer again.
                        doc = trainer(d, job, "--layers=%d" % l, "--tensors=%d" % t,
                                      "--tensor-bytes=64", "--policy=" + mode,
                                      "--steps=%d" % n, "--warmup=2",
                                      "--durable-every=1" if mode == "all" else "--durable-every=0",
                                      *(["--restore"] if r > 0 else []))
                        check(doc["rc"] == 0, "layers sweep %s round %d: trainer ran (%s)" % (
                            job, r, doc["stderr"][-300:]))
                        if not doc["ranks"] or "stepdone" not in doc["ranks"][0]:
                            continue
                        rk = doc["ranks"][0]
                        per.append({"stepdone_p50": rk["stepdone"]["p50"], "stepdone_p99": rk["stepdone"]["p99"],
                                    "fence_p50": rk["fence"]["p50"], "fence_p99": rk["fence"]["p99"],
                                    "cpu_per_step": doc.get("daemon_cpu_s", 0) / max(1, rank_steps(doc)),
                                    "steps": rk["steps"],
                                    "versions_per_step": rk["versions_reported"] / max(1, rk["steps"])})
                        if r == 0:
                            register_s = rk["register_s"]
                    if not per:
                        continue
                    row = {"mode": mode, "layers": l, "tensors": t, "rounds": len(per),
                           "register_s": register_s}
                    for k in per[0]:
                        row[k] = statistics.median(p[k] for p in per)
                    rows.append(row)
                    print("layers %-10s L=%-5d T=%-2d StepDone p50 %.3f ms p99 %.3f ms  fence p50 %.3f ms  "
                          "CPU/step %.3f ms  register %.3f s" % (
                              mode, l, t, 1e3 * row["stepdone_p50"], 1e3 * row["stepdone_p99"],
                              1e3 * row["fence_p50"], 1e3 * row["cpu_per_step"], row["register_s"]))
    finally:
        stop_daemon(d)
    orders = {}
    for mode in ("explicit:8", "all"):
        for t in tensors:
            pts = [r for r in rows if r["mode"] == mode and r["tensors"] == t]
            for k in ("stepdone_p50", "fence_p50", "cpu_per_step", "register_s"):
                orders["%s T=%d %s" % (mode, t, k)] = growth([p["layers"] for p in pts], [p[k] for p in pts])
    return {"rows": rows, "orders": orders}


# ---------------------------------------------------------------- sweep 2

HIST_LAYERS = 100
GC_TIMEOUT = 600  # --gc-timeout


def commit_rate(work, quick):
    """Layer versions per second through the real commit path: a trainer
    with 1,000 tiny layers, policy all, waiting for durability each step."""
    d = start_daemon(os.path.join(work, "rate"))
    try:
        steps = 2 if quick else 5
        t0 = time.time()
        doc = trainer(d, "rate", "--layers=1000", "--tensor-bytes=256", "--policy=all",
                      "--steps=%d" % steps, "--warmup=0", "--durable-every=1")
        s = time.time() - t0
        return {"versions": 1000 * steps, "seconds": s, "per_s": 1000 * steps / s, "rc": doc["rc"]}
    finally:
        stop_daemon(d)


def sweep_history(work, quick, check):
    points = [1000, 10000] if quick else [1000, 10000, 100000, 1000000]
    steps = 50 if quick else 300
    rate = commit_rate(work, quick)
    print("real commit path: %.0f layer versions/s (%d in %.1f s)" % (rate["per_s"], rate["versions"], rate["seconds"]))
    root = os.path.join(work, "history")
    data = os.path.join(root, "data")
    # Retention that would delete almost all of it (GC is only ever run as
    # --dry-run here, so the history stays).
    extra = ["--keep_last_events=50", "--keep_every_steps=0", "--keep_hours=0"]
    rows = []
    for n in points:
        g0 = time.time()
        gen = subprocess.run([HISTORY_GEN, "--data-dir=" + data, "--job=hist",
                              "--versions=%d" % n, "--layers=%d" % HIST_LAYERS],
                             capture_output=True, text=True, timeout=3600)
        check(gen.returncode == 0, "history: generated %d versions (%s)" % (n, gen.stderr[-300:]))
        generated = json.loads(gen.stdout) if gen.returncode == 0 else {}
        # Cold-ish start: the page cache keeps what was just written; drop
        # it where allowed (root), so reconcile stats from disk.
        cold = False
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            cold = True
        except OSError:
            pass
        d = start_daemon(root, extra=extra)
        row = {"versions": generated.get("versions", n), "events": generated.get("last_step", 0),
               "generate_s": time.time() - g0, "start_s": d.start_s, "cold_start": cold}
        try:
            row.update(log_times(d.log()))
            row["index_bytes"] = harness.dir_bytes(os.path.join(data, "index"))
            row["files_bytes"] = harness.dir_bytes(os.path.join(data, "jobs"), allocated=True)
            # Each query twice: the first after the restart (cold: the page
            # cache was dropped where allowed), the second warm; the warm
            # one is the figure, the cold one is kept beside it (_cold_s).
            queries = (("plan_s", ["plan", "hist"]), ("layers_s", ["layers", "hist"]),
                       ("history_s", ["history", "hist"]),
                       ("history_limit_s", ["history", "hist", "--limit=10"]),
                       ("jobs_s", ["jobs"]))
            for cold_pass in (True, False):
                for name, args in queries:
                    s, reply = timed_ctl(d, *args, timeout=600)
                    row[name.replace("_s", "_cold_s") if cold_pass else name] = s
                    if cold_pass:
                        continue
                    if name == "layers_s" and reply:
                        counted = sum(li.get("versions", 0) for li in reply.get("layers", []))
                        row["layers_versions"] = counted
                        check(counted == row["versions"],
                              "history %d: ckptctl layers counts %d versions" % (n, counted))
                    if name == "history_s" and reply:
                        check(len(reply.get("events", [])) == row["events"],
                              "history %d: ckptctl history lists %d events" % (n, row["events"]))
            # GC's planning over the whole history (retention that would
            # delete almost all of it; a dry run deletes nothing).
            s, reply = timed_ctl(d, "gc", "hist", "--dry-run", timeout=GC_TIMEOUT)
            row["gc_dry_run_s"] = s
            if s is None:
                # ckptd goes on with the call after its caller gave up, and
                # holds the rank meanwhile: start it again for what follows.
                row["gc_dry_run_timeout_s"] = GC_TIMEOUT
                d.kill()
                d = start_daemon(root, extra=extra)
            elif reply:
                row["gc_would_delete"] = int(reply.get("versions_deleted", 0))
                kept = int(reply.get("versions_kept", 0))
                check(row["gc_would_delete"] + kept == row["versions"],
                      "history %d: gc --dry-run accounts for every version (%d kept, %d deleted)" % (
                          n, kept, row["gc_would_delete"]))
            rounds = []
            for r in range(1 if quick else 3):
                doc = trainer(d, "hist", "--layers=%d" % HIST_LAYERS, "--tensor-bytes=256",
                              "--policy=explicit:10", "--steps=%d" % steps, "--warmup=2",
                              "--plan", "--restore", "--restore-discard")
                check(doc["rc"] == 0, "history %d: trainer restored and trained (%s)" % (n, doc["stderr"][-300:]))
                if doc["ranks"] and "stepdone" in doc["ranks"][0]:
                    rk = doc["ranks"][0]
                    check(rk.get("restore_layers") == HIST_LAYERS,
                          "history %d: restore wrote all %d layers" % (n, HIST_LAYERS))
                    rounds.append({"stepdone_p50": rk["stepdone"]["p50"], "stepdone_p99": rk["stepdone"]["p99"],
                                   "fence_p50": rk["fence"]["p50"],
                                   "cpu_per_step": doc.get("daemon_cpu_s", 0) / max(1, rk["steps"]),
                                   "restore_s": rk.get("restore_s", 0), "plan_rpc_s": rk.get("plan_s", 0),
                                   "register_s": rk["register_s"]})
            for k in (rounds[0] if rounds else {}):
                row[k] = statistics.median(x[k] for x in rounds)
        finally:
            stop_daemon(d)
        rows.append(row)
        print("history %8d versions: start %.2f s (reconcile %.2f s), plan %.3f s, restore %.3f s, "
              "layers %.3f s, history %.3f s, jobs %.3f s, gc dry-run %s, StepDone p50 %.3f ms, "
              "CPU/step %.3f ms, index %.1f MB" % (
                  row["versions"], row["start_s"], row.get("reconcile_s", -1), row["plan_s"] or -1,
                  row.get("restore_s", -1), row["layers_s"] or -1, row["history_s"] or -1,
                  row["jobs_s"] or -1,
                  "%.3f s" % row["gc_dry_run_s"] if row["gc_dry_run_s"] else "timeout",
                  1e3 * row.get("stepdone_p50", 0), 1e3 * row.get("cpu_per_step", 0),
                  row["index_bytes"] / 1e6))
    orders = {}
    xs = [r["versions"] for r in rows]
    for k in ("start_s", "reconcile_s", "plan_s", "restore_s", "plan_rpc_s", "layers_s", "history_s",
              "history_limit_s", "jobs_s", "gc_dry_run_s", "stepdone_p50", "fence_p50",
              "cpu_per_step", "register_s", "index_bytes"):
        orders[k] = growth(xs, [r.get(k) for r in rows])
    flat = {}
    if len(rows) >= 2:
        for k in ("stepdone_p50", "cpu_per_step", "fence_p50"):
            a, b = rows[0].get(k), rows[-1].get(k)
            if a and b:
                flat[k] = (b - a) / a
    paired = paired_steps(work, root, extra, points[0], 1 if quick else 6, steps, check)
    shutil.rmtree(data, ignore_errors=True)
    return {"commit_rate": rate, "layers_per_rank": HIST_LAYERS, "rows": rows, "orders": orders,
            "change_first_to_last": flat, "paired": paired}


def paired_steps(work, large_root, extra, small_versions, rounds, steps, check):
    """The per-step acceptance figure, robust to a machine whose load drifts
    over the sweep: two ckptds run side by side, one on the long history
    just measured and one on a short one (`small_versions`, brought back
    near it by a real GC after each of its rounds), and trainer rounds
    alternate between them. Returns the medians and the relative change
    (long / short - 1) of StepDone p50, fence p50 and CPU per step."""
    small_root = os.path.join(work, "history-short")
    gen = subprocess.run([HISTORY_GEN, "--data-dir=" + os.path.join(small_root, "data"),
                          "--job=hist", "--versions=%d" % small_versions,
                          "--layers=%d" % HIST_LAYERS], capture_output=True, text=True, timeout=600)
    check(gen.returncode == 0, "paired: short history generated (%s)" % gen.stderr[-300:])
    short = start_daemon(small_root, extra=extra)
    long_ = start_daemon(large_root, extra=extra)
    per = {"short": [], "long": []}
    versions = {}
    try:
        for r in range(rounds):
            order = (("short", short), ("long", long_)) if r % 2 == 0 else (("long", long_), ("short", short))
            for name, d in order:
                doc = trainer(d, "hist", "--layers=%d" % HIST_LAYERS, "--tensor-bytes=256",
                              "--policy=explicit:10", "--steps=%d" % steps, "--warmup=2", "--restore")
                check(doc["rc"] == 0, "paired %s round %d: trainer ran (%s)" % (name, r, doc["stderr"][-300:]))
                if doc["ranks"] and "stepdone" in doc["ranks"][0]:
                    rk = doc["ranks"][0]
                    per[name].append({"stepdone_p50": rk["stepdone"]["p50"], "fence_p50": rk["fence"]["p50"],
                                      "cpu_per_step": doc.get("daemon_cpu_s", 0) / max(1, rk["steps"])})
            # The short history stays short: GC takes it back to the last
            # 50 events (outside the measured steps).
            timed_ctl(short, "gc", "hist", timeout=600)
        for name, d in (("short", short), ("long", long_)):
            s_, reply = timed_ctl(d, "layers", "hist", timeout=600)
            versions[name] = sum(li.get("versions", 0) for li in (reply or {}).get("layers", []))
    finally:
        stop_daemon(short)
        stop_daemon(long_)
        shutil.rmtree(small_root, ignore_errors=True)
    out = {"rounds": rounds, "steps_per_round": steps, "versions": versions, "per_round": per}
    for k in ("stepdone_p50", "fence_p50", "cpu_per_step"):
        a = statistics.median(x[k] for x in per["short"]) if per["short"] else None
        b = statistics.median(x[k] for x in per["long"]) if per["long"] else None
        out[k] = {"short": a, "long": b, "change": (b / a - 1) if a and b else None}
    print("paired per-step cost, %s vs %s versions, %d rounds each: %s" % (
        versions.get("short"), versions.get("long"), rounds,
        ", ".join("%s %+.1f%%" % (k, 100 * out[k]["change"]) for k in ("stepdone_p50", "fence_p50", "cpu_per_step")
                  if out[k]["change"] is not None)))
    return out


# ---------------------------------------------------------------- A/B

def sweep_ab(work, quick, check, other_build):
    """Before and after on the same long history: the ckptd of
    `other_build` (an earlier build) and this build's ckptd, in turn, on one
    data directory; the client tools are this build's for both."""
    n = 10000 if quick else 1000000
    root = os.path.join(work, "ab")
    data = os.path.join(root, "data")
    gen = subprocess.run([HISTORY_GEN, "--data-dir=" + data, "--job=hist", "--versions=%d" % n,
                          "--layers=%d" % HIST_LAYERS], capture_output=True, text=True, timeout=3600)
    check(gen.returncode == 0, "ab: generated %d versions (%s)" % (n, gen.stderr[-300:]))
    extra = ["--keep_last_events=50", "--keep_every_steps=0", "--keep_hours=0"]
    rows = []
    this_ckptd = harness.CKPTD
    try:
        for label, ckptd in (("before", os.path.join(other_build, "daemon", "ckptd")), ("after", this_ckptd)):
            harness.CKPTD = ckptd
            d = start_daemon(root, extra=extra)
            row = {"build": label, "ckptd": ckptd, "versions": n, "start_s": d.start_s}
            try:
                row.update(log_times(d.log()))
                for cold_pass in (True, False):
                    for name, args in (("plan_s", ["plan", "hist"]), ("layers_s", ["layers", "hist"]),
                                       ("jobs_s", ["jobs"]),
                                       ("history_limit_s", ["history", "hist", "--limit=10"])):
                        s_, _ = timed_ctl(d, *args, timeout=600)
                        row[name.replace("_s", "_cold_s") if cold_pass else name] = s_
                doc = trainer(d, "hist", "--layers=%d" % HIST_LAYERS, "--tensor-bytes=256",
                              "--policy=explicit:10", "--steps=20", "--warmup=1", "--restore-discard")
                check(doc["rc"] == 0, "ab %s: restore with discard_later (%s)" % (label, doc["stderr"][-300:]))
                if doc["ranks"]:
                    row["restore_discard_s"] = doc["ranks"][0].get("restore_s")
                s_, reply = timed_ctl(d, "gc", "hist", "--dry-run", timeout=GC_TIMEOUT)
                row["gc_dry_run_s"] = s_
                if s_ is None:
                    row["gc_dry_run_timeout_s"] = GC_TIMEOUT
                    d.kill()
            finally:
                stop_daemon(d)
            rows.append(row)
            print("ab %-6s %d versions: start %.1f s, layers %s s, jobs %s s, restore(discard) %s s, "
                  "gc dry-run %s" % (label, n, row["start_s"], row.get("layers_s"), row.get("jobs_s"),
                                     row.get("restore_discard_s"),
                                     "%.2f s" % row["gc_dry_run_s"] if row["gc_dry_run_s"] else
                                     "> %d s" % GC_TIMEOUT))
    finally:
        harness.CKPTD = this_ckptd
        shutil.rmtree(data, ignore_errors=True)
    return {"rows": rows}


# ---------------------------------------------------------------- sweep 3

def run_jobs(d, jobs, ranks, seconds, extra):
    """Runs `jobs` trainer processes of `ranks` rank threads each; once all
    of them are warm (their first steps, which write every layer, are
    durable) they measure the same `seconds` together. Returns their exit
    codes, stderr tails, per-rank results, and ckptd's CPU seconds and
    committed versions over the measured window (until the last rank's
    steps are durable)."""
    tag = "%d-%d-%d" % (jobs, ranks, time.monotonic_ns())
    go = os.path.join(d.root, "go-" + tag)
    procs, outs, readies = [], [], []
    for j in range(jobs):
        out = os.path.join(d.root, "ranks-%s-%d.json" % (tag, j))
        ready = os.path.join(d.root, "ready-%s-%d" % (tag, j))
        outs.append(out)
        readies.append(ready)
        procs.append(subprocess.Popen(
            [SCALE_TRAINER, "--socket=" + d.socket, "--job=j%d-%d-%d" % (jobs, ranks, j),
             "--ranks=%d" % ranks, "--seconds=%g" % seconds, "--out=" + out,
             "--ready-file=" + ready, "--go-file=" + go] + extra,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + 1800
    while time.time() < deadline and not all(os.path.exists(r) or p.poll() is not None
                                              for r, p in zip(readies, procs)):
        time.sleep(0.01)
    c0 = cpu_seconds(d.proc.pid)
    v0 = d.ctl("status").get("versions_committed", 0)
    open(go, "w").close()
    # ckptd's peak threads and RSS while the ranks train (a blocked wait
    # holds one of gRPC's threads).
    peak_threads = peak_rss = 0
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        try:
            st = proc_status(d.proc.pid)
            peak_threads = max(peak_threads, int(st["Threads"]))
            peak_rss = max(peak_rss, kib(st["VmRSS"]))
        except OSError:
            pass
        time.sleep(0.2)
    errs = []
    rcs = []
    for p in procs:
        _, err = p.communicate(timeout=seconds + 1800)
        rcs.append(p.returncode)
        if err:
            errs.append(err[-300:])
    cpu = cpu_seconds(d.proc.pid) - c0
    committed = d.ctl("status").get("versions_committed", 0) - v0
    ranks_out = []
    for out in outs:
        if os.path.exists(out):
            doc = json.load(open(out))
            for r in doc["ranks"]:
                r["job"] = doc["job"]
                ranks_out.append(r)
    return rcs, errs, ranks_out, cpu, committed, {"peak_threads": peak_threads, "peak_rss": peak_rss}


def fairness(ranks_out, layers):
    done = [r for r in ranks_out if "steps_per_s" in r]
    tput = [r["steps_per_s"] for r in done]
    row = {"ranks_done": len(done)}
    if not tput:
        return row
    row["steps_per_s_total"] = sum(tput)
    row["versions_per_s_total"] = sum(tput) * layers
    row["rank_steps_per_s"] = summary_of(tput)
    row["max_min_ratio"] = max(tput) / min(tput) if min(tput) > 0 else float("inf")
    for k in ("stepdone", "fence", "durable"):
        p50s = [r[k]["p50"] for r in done if r[k].get("n")]
        p99s = [r[k]["p99"] for r in done if r[k].get("n")]
        if p50s:
            row[k + "_p50_of_ranks"] = summary_of(p50s)
            row[k + "_p99_of_ranks"] = summary_of(p99s)
    row["refused"] = sum(r.get("refused", 0) for r in done)
    row["refused_by_rank"] = summary_of([r.get("refused", 0) for r in done])
    row["skipped"] = sum(r.get("skipped", 0) for r in done)
    return row


def sweep_ranks(work, quick, check):
    jobs_pts = [1, 4] if quick else [1, 4, 16, 64]
    ranks_pts = [1, 2] if quick else [1, 2, 8]
    seconds = 2 if quick else 12
    # Two layers of 64 KiB per rank: a version's cost is mostly its syncs,
    # so few layers give each of 512 ranks several steps in the window.
    layers = 2
    common = ["--layers=%d" % layers, "--tensor-bytes=65536", "--policy=all", "--compute-ms=20",
              "--warmup=2"]
    d = start_daemon(os.path.join(work, "ranks"), extra=MANY_RANKS)
    rows = []
    try:
        for loop in ("closed", "open"):
            for jobs in jobs_pts:
                for ranks in ranks_pts:
                    if loop == "open" and (jobs, ranks) not in ((jobs_pts[-1], ranks_pts[-1]),
                                                              (jobs_pts[len(jobs_pts) // 2], ranks_pts[-1])):
                        continue
                    extra = common + (["--durable-every=1"] if loop == "closed" else [])
                    rcs, errs, ranks_out, cpu, committed, peaks = run_jobs(d, jobs, ranks, seconds, extra)
                    check(all(rc == 0 for rc in rcs),
                          "ranks %s %dx%d: every trainer succeeded (%s)" % (loop, jobs, ranks, errs[:1]))
                    row = {"loop": loop, "jobs": jobs, "ranks_per_job": ranks, "ranks": jobs * ranks,
                           "daemon_cpu_s": cpu, "seconds": seconds, "versions_committed": committed,
                           "daemon_cpu_per_version": cpu / committed if committed else None}
                    row.update(peaks)
                    row.update(fairness(ranks_out, layers))
                    check(row["ranks_done"] == jobs * ranks,
                          "ranks %s %dx%d: all %d ranks reported" % (loop, jobs, ranks, jobs * ranks))
                    if loop == "closed":
                        check(row.get("rank_steps_per_s", {}).get("min", 0) > 0,
                              "ranks %s %dx%d: every rank made progress" % (loop, jobs, ranks))
                    rows.append(row)
                    print("ranks %-6s %2d jobs x %d ranks: %.0f versions/s (ckptd: %.0f committed/s), rank "
                          "steps/s min %.2f med %.2f max %.2f (max/min %.2f), fence p99 of ranks max %.1f ms, "
                          "StepDone p99 max %.1f ms, refused %d, ckptd threads peak %d" % (
                              loop, jobs, ranks, row.get("versions_per_s_total", 0),
                              committed / seconds,
                              row["rank_steps_per_s"]["min"], row["rank_steps_per_s"]["p50"],
                              row["rank_steps_per_s"]["max"], row["max_min_ratio"],
                              1e3 * row.get("fence_p99_of_ranks", {}).get("max", 0),
                              1e3 * row.get("stepdone_p99_of_ranks", {}).get("max", 0),
                              row.get("refused", 0), row["peak_threads"]))
    finally:
        stop_daemon(d)
    closed = [r for r in rows if r["loop"] == "closed"]
    orders = {}
    for k in ("versions_per_s_total", "daemon_cpu_s"):
        orders[k] = growth([r["ranks"] for r in closed], [r.get(k) for r in closed])
    orders["fence_p99_max"] = growth([r["ranks"] for r in closed],
                                     [r.get("fence_p99_of_ranks", {}).get("max") for r in closed])
    return {"rows": rows, "orders": orders, "layers_per_rank": layers}


# ---------------------------------------------------------------- sweep 4

def sweep_memory(work, quick, check):
    points = [1, 8, 32] if quick else [1, 8, 64, 256, 512]
    per_proc = 8
    layers = 16
    d = start_daemon(os.path.join(work, "memory"), pool_mib=64, extra=MANY_RANKS)
    rows = []
    try:
        pid = d.proc.pid
        st = proc_status(pid)
        base = {"rss": kib(st["VmRSS"]), "rss_anon": kib(st.get("RssAnon", "0 kB")),
                "fds": open_fds(pid), "threads": int(st["Threads"]), "fd_kinds": fd_kinds(pid)}
        for n in points:
            procs = []
            left = n
            j = 0
            while left > 0:
                k = min(per_proc, left)
                procs.append(subprocess.Popen(
                    [SCALE_TRAINER, "--socket=" + d.socket, "--job=m%d-%d" % (n, j), "--ranks=%d" % k,
                     "--layers=%d" % layers, "--tensor-bytes=65536", "--policy=all", "--steps=3",
                     "--warmup=0", "--hold", "--out=" + os.path.join(d.root, "m%d-%d.json" % (n, j))],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                left -= k
                j += 1
            ready = 0
            for p in procs:
                line = p.stdout.readline()
                ready += line.strip() == "holding"
            check(ready == len(procs), "memory %d ranks: every process holds its ranks" % n)
            st = proc_status(pid)
            row = {"ranks": n, "rss": kib(st["VmRSS"]), "rss_anon": kib(st.get("RssAnon", "0 kB")),
                   "rss_shmem": kib(st.get("RssShmem", "0 kB")), "fds": open_fds(pid),
                   "threads": int(st["Threads"]), "fd_kinds": fd_kinds(pid)}
            status = d.ctl("status")
            row["registered"] = status.get("registered_ranks", 0)
            check(row["registered"] == n, "memory: %d ranks registered" % n)
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
            for p in procs:
                p.communicate(timeout=600)
                check(p.returncode == 0, "memory %d ranks: trainer exited cleanly" % n)
            # Unregistered (not drained): wait until ckptd has forgotten them.
            deadline = time.time() + 60
            while time.time() < deadline and d.ctl("status").get("registered_ranks", 0) != 0:
                time.sleep(0.1)
            # The server closes a connection when it reads the peer's end,
            # on its own thread: the ckptctl that just reported 0 ranks may
            # still hold one. Wait, bounded, without opening another.
            held = ("socket", "memfd", "anon_inode:[pidfd]", "directory")

            def given_back():
                after = fd_kinds(pid)
                return all(after.get(k, 0) <= base["fd_kinds"].get(k, 0) for k in held)
            while time.time() < deadline and not given_back():
                time.sleep(0.1)
            st = proc_status(pid)
            row["rss_after"] = kib(st["VmRSS"])
            row["fds_after"] = open_fds(pid)
            row["fd_kinds_after"] = fd_kinds(pid)
            row["threads_after"] = int(st["Threads"])
            rows.append(row)
            print("   descriptors with the ranks: %s; after: %s" % (row["fd_kinds"], row["fd_kinds_after"]))
            print("memory %4d ranks: RSS %.1f MiB (anon %.1f, shmem %.1f), %d fds, %d threads; "
                  "after: RSS %.1f MiB, %d fds, %d threads" % (
                      n, row["rss"] / 2**20, row["rss_anon"] / 2**20, row["rss_shmem"] / 2**20,
                      row["fds"], row["threads"], row["rss_after"] / 2**20, row["fds_after"],
                      row["threads_after"]))
            # What a registration holds (its connection, memfd regions, the
            # trainer's pidfd, its rank directory) is given back.
            for kind in held:
                check(row["fd_kinds_after"].get(kind, 0) <= base["fd_kinds"].get(kind, 0),
                      "memory %d ranks: %s descriptors back to %d after unregister (%d)" % (
                          n, kind, base["fd_kinds"].get(kind, 0), row["fd_kinds_after"].get(kind, 0)))
            row["directory_fds_after"] = row["fd_kinds_after"].get("directory", 0)
    finally:
        stop_daemon(d)
    per_rank = {}
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        dn = b["ranks"] - a["ranks"]
        for k in ("rss", "rss_anon", "rss_shmem", "fds", "threads"):
            per_rank[k] = (b[k] - a[k]) / dn
    orders = {k: growth([r["ranks"] for r in rows], [r[k] - base[k] if r[k] > base[k] else None for r in rows])
              for k in ("rss_anon", "fds", "threads")}
    return {"baseline": base, "rows": rows, "per_rank": per_rank, "orders": orders,
            "layers_per_rank": layers, "layer_bytes": 65536}


# ---------------------------------------------------------------- plots

def plot(results, plots_dir, baseline=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(plots_dir, exist_ok=True)

    def label(k, orders):
        o = orders.get(k)
        return "%s  %s" % (k, o["order"]) if o else k

    if "layers" in results:
        r = results["layers"]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for mode, style in (("explicit:8", "-"), ("all", "--")):
            for t in sorted({x["tensors"] for x in r["rows"]}):
                pts = [x for x in r["rows"] if x["mode"] == mode and x["tensors"] == t]
                if not pts:
                    continue
                xs = [p["layers"] for p in pts]
                for ax, k, scale in ((axes[0], "stepdone_p50", 1e3), (axes[1], "fence_p50", 1e3),
                                     (axes[2], "cpu_per_step", 1e3)):
                    o = r["orders"].get("%s T=%d %s" % (mode, t, k))
                    ax.plot(xs, [p[k] * scale for p in pts], style, marker="o",
                            label="%s, %d tensors/layer: %s" % (mode, t, o["order"] if o else "?"))
        for ax, title in zip(axes, ("StepDone p50 (ms)", "fence wait p50 (ms)", "ckptd CPU per step (ms)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("layers per rank")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "scale_layers.png"), dpi=110)
        plt.close(fig)

    if "history" in results:
        r = results["history"]
        fig, axes = plt.subplots(1, 3, figsize=(19, 5.4))
        xs = [x["versions"] for x in r["rows"]]
        for k in ("start_s", "reconcile_s", "plan_s", "restore_s", "layers_s", "history_s",
                  "history_limit_s", "jobs_s", "gc_dry_run_s"):
            ys = [x.get(k) for x in r["rows"]]
            if any(ys):
                axes[0].plot(xs, ys, marker="o", label=label(k, r["orders"]))
        axes[0].set_title("per operation (s, warm), one rank of %d layers" % r["layers_per_rank"])
        # Before and after the fixes, each the first call after a restart.
        if baseline and "history" in baseline:
            b = baseline["history"]
            for k, name in (("gc_dry_run_s", "gc --dry-run"), ("layers_cold_s", "ckptctl layers"),
                            ("jobs_cold_s", "ckptctl jobs"), ("restore_s", "restore (discard_later)")):
                line = axes[1].plot(xs, [x.get(k) for x in r["rows"]], marker="o",
                                    label="after: " + name)[0]
                bx = [x["versions"] for x in b["rows"] if x.get(k)]
                axes[1].plot(bx, [x[k] for x in b["rows"] if x.get(k)], ":", marker="x",
                             color=line.get_color(), label="before: " + name)
                gave_up = [(x["versions"], x[k.replace("_s", "_timeout_s")]) for x in b["rows"]
                           if x.get(k.replace("_s", "_timeout_s"))]
                for gx, gy in gave_up:
                    axes[1].plot([gx], [gy], "^", color=line.get_color(), markersize=10)
                    axes[1].annotate("> %d s (stopped)" % gy, (gx, gy), textcoords="offset points",
                                     xytext=(-90, 6), fontsize=7)
            axes[1].set_title("before / after the fixes (s, first call after a restart)")
        for k, scale in (("stepdone_p50", 1e3), ("fence_p50", 1e3), ("cpu_per_step", 1e3)):
            ys = [x.get(k, 0) * scale for x in r["rows"]]
            axes[2].plot(xs, ys, marker="o", label=label(k, r["orders"]) + " (ms)")
        axes[2].plot(xs, [x["index_bytes"] / 1e6 for x in r["rows"]], marker="s",
                     label=label("index_bytes", r["orders"]) + " (MB)")
        axes[2].set_title("per step (ms) and RocksDB size (MB)")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("layer versions in the rank's history")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "scale_history.png"), dpi=110)
        plt.close(fig)

    if "ranks" in results:
        r = results["ranks"]
        closed = [x for x in r["rows"] if x["loop"] == "closed"]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for rpj in sorted({x["ranks_per_job"] for x in closed}):
            pts = [x for x in closed if x["ranks_per_job"] == rpj]
            xs = [p["ranks"] for p in pts]
            axes[0].plot(xs, [p.get("versions_per_s_total", 0) for p in pts], marker="o",
                         label="%d ranks/job" % rpj)
            axes[1].plot(xs, [p.get("max_min_ratio", 0) for p in pts], marker="o", label="%d ranks/job" % rpj)
            axes[2].plot(xs, [1e3 * p.get("fence_p99_of_ranks", {}).get("max", 0) for p in pts], marker="o",
                         label="fence p99, worst rank, %d ranks/job" % rpj)
            axes[2].plot(xs, [1e3 * p.get("durable_p99_of_ranks", {}).get("max", 0) for p in pts], "--",
                         marker="x", label="WaitDurable p99, worst rank, %d ranks/job" % rpj)
        opened = [x for x in r["rows"] if x["loop"] == "open"]
        if opened:
            axes[1].plot([p["ranks"] for p in opened], [p.get("max_min_ratio", 0) for p in opened], "*",
                         markersize=12, label="open loop (no WaitDurable), after")
        if baseline and "ranks" in baseline:
            bo = [x for x in baseline["ranks"]["rows"] if x["loop"] == "open"]
            axes[1].plot([p["ranks"] for p in bo], [p.get("max_min_ratio", 0) for p in bo], "X",
                         markersize=10, label="open loop, before (first come, first served)")
            axes[1].set_yscale("log")
        axes[0].set_title("versions durable per second (%s)" % r["orders"]["versions_per_s_total"]["order"]
                          if r["orders"].get("versions_per_s_total") else "versions durable per second")
        axes[1].set_title("per-rank throughput, max / min")
        axes[2].set_title("per-rank stall p99, worst rank (ms)")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("ranks sharing one ckptd")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        axes[2].set_yscale("log")
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "scale_ranks.png"), dpi=110)
        plt.close(fig)

    if "memory" in results:
        r = results["memory"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        xs = [x["ranks"] for x in r["rows"]]
        axes[0].plot(xs, [x["rss"] / 2**20 for x in r["rows"]], marker="o", label="RSS")
        axes[0].plot(xs, [x["rss_anon"] / 2**20 for x in r["rows"]], marker="o",
                     label="anonymous (%s)" % (r["orders"]["rss_anon"] or {}).get("order", "?"))
        axes[0].plot(xs, [x["rss_after"] / 2**20 for x in r["rows"]], "--", marker="x", label="RSS after unregister")
        axes[0].set_title("ckptd memory (MiB)")
        axes[1].plot(xs, [x["fds"] for x in r["rows"]], marker="o",
                     label="open descriptors (%s)" % (r["orders"]["fds"] or {}).get("order", "?"))
        axes[1].plot(xs, [x["threads"] for x in r["rows"]], marker="o",
                     label="threads (%s)" % (r["orders"]["threads"] or {}).get("order", "?"))
        axes[1].plot(xs, [x["fds_after"] for x in r["rows"]], "--", marker="x", label="descriptors after")
        axes[1].set_title("ckptd descriptors and threads")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("registered ranks")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "scale_memory.png"), dpi=110)
        plt.close(fig)


def load_baseline(files):
    """Earlier --out documents (comma-separated), merged: drawn as 'before'."""
    out = {}
    for f in filter(None, files.split(",")):
        with open(f) as fh:
            out.update(json.load(fh))
    return out or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="layers,history,ranks,memory")
    ap.add_argument("--out", default="")
    ap.add_argument("--plots", default="", help="directory for scale_*.png (none when empty)")
    ap.add_argument("--baseline", default="",
                    help="earlier --out files (comma-separated), drawn as 'before' (history, ranks)")
    ap.add_argument("--work", default="", help="where the daemons' data go (default: a temp dir)")
    ap.add_argument("--ab", default="", metavar="BUILD_DIR",
                    help="also run the A/B sweep: that build's ckptd against this one's, "
                         "on one long history (add ab to --only)")
    ap.add_argument("--replot", default="", metavar="FILE.json",
                    help="only draw the plots (--plots) of an earlier --out")
    ap.add_argument("--gc-timeout", type=int, default=600,
                    help="seconds `gc --dry-run` may take before it counts as timed out")
    args = ap.parse_args()
    global GC_TIMEOUT
    GC_TIMEOUT = args.gc_timeout
    if args.replot:
        plot(json.load(open(args.replot)), args.plots or ".", load_baseline(args.baseline))
        return 0
    for exe in (SCALE_TRAINER, HISTORY_GEN, harness.CKPTD, harness.CKPTCTL):
        if not os.path.exists(exe):
            print("missing %s: build it first" % exe)
            return 1
    work = args.work or harness.tempdir("ckpt-sweep-")
    os.makedirs(work, exist_ok=True)
    check = Checks()
    results = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
               "machine": harness.machine(HERE), "quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.time()
    sweeps = {"layers": sweep_layers, "history": sweep_history, "ranks": sweep_ranks, "memory": sweep_memory,
              "ab": lambda w, q, c: sweep_ab(w, q, c, args.ab)}
    for name in args.only.split(","):
        s0 = time.time()
        results[name] = sweeps[name](work, args.quick, check)
        results[name]["seconds"] = time.time() - s0
        print("== %s sweep: %.0f s" % (name, results[name]["seconds"]))
        for k, o in sorted(results[name].get("orders", {}).items()):
            if o:
                print("   %-40s %-10s slope %.2f" % (k, o["order"], o["slope"]))
        if args.out:  # after every sweep, so a long run that stops keeps what it measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    results["seconds"] = time.time() - t0
    results["failed_checks"] = check.failed
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.plots:
        plot(results, args.plots, load_baseline(args.baseline))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("sweep: %.0f s, %d failed checks" % (results["seconds"], len(check.failed)))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
