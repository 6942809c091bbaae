"""Peer replication across nodes made of network namespaces (netns.py), with
real ckptd processes, the example trainer and mutual TLS; no object store.

1. Node A trains two jobs (policy all; layercheck, whose plans are
   composite) and replicates every durable step to node B's ckptd; every
   rank's newest step becomes peer-durable, `ckptctl status` shows no lag.
2. Partition: A's link goes down while a trainer runs; training goes on,
   the peer lag is reported (ckpt_peer_lag_steps, ckpt_peer_up 0), and
   once the link is back replication catches up.
3. Node loss: A's ckptd is SIGKILLed and its data directory deleted.
   Node C, a fresh ckptd pointed at B, lists the jobs and restores each
   one from B: every layer's bytes equal what A's trainer logged at that
   layer's planned step (bit-exact for all, composite for layercheck).
   Training goes on at C and is replicated to B.
4. Trust: a node whose certificate another CA signed, and one whose name
   B does not allow, replicate nothing (their errors say why, B counts the
   refusals); bytes of a replica corrupted on B are detected by the
   replacement node and never restored.
"""

import os
import shutil
import subprocess
import sys
import time

import harness
import netns

LAYERS = 6
LAYER_BYTES = "64K,256K,1M"
PORT = 7470


def ctl_jobs(d):
    return harness.ctl_jobs(d)


def wait_peer(d, jobs, timeout=600):
    return harness.wait_tier(d, jobs, "peer", timeout)


def peer_step(d, job):
    ranks = ctl_jobs(d).get(job, {"ranks": []})["ranks"]
    return min((r.get("peer_step", 0) for r in ranks), default=0)


def scrape(cluster, node, d):
    """{(name, labels): value} of the node's metrics (served inside its namespace)."""
    address = d.ctl("status")["metrics_address"]
    out = cluster.run(node, "curl", "-sf", "http://%s/metrics" % address)
    values = {}
    for line in out.stdout.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            values[(name, labels.rstrip("}"))] = float(value)
    return values


def metric(cluster, node, d, name, labels=""):
    return sum(v for (n, l), v in scrape(cluster, node, d).items() if n == name and labels in l)


class Node:
    """A ckptd inside a node's namespace."""

    def __init__(self, cluster, name, root, tls, key, listen=False, peer=None, allow="",
                 extra=()):
        args = ["--peer_cert_file=" + tls[0], "--peer_tls_key_file=" + tls[1],
                "--peer_ca_file=" + tls[2], "--remote_key_file=" + key,
                "--peer_timeout_ms=3000", "--metrics_address=127.0.0.1:0"]
        if listen:
            args += ["--peer_listen=%s:%d" % (cluster.addr[name], PORT), "--peer_allow=" + allow,
                     "--peer_memory_bytes=%d" % (64 << 20)]  # populated at start
        if peer:
            args += ["--peer_address=%s:%d" % (cluster.addr[peer], PORT), "--peer_name=" + peer]
        self.d = harness.Daemon(os.path.join(root, name), extra=args + list(extra))
        self.d.args = ["ip", "netns", "exec", cluster.ns[name]] + self.d.args
        self.name = name


def train(d, job, log, policy, steps, *extra):
    out = harness.run_trainer(d, job, "--layers=%d" % LAYERS, "--layer-bytes=" + LAYER_BYTES,
                              "--steps=%d" % steps, "--policy=" + policy, "--log=" + log, *extra)
    harness.check(out.returncode == 0, "trainer of %s: %s %s" % (job, out.stdout, out.stderr))


