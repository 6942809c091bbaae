"""ckpt.torch tells ckptd the job's topology: attach() gathers each rank's
node name (Client.node(), its ckptd's certificate name) over the job's gloo
group and registers it as the job's nodes, and each ckptd places the job's
peer copies on the next nodes of the job's ring, not of the cluster's.

Two ckptd "nodes" on loopback, n1 and n2, with TLS certificates named after
them, one peer copy of every version (peer_copies=1) and the cluster's ring
n1, n3, n2 (peer_nodes), where n3 is listed but never runs:
- a 2-rank gloo job "topo" (an nn.Sequential and AdamW, policy `all`),
  rank 0 on n1 and rank 1 on n2, trains 3 steps and waits until its last
  step is in the peer tier. n1 places the job's copies on ["n2"] and n2 on
  ["n1"] (`ckptctl jobs`): the job's ring. By the cluster's ring n1 would
  have chosen n3, which does not run, and the wait would have timed out.
  n2's data directory holds rank 0's replicas and n1's holds rank 1's.
- rank 0 of that world also attaches a one-rank job "solo" while rank 1 does
  not: attach() starts no collective of the whole world (it once did, and
  hung);
- a 1-rank job "alone" on n1 reports only its own node; n1 places it by the
  cluster's ring: ["n3"] (its durability in the peer tier is not awaited).
n3 being down does not stop the jobs from attaching: a ckptd asks every
peer node for a job it does not hold, and one that is down is passed over
while another answers (it once made every plan UNAVAILABLE, and attach()
refused).

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing. `--worker` runs one rank of "topo".
"""

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import ckpt  # noqa: E402
from ckpt import torch as ckpt_torch  # noqa: E402

try:
    import netns  # noqa: E402
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)

STEPS = 3
WORLD = 2


def client_for(socket_path):
    """A client of the ckptd at `socket_path`, with the default
    on_daemon_loss ("error"): attach() refuses when its check of the
    daemon fails."""
    return ckpt.Client(socket_path, wait_timeout_s=120)


def train(client, job, rank, world, steps, wait_peer):
    """Trains a small model `steps` steps under ckpt.torch. {"node": the
    rank's ckptd, "job_nodes": the nodes attach() registered, "durable": the
    step made peer-durable (None when not awaited), "warned": attach()'s
    warnings}."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        run = ckpt_torch.attach(model, opt, client, job_id=job, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        opt.step()
    durable = run.wait_durable("peer") if wait_peer else None
    run.close(drain=wait_peer)
    if client.unprotected:
        raise AssertionError("the client of %s rank %d went unprotected" % (job, rank))
    return {"node": client.node(), "job_nodes": run._job_nodes, "durable": durable,
            "warned": [str(w.message) for w in warned]}


def worker(a):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    got = train(client_for(a.socket), "topo", a.rank, WORLD, a.steps, wait_peer=True)
    if a.rank == 0:
        # A one-rank job of one process of an initialised world, the other
        # rank not attaching: attach() must not start a collective of the
        # whole world (it once made a group over it, and hung here).
        got["solo_nodes"] = train(client_for(a.socket), "solo", 0, 1, a.steps,
                                  wait_peer=False)["job_nodes"]
    dist.barrier()
    print(json.dumps(dict(got, rank=a.rank)))
    dist.destroy_process_group()


def free_ports(n):
    """`n` distinct TCP ports on loopback that nothing listens on now."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def replica_steps(daemon, job, rank):
    """Steps of (job, rank) whose manifest `daemon`'s replica store holds."""
    d = os.path.join(daemon.data, "replicas", "jobs", job, "rank-%08x" % rank, "m")
    if not os.path.isdir(d):
        return set()
    return {int(f[1:]) for f in os.listdir(d) if f.startswith("S") and f[1:].isdigit()}


