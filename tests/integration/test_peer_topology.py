"""Peer copies placed from the job's topology, across four nodes made of
network namespaces (netns.py), two racks, two copies of every version
(peer_copies=2), no object store:

1. A job of three ranks on nodes A, B, C (each an example trainer that
   reports the job's nodes, as ckpt.torch gathers them): each node places
   its rank's copies on the next nodes of the job's ring, other racks
   first, never on itself; every rank's steps are on exactly the two nodes
   `ckptctl jobs` names, and on no other; each rank's newest step becomes
   peer-durable only once both hold it.
2. Node A is lost (ckptd SIGKILLed, its data directory deleted). Rank 0
   starts again on node D, which never held anything of the job: D finds
   the rank at A's peers, restores bit-exact what A's trainer logged, and
   places its own copies from the job's new nodes (D, B, C).
3. Replicas count against their owner's quota on the peer: node B,
   restarted with max_disk_bytes_per_uid just above what the uid holds
   there, refuses the replicas of a job that would pass it (D's peer
   error says so), the uid's usage on B stays within the quota, and the
   job's other copy (on C) keeps up.
"""

import os
import shutil
import sys

import harness
import netns
from test_peer import LAYERS, LAYER_BYTES, PORT, Node, ctl_jobs, metric, restore, train

RACKS = {"node-a": "r1", "node-b": "r1", "node-c": "r2", "node-d": "r2"}


def manifests(node_root, job, rank):
    """Steps of (job, rank) whose manifest node_root's replica store holds."""
    d = os.path.join(node_root, "data", "replicas", "jobs", job, "rank-%08d" % rank, "m")
    if not os.path.isdir(d):
        return set()
    return {int(f[1:]) for f in os.listdir(d) if f.startswith("S")}


def main():
    why = netns.available()
    if why is not None:
        print("SKIP: " + why)
        return 77
    root = harness.tempdir("ckpt-topo-")
    names = ["node-a", "node-b", "node-c", "node-d"]
    cluster = netns.Cluster(names, net=79)
    try:
        pki = netns.Pki(os.path.join(root, "pki"))
        tls = {n: pki.issue(n, cluster.addr[n]) + (pki.ca,) for n in names}
        key = harness.remote_key(root)
        ring = ",".join("%s=%s:%d@%s" % (n, cluster.addr[n], PORT, RACKS[n]) for n in names)
        nodes = {n: Node(cluster, n, root, tls[n], key, listen=True,
                         extra=["--peer_nodes=" + ring, "--peer_copies=2"])
                 for n in names}
        for n in nodes.values():
            n.d.start()
        status = nodes["node-a"].d.ctl("status")
        harness.check(status["node"] == "node-a" and status["rack"] == "r1",
                      "a node is named by its certificate: %s" % status)

        # 1. Three ranks on A, B, C.
        job, steps = "topo", 12
        on = {0: "node-a", 1: "node-b", 2: "node-c"}
        logs = {r: os.path.join(root, "topo-%d.jsonl" % r) for r in on}
        for r, n in on.items():
            train(nodes[n].d, job, logs[r], "all", steps, "--rank=%d" % r,
                  "--job-nodes=node-a,node-b,node-c", "--wait-tier=peer")
        # The ring A -> B -> C; racks r1, r1, r2, (D: r2). Other racks first.
        expected = {0: ["node-c", "node-b"], 1: ["node-c", "node-a"], 2: ["node-a", "node-b"]}
        for r, n in on.items():
            placed = ctl_jobs(nodes[n].d)[job]["peer_nodes"]
            harness.check(placed == expected[r], "rank %d on %s: copies on %s (expected %s)" %
                          (r, n, placed, expected[r]))
            holders = sorted(m for m in names if manifests(os.path.join(root, m), job, r))
            harness.check(holders == sorted(expected[r]),
                          "rank %d's steps are on %s and nowhere else (found on %s)" %
                          (r, expected[r], holders))
            for m in expected[r]:
                harness.check(steps in manifests(os.path.join(root, m), job, r),
                              "%s holds rank %d's newest step" % (m, r))
            print("rank %d on %s: two copies, on %s" % (r, n, ", ".join(expected[r])))

        # 2. A is lost; rank 0 starts again on D.
        nodes["node-a"].d.kill()
        shutil.rmtree(os.path.join(root, "node-a"))
        d = nodes["node-d"].d
        step, _ = restore(d, job, logs[0], "all", steps + 3)
        harness.check(step == steps, "rank 0 restored on D at step %d (expected %d)" %
                      (step, steps))
        out = harness.run_trainer(d, job, "--layers=%d" % LAYERS, "--layer-bytes=" + LAYER_BYTES,
                                  "--steps=%d" % (steps + 4), "--policy=all", "--restore",
                                  "--job-nodes=node-d,node-b,node-c", "--wait-tier=peer",
                                  "--log=" + logs[0])
        harness.check(out.returncode == 0, "rank 0 trains on at D: %s %s" % (out.stdout,
                                                                            out.stderr))
        placed = ctl_jobs(d)[job]["peer_nodes"]
        harness.check(placed == ["node-b", "node-c"],
                      "D places rank 0's copies on the job's other nodes: %s" % placed)
        for m in ("node-b", "node-c"):
            harness.check(steps + 4 in manifests(os.path.join(root, m), job, 0),
                          "%s holds D's newest step of rank 0" % m)
        print("node A lost: rank 0 restored bit-exact on D from its peers, copies now on %s" %
              ", ".join(placed))

        # 3. The uid's quota on B bounds the replicas it keeps for the uid.
        b = nodes["node-b"]
        used = metric(cluster, "node-b", b.d, "ckpt_uid_disk_used_bytes", 'uid="%d"' % os.getuid())
        limit = int(used) + (6 << 20)
        b.d.stop()
        b.d.args.append("--max_disk_bytes_per_uid=%d" % limit)
        b.d.start()
        log = os.path.join(root, "flood.jsonl")
        train(d, "flood", log, "all", 8, "--job-nodes=node-d,node-b,node-c")
        harness.check(ctl_jobs(d)["flood"]["peer_nodes"] == ["node-b", "node-c"],
                      "the flood is placed on B and C")
        harness.wait_for(lambda: "max_disk_bytes_per_uid" in d.ctl("status")["peer_error"], 120,
                         "B refuses replicas past the uid's quota")
        print("D: " + d.ctl("status")["peer_error"])
        harness.wait_for(lambda: 8 in manifests(os.path.join(root, "node-c"), "flood", 0), 120,
                         "C keeps the job's other copy up to date")
        held = metric(cluster, "node-b", b.d, "ckpt_uid_disk_used_bytes",
                      'uid="%d"' % os.getuid())
        harness.check(held <= limit, "the uid holds %d bytes on B, within its quota of %d" %
                      (held, limit))
        harness.check(8 not in manifests(os.path.join(root, "node-b"), "flood", 0),
                      "B did not take the step past the quota")
        print("PASS")
        return 0
    finally:
        harness.kill_processes([])
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