def restore(d, job, log, policy, steps):
    """Restores `job` in a new trainer, checks every layer against the log,
    trains on to `steps`; the restored step and the layers' steps."""
    out = harness.run_trainer(d, job, "--layers=%d" % LAYERS, "--layer-bytes=" + LAYER_BYTES,
                              "--steps=%d" % steps, "--policy=" + policy, "--restore",
                              "--verify-log=" + log, "--log=" + log)
    sys.stdout.write(out.stdout)
    harness.check(out.returncode == 0, "restore of %s: %s %s" % (job, out.stdout, out.stderr))
    harness.check("verify: %d of %d layers match" % (LAYERS, LAYERS) in out.stdout,
                  "every layer of %s equals its bytes at its planned step" % job)
    lines = out.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("composite restore"):
            layer_steps = {int(l.split()[1]) for l in lines[i + 2:i + 2 + LAYERS]}
            return int(line.split("to step ")[1].split()[0]), layer_steps
    raise AssertionError("no plan printed")


def main():
    why = netns.available()
    if why is not None:
        print("SKIP: " + why)
        return 77
    root = harness.tempdir("ckpt-peer-")
    cluster = netns.Cluster(["node-a", "node-b", "node-c", "node-x", "node-e"])
    try:
        pki = netns.Pki(os.path.join(root, "pki"))
        tls = {n: pki.issue(n, cluster.addr[n]) + (pki.ca,) for n in cluster.ns}
        other = netns.Pki(os.path.join(root, "other-pki"), name="another-ca")
        # A name B allows, signed by a CA B does not trust; it trusts B's CA,
        # so it is B that refuses it.
        evil = other.issue("node-a") + (pki.ca,)
        key = harness.remote_key(root)

        b = Node(cluster, "node-b", root, tls["node-b"], key, listen=True,
                 allow="node-a,node-c")
        b.d.start()
        a = Node(cluster, "node-a", root, tls["node-a"], key, peer="node-b")
        a.d.start()

        # 1. Replicate.
        logs = {j: os.path.join(root, j + ".jsonl") for j in ("p-all", "p-lc", "p-part")}
        train(a.d, "p-all", logs["p-all"], "all", 30)
        train(a.d, "p-lc", logs["p-lc"], "layercheck", 80, "--warmup=0", "--k0=0.5")
        steps = wait_peer(a.d, ["p-all", "p-lc"])
        status = a.d.ctl("status")
        harness.check(status["peer"].startswith("peer node-b") and status["peer_lag_steps"] == 0,
                      "ckptctl status shows the peer tier caught up: %s" % status)
        sent = metric(cluster, "node-a", a.d, "ckpt_peer_uploaded_bytes_total")
        kept = metric(cluster, "node-b", b.d, "ckpt_peer_replica_bytes", 'where="disk"')
        print("replicated %d bytes; node B keeps %d bytes; peer-durable steps %s" %
              (sent, kept, steps))
        harness.check(sent > 0 and kept >= sent, "B keeps what A sent")

        # 2. Partition while training.
        proc = subprocess.Popen(
            harness.trainer_cmd(a.d, "p-part", "--layers=%d" % LAYERS,
                                "--layer-bytes=" + LAYER_BYTES, "--steps=100000",
                                "--policy=all", "--log=" + logs["p-part"], "--compute-ms=100"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        harness.wait_for(lambda: peer_step(a.d, "p-part") >= 5, 120,
                         "the running job is replicated")
        cluster.link("node-a", False)
        cut_at = len(harness.read_jsonl(logs["p-part"]))
        harness.wait_for(lambda: metric(cluster, "node-a", a.d, "ckpt_peer_up") == 0, 120,
                         "the peer is reported down")
        harness.wait_for(lambda: metric(cluster, "node-a", a.d, "ckpt_peer_lag_steps") >= 5, 120,
                         "the peer lag is reported")
        harness.check(proc.poll() is None, "the trainer runs through the partition")
        trained = len(harness.read_jsonl(logs["p-part"])) - cut_at
        lag = metric(cluster, "node-a", a.d, "ckpt_peer_lag_steps")
        error = a.d.ctl("status")["peer_error"]
        print("partition: %d steps trained, peer lag %d steps, error: %s" % (trained, lag, error))
        harness.check(trained > 0 and error, "training went on, the failure is shown")
        cluster.link("node-a", True)
        proc.kill()
        proc.wait()
        t0 = time.time()
        wait_peer(a.d, ["p-part"])
        print("replication caught up %.1f s after the link came back" % (time.time() - t0))
        steps = wait_peer(a.d, ["p-all", "p-lc", "p-part"])

        # 2b. A slow peer link (tc tbf) and replication capped below it: the
        # trainer runs every step, replication keeps to its cap.
        cap = 2000000
        a.d.stop()
        a.d.args.append("--peer_rate_bytes=%d" % cap)
        a.d.start()
        cluster.rate_limit("node-a", "40mbit")
        logs["p-slow"] = os.path.join(root, "p-slow.jsonl")
        proc = subprocess.Popen(
            harness.trainer_cmd(a.d, "p-slow", "--layers=%d" % LAYERS,
                                "--layer-bytes=" + LAYER_BYTES, "--steps=60", "--policy=all",
                                "--log=" + logs["p-slow"], "--compute-ms=50"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        harness.wait_for(lambda: metric(cluster, "node-a", a.d,
                                        "ckpt_peer_uploaded_bytes_total") > 0, 120,
                         "replication of the slow job starts")
        t0, sent0 = time.time(), metric(cluster, "node-a", a.d, "ckpt_peer_uploaded_bytes_total")
        out, err = proc.communicate(timeout=300)
        harness.check(proc.returncode == 0, "the trainer ran every step: %s %s" % (out, err))
        t1, sent1 = time.time(), metric(cluster, "node-a", a.d, "ckpt_peer_uploaded_bytes_total")
        # Completed versions in [t0, t1]: at most the cap's bytes, plus the
        # versions in flight at t0 (4 threads, 1 MiB each) and a 100 ms burst.
        bound = cap * (t1 - t0) + 4 * (1 << 20) + cap / 10
        print("slow peer: %d bytes replicated in %.1f s (%.2f MB/s, cap %.2f MB/s)" %
              (sent1 - sent0, t1 - t0, (sent1 - sent0) / (t1 - t0) / 1e6, cap / 1e6))
        harness.check(sent1 - sent0 <= bound, "replication kept to its cap")
        cluster.rate_limit("node-a", None)
        steps = wait_peer(a.d, ["p-all", "p-lc", "p-part", "p-slow"])

        # 3. Node loss: A and its disk are gone; C restores from B alone.
        a.d.kill()
        shutil.rmtree(os.path.join(root, "node-a"))
        c = Node(cluster, "node-c", root, tls["node-c"], key, peer="node-b")
        c.d.start()
        listed = ctl_jobs(c.d)
        harness.check(set(steps) <= set(listed), "the replacement node lists the jobs: %s" % listed)
        for job, policy in (("p-all", "all"), ("p-lc", "layercheck"), ("p-part", "all"),
                            ("p-slow", "all")):
            t0 = time.time()
            step, layer_steps = restore(c.d, job, logs[job], policy, steps[job] + 5)
            print("%s restored on the replacement node from its peer to step %d in %.2f s" %
                  (job, step, time.time() - t0))
            harness.check(step == steps[job], "restored the newest peer-durable step")
            if policy == "layercheck":
                harness.check(len(layer_steps) > 1,
                              "a composite plan (layers from steps %s)" % sorted(layer_steps))
        harness.check(metric(cluster, "node-c", c.d, "ckpt_peer_pulled_bytes_total") > 0,
                      "bytes were pulled from the peer")
        c_steps = wait_peer(c.d, ["p-all"])
        harness.check(c_steps["p-all"] == steps["p-all"] + 5, "the replacement node replicates")

        # 3b. The peer killed mid-transfer, at each kill point of the
        # replica service; after its restart replication catches up.
        killed = []
        for point in ("replica.received", "replica.stored"):
            job = "p-kill-" + point.split(".")[1]
            logs[job] = os.path.join(root, job + ".jsonl")
            b.d.kill()
            b.d.env = {"CKPT_KILL_AT": point + ":3"}
            b.d.start()
            train(c.d, job, logs[job], "all", 12)
            harness.wait_for(lambda: b.d.proc.poll() is not None, 120, "the peer dies at " + point)
            harness.check(b.d.proc.returncode == -9, "killed at %s" % point)
            b.d.env = None
            b.d.start()
            killed.append(job)
        c_steps = wait_peer(c.d, ["p-all"] + killed)
        print("peer killed at each replica kill point; caught up: %s" % c_steps)

        # 3c. Node loss again: C goes; a fresh node restores from B what C
        # made peer-durable, through the peer's deaths.
        c.d.kill()
        shutil.rmtree(os.path.join(root, "node-c"))
        d = Node(cluster, "node-a", root, tls["node-a"], key, peer="node-b")
        d.d.start()
        for job in ["p-all"] + killed:
            step, _ = restore(d.d, job, logs[job], "all", c_steps[job])
            harness.check(step == c_steps[job], "%s: the newest peer-durable step" % job)
        d.d.kill()
        shutil.rmtree(os.path.join(root, "node-a"))

        # 4a. Bytes corrupted at the peer (on its disk, served after its
        # restart): detected by the replacement node, never restored.
        b.d.stop()
        vdir = os.path.join(b.d.data, "replicas", "jobs", "p-all", "rank-00000000", "v")
        newest = max(int(f.split("-S")[1].split("-")[0], 16) for f in os.listdir(vdir))
        victim = sorted(f for f in os.listdir(vdir) if "-S%016x-" % newest in f)[-1]
        with open(os.path.join(vdir, victim), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(vdir, victim)) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        b.d.start()
        r = Node(cluster, "node-a", root, tls["node-a"], key, peer="node-b")
        r.d.start()
        out = harness.run_trainer(r.d, "p-all", "--layers=%d" % LAYERS,
                                  "--layer-bytes=" + LAYER_BYTES, "--steps=0", "--restore")
        harness.check(out.returncode != 0 and "DATA_LOSS" in out.stderr and
                      "lost its version of step %d" % newest in out.stderr,
                      "the corrupted replica of step %d is refused: %s %s" %
                      (newest, out.stdout[-800:], out.stderr[-500:]))
        harness.check(metric(cluster, "node-a", r.d, "ckpt_peer_failures_total") > 0,
                      "the damage was counted")
        print("corrupted %s at the peer: the replacement node refused step %d" % (victim, newest))
        r.d.kill()

        # 4. Trust.
        refused = metric(cluster, "node-b", b.d, "ckpt_peer_replica_refused_total",
                         'reason="unknown_peer"')
        x = Node(cluster, "node-x", root, tls["node-x"], key, peer="node-b")
        e = Node(cluster, "node-e", root, evil, key, peer="node-b")
        kept = metric(cluster, "node-b", b.d, "ckpt_peer_replica_bytes", 'where="disk"')
        for n in (x, e):
            n.d.start()
            train(n.d, "p-" + n.name, os.path.join(root, n.name + ".jsonl"), "all", 5)
            harness.wait_for(lambda: n.d.ctl("status")["peer_error"], 60,
                             "%s's replication fails" % n.name)
            print("%s: %s" % (n.name, n.d.ctl("status")["peer_error"]))
            harness.check(all(r.get("peer_step", 0) == 0
                              for r in ctl_jobs(n.d)["p-" + n.name]["ranks"]),
                          "nothing of %s is peer-durable" % n.name)
        harness.check("not allowed" in x.d.ctl("status")["peer_error"],
                      "the unknown peer is told it is not allowed")
        harness.check(metric(cluster, "node-b", b.d, "ckpt_peer_replica_refused_total",
                             'reason="unknown_peer"') > refused, "B counted the unknown peer")
        harness.check(metric(cluster, "node-b", b.d, "ckpt_peer_replica_bytes",
                             'where="disk"') == kept,
                      "B stored nothing for them")
        print("PASS")
        return 0
    finally:
        harness.kill_processes([])
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