def main():
    if shutil.which("openssl") is None:
        print("skipping: openssl is needed for the nodes' certificates")
        return 77
    root = harness.tempdir("ckpt-torch-topo-")
    pki = netns.Pki(os.path.join(root, "pki"))
    key = harness.remote_key(root)
    p1, p2, p3 = free_ports(3)
    ring = "n1=127.0.0.1:%d,n3=127.0.0.1:%d,n2=127.0.0.1:%d" % (p1, p3, p2)
    daemons = {}
    for name, port in (("n1", p1), ("n2", p2)):
        cert, tls_key = pki.issue(name, "127.0.0.1")
        daemons[name] = harness.Daemon(os.path.join(root, name), extra=[
            "--peer_cert_file=" + cert, "--peer_tls_key_file=" + tls_key,
            "--peer_ca_file=" + pki.ca, "--remote_key_file=" + key,
            "--peer_timeout_ms=3000", "--peer_listen=127.0.0.1:%d" % port,
            "--peer_memory_bytes=%d" % (64 << 20), "--peer_copies=1",
            "--peer_nodes=" + ring])
    n1, n2 = daemons["n1"], daemons["n2"]
    procs = []
    try:
        for d in daemons.values():
            d.start()
        for name, d in daemons.items():
            status = d.ctl("status")
            check(status["node"] == name, "ckptd %s is named by its certificate: node %r, "
                  "rack %r" % (name, status["node"], status.get("rack")))

        # The 2-rank job: rank 0 on n1, rank 1 on n2.
        store = os.path.join(root, "topo-store")
        sync = os.path.join(root, "topo-sync")
        os.makedirs(sync)
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                   "--rank", str(r), "--socket", d.socket, "--store", store,
                                   "--sync", sync, "--steps", str(STEPS)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r, d in enumerate((n1, n2))]
        results = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                harness.kill_processes(procs)
                raise AssertionError("a rank of 'topo' did not finish; n1's log:\n%s\nn2's "
                                     "log:\n%s" % (n1.log()[-3000:], n2.log()[-3000:]))
            if p.returncode != 0:
                raise AssertionError("a rank of 'topo' exited %d: %s" % (p.returncode,
                                                                         err[-4000:]))
            results.append(json.loads(out.strip().splitlines()[-1]))
        for r in results:
            print("rank %d of 'topo': %s" % (r["rank"], r))
        check([r["node"] for r in results] == ["n1", "n2"],
              "Client.node() names each rank's ckptd: %s" % [r["node"] for r in results])
        check(all(r["job_nodes"] == ["n1", "n2"] for r in results),
              "attach() registered the job's nodes gathered over gloo on both ranks: %s"
              % results[0]["job_nodes"])
        check(all(r["durable"] == STEPS for r in results),
              "both ranks' step %d is in the peer tier" % STEPS)
        check(results[0].get("solo_nodes") == ["n1"],
              "a one-rank job in an initialised world of two attaches alone, with its own "
              "node: %s" % results[0].get("solo_nodes"))

        placed = {name: harness.ctl_jobs(d)["topo"]["peer_nodes"] for name, d in daemons.items()}
        print("placement of 'topo': %s" % placed)
        check(placed["n1"] == ["n2"], "n1 places the job's copies on the job's ring, on n2 "
              "(the cluster's ring would give n3): %s" % placed["n1"])
        check(placed["n2"] == ["n1"], "n2 places the job's copies on n1: %s" % placed["n2"])
        held = {(name, r): sorted(replica_steps(d, "topo", r))
                for name, d in daemons.items() for r in range(WORLD)}
        print("replicas of 'topo' held: %s" % held)
        check(STEPS in held[("n2", 0)], "n2 holds rank 0's replicas (steps %s)"
              % held[("n2", 0)])
        check(STEPS in held[("n1", 1)], "n1 holds rank 1's replicas (steps %s)"
              % held[("n1", 1)])
        check(not held[("n1", 0)] and not held[("n2", 1)],
              "no node holds replicas of its own rank")

        # One rank alone on n1: its only node is n1, so the cluster's ring places it.
        alone = train(client_for(n1.socket), "alone", 0, 1, STEPS, wait_peer=False)
        print("the rank of 'alone': %s" % alone)
        check(alone["job_nodes"] == ["n1"], "a one-rank job registers its own node only: %s"
              % alone["job_nodes"])
        placed = harness.ctl_jobs(n1)["alone"]["peer_nodes"]
        print("placement of 'alone' on n1: %s" % placed)
        check(placed == ["n3"], "a one-rank job reports only its own node, and n1 places it "
              "by the cluster's ring, on n3: %s" % placed)
        for name, d in daemons.items():
            for line in d.log().splitlines():
                if "peer tier: job" in line:
                    print("%s's log: %s" % (name, line.split("] ", 1)[-1]))
        print("PASS")
    finally:
        harness.kill_processes(procs)
        for d in daemons.values():
            d.kill()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(harness.rank_parser(STEPS).parse_args())
    else:
        sys.exit(main())
