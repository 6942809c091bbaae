#!/usr/bin/python3
"""The peer tier's figures, each against its baseline in the same run
(docs/peer.md, "Figures"); needs root (network namespaces) and, for part 3,
the ceph packages:

  /usr/bin/python3 tests/perf/peer_replication.py [--layers=8] [--layer-mib=32] [--rounds=3]

1. Throughput between two nodes made of network namespaces (netns.py),
   interleaved rounds, each moving one step's bytes from node A to node B:
   - a raw TCP stream (Python sockets, 1 MiB writes, B acknowledges the
     last byte);
   - a raw TLS stream (the same through OpenSSL's TLS 1.3 with the nodes'
     certificates, records gathered into 1 MiB socket writes);
   - a raw TLS stream over four connections at once (ckptd's upload
     threads), from memory to memory: no disk at either end;
   - the same work as a replication, by hand: the step's layer files read
     from A's disk with O_DIRECT, over TLS, written at B with O_DIRECT,
     fsynced and renamed into place, four connections at once - what the
     machine allows for the work; and the same from A's memory (as ckptd
     sends what its memory tier holds);
   - ckptd A replicating one step of the example trainer (policy all:
     every layer) to ckptd B over mutual TLS, timed by its own
     ckpt_peer_upload_seconds, and the share of its bytes sent from its
     memory tier.
   Median of each and the ratios. Then one stream of 8 steps' bytes of
   each kind, raw TCP and raw TLS, with the machine's CPU time over it
   (/proc/stat): the core-seconds each costs per GB, and the most a TLS
   stream could move with every core busy, against the TCP stream.
2. The trainer's step time with and without replication: the same job
   (--steps, --compute-ms) on ckptd A without a peer, then with one; the
   trainer's mean StepDone and its wall time per step.
3. A replacement node's restore, from the peer against the same bytes from
   radosgw (a one-node Ceph cluster, tests/daemon/remote/ceph_rgw.py): ckptd
   processes on this host's loopback, one trained node copying to both
   tiers; after its loss, a fresh ckptd with only the peer tier and another
   with only the remote tier each register, pull and restore the step.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "daemon", "remote"))

import harness  # noqa: E402
import netns  # noqa: E402

PORT = 7471

SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    head = b""
    while len(head) < 32:
        head += c.recv(32 - len(head))
    want = int(head.split(b"\n")[0]); got = 0
    while got < want:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.sendall(b"k"); c.close()
"""

SOURCE = r"""
import socket, sys, time
n = int(sys.argv[3]); buf = b"\0" * (1 << 20)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.perf_counter(); s.sendall((b"%d\n" % n).ljust(32))
left = n
while left > 0:
    k = min(left, len(buf)); s.sendall(buf[:k]); left -= k
s.recv(1); print(time.perf_counter() - t0)
"""


# The TLS baselines: Python's ssl through memory BIOs, so that records
# leave in 1 MiB socket writes (a socket-wrapped SSL object writes each
# 16 KiB record on its own, which Nagle's algorithm then holds back).
TLS_COMMON = r"""
import os, socket, ssl, sys, time, mmap, threading
def handshake(o, s, inb, outb):
    while True:
        try:
            o.do_handshake()
        except ssl.SSLWantReadError:
            d = outb.read()
            if d: s.sendall(d)
            inb.write(s.recv(1 << 16))
            continue
        d = outb.read()
        if d: s.sendall(d)
        return
def read_exact(o, s, inb, buf, n):
    # Reads n bytes of plaintext into buf (a memoryview).
    got = 0
    while got < n:
        try:
            k = o.read(n - got, buf[got:n])
            if k == 0: raise EOFError
            got += k
        except ssl.SSLWantReadError:
            d = s.recv(1 << 20)
            if not d: raise EOFError
            inb.write(d)
def send(o, s, outb, data):
    o.write(data)
    s.sendall(outb.read())
"""

TLS_SINK = TLS_COMMON + r"""
# argv: addr port cert key outdir|-
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[3], sys.argv[4])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((sys.argv[1], int(sys.argv[2]))); ls.listen(16)
outdir = None if sys.argv[5] == "-" else sys.argv[5]
print("ready", flush=True)
def serve(c, n):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inb, outb = ssl.MemoryBIO(), ssl.MemoryBIO()
    o = ctx.wrap_bio(inb, outb, server_side=True)
    handshake(o, c, inb, outb)
    buf = mmap.mmap(-1, 1 << 20); view = memoryview(buf)
    head = bytearray(32); hv = memoryview(head)
    try:
        while True:
            read_exact(o, c, inb, hv, 32)
            want = int(bytes(head).split(b"\n")[0]); got = 0
            fd = -1
            if outdir:
                tmp = os.path.join(outdir, ".tmp.%d.%d" % (n, time.monotonic_ns()))
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            while got < want:
                k = min(1 << 20, want - got)
                read_exact(o, c, inb, view, k)
                if fd >= 0:
                    os.pwritev(fd, [view[:(k + 4095) // 4096 * 4096]], got)
                got += k
            if fd >= 0:
                os.ftruncate(fd, want); os.fsync(fd); os.close(fd)
                final = tmp.replace(".tmp.", "o.")
                os.rename(tmp, final)
                d = os.open(outdir, os.O_RDONLY); os.fsync(d); os.close(d)
                os.unlink(final)
            send(o, c, outb, b"k")
    except EOFError:
        c.close()
n = 0
while True:
    c, _ = ls.accept(); n += 1
    threading.Thread(target=serve, args=(c, n), daemon=True).start()
"""

TLS_SOURCE = TLS_COMMON + r"""
# argv: addr port ca connections file... (or "-N" for N bytes from memory)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.load_verify_locations(sys.argv[3])
ctx.check_hostname = False
conns = int(sys.argv[4]); items = sys.argv[5:]
links = []
for i in range(conns):
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inb, outb = ssl.MemoryBIO(), ssl.MemoryBIO()
    o = ctx.wrap_bio(inb, outb); handshake(o, s, inb, outb)
    links.append((o, s, inb, outb))
def run(i):
    o, s, inb, outb = links[i]
    buf = mmap.mmap(-1, 1 << 20); view = memoryview(buf)
    ack = memoryview(bytearray(1))
    for item in items[i::conns]:
        if item.startswith("-"):
            n, fd = int(item[1:]), -1
        else:
            fd = os.open(item, os.O_RDONLY | os.O_DIRECT); n = os.fstat(fd).st_size
        send(o, s, outb, (b"%d\n" % n).ljust(32))
        off = 0
        while off < n:
            k = min(1 << 20, n - off)
            if fd >= 0:
                os.preadv(fd, [view[:(k + 4095) // 4096 * 4096]], off)
            send(o, s, outb, view[:k])
            off += k
        if fd >= 0: os.close(fd)
        read_exact(o, s, inb, ack, 1)
t0 = time.perf_counter()
threads = [threading.Thread(target=run, args=(i,)) for i in range(conns)]
for t in threads: t.start()
for t in threads: t.join()
print(time.perf_counter() - t0)
"""


def layer_files(root, layers, layer_mib):
    """`layers` files of `layer_mib` MiB of random bytes, fsynced."""
    files = []
    os.makedirs(root, exist_ok=True)
    for i in range(layers):
        path = os.path.join(root, "layer%d" % i)
        with open(path, "wb") as f:
            for _ in range(layer_mib):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        files.append(path)
    return files


def scrape(cluster, node, d):
    address = d.ctl("status")["metrics_address"]
    cmd = ["curl", "-sf", "http://%s/metrics" % address]
    out = cluster.run(node, *cmd).stdout if cluster else subprocess.run(
        cmd, capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def busy_seconds():
    """The machine's CPU time so far, every core's, in seconds: user, nice,
    system, irq and softirq (not idle, iowait or the host's steal; guest
    time is already in user)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def wait_peer(d, job, step, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for j in d.ctl("jobs")["jobs"]:
            if j["job_id"] == job and j["ranks"][0].get("peer_step", 0) >= step:
                return
        time.sleep(0.05)
    raise AssertionError("step %d of %s not peer-durable" % (step, job))


def wait_remote(d, job, step, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for j in d.ctl("jobs")["jobs"]:
            if j["job_id"] == job and j["ranks"][0].get("remote_step", 0) >= step:
                return
        time.sleep(0.05)
    raise AssertionError("step %d of %s not remote-durable" % (step, job))


def trainer(d, job, args, steps, *extra, layer_mib=None):
    out = harness.run_trainer(d, job, "--layers=%d" % args.layers,
                              "--layer-bytes=%dM" % (layer_mib or args.layer_mib),
                              "--steps=%d" % steps,
                              "--policy=all", *extra, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def tls_args(tls, key):
    return ["--peer_cert_file=" + tls[0], "--peer_tls_key_file=" + tls[1],
            "--peer_ca_file=" + tls[2], "--remote_key_file=" + key]


def throughput(args, root, pool):
    cluster = netns.Cluster(["node-a", "node-b"], net=78)
    try:
        pki = netns.Pki(os.path.join(root, "pki"))
        tls = {n: pki.issue(n, cluster.addr[n]) + (pki.ca,) for n in cluster.ns}
        key = harness.remote_key(root)
        b = harness.Daemon(os.path.join(root, "b"), pool_bytes=pool, extra=tls_args(
            tls["node-b"], key) + ["--peer_listen=%s:%d" % (cluster.addr["node-b"], PORT)])
        b.args = ["ip", "netns", "exec", cluster.ns["node-b"]] + b.args
        b.start()
        peer = ["--peer_address=%s:%d" % (cluster.addr["node-b"], PORT), "--peer_name=node-b"]
        a = harness.Daemon(os.path.join(root, "a"), pool_bytes=pool,
                           extra=tls_args(tls["node-a"], key))
        a.args = ["ip", "netns", "exec", cluster.ns["node-a"]] + a.args
        nbytes = args.layers * args.layer_mib << 20

        # 2 first, without then with a peer (same daemon directory).
        walls = {}
        backlog = 0.0
        for label in ("without replication", "with replication"):
            extra = []
            if label == "with replication":
                a.stop()
                a.args += peer
                extra = ["--wait-tier=peer"]
            a.start()
            t0 = time.time()
            out = trainer(a, "step-" + label.split()[0], args, args.steps,
                          "--compute-ms=%d" % args.compute_ms, *extra,
                          layer_mib=args.step_layer_mib)
            wall = time.time() - t0
            # The last step's wait for the peer tier, after the training:
            # the backlog (part 1 then measures an idle link).
            waited = [l for l in out.stdout.splitlines() if "in the peer tier" in l]
            if waited:
                backlog = float(waited[-1].split(" s after")[0].rsplit(" ", 1)[1])
                wall -= backlog
            stepdone = [l for l in out.stdout.splitlines() if "mean StepDone" in l][-1]
            walls[label] = (wall / args.steps, stepdone.split(":", 1)[1].strip())

        sinks = []
        def start_sink(*argv):
            p = subprocess.Popen(["ip", "netns", "exec", cluster.ns["node-b"], sys.executable,
                                  "-c"] + list(argv), stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            sinks.append(p)
        start_sink(SINK, cluster.addr["node-b"], str(PORT + 1))
        cert_b, key_b = tls["node-b"][0], tls["node-b"][1]
        sink_dir = os.path.join(root, "b", "raw-sink")
        os.makedirs(sink_dir, exist_ok=True)
        start_sink(TLS_SINK, cluster.addr["node-b"], str(PORT + 2), cert_b, key_b, "-")
        start_sink(TLS_SINK, cluster.addr["node-b"], str(PORT + 3), cert_b, key_b, sink_dir)
        files = layer_files(os.path.join(root, "a", "raw-source"), args.layers, args.layer_mib)
        ca = tls["node-a"][2]
        figures = {k: [] for k in ("tcp", "tls", "tls4", "work", "work_mem", "ckptd")}
        memory_share = []  # of each ckptd round's bytes, those sent from the memory tier
        for r in range(1, args.rounds + 1):
            out = cluster.run("node-a", sys.executable, "-c", SOURCE, cluster.addr["node-b"],
                              str(PORT + 1), str(nbytes))
            figures["tcp"].append(nbytes / float(out.stdout.strip()))
            out = cluster.run("node-a", sys.executable, "-c", TLS_SOURCE, cluster.addr["node-b"],
                              str(PORT + 2), ca, "1", "-%d" % nbytes)
            figures["tls"].append(nbytes / float(out.stdout.strip()))
            out = cluster.run("node-a", sys.executable, "-c", TLS_SOURCE, cluster.addr["node-b"],
                              str(PORT + 3), ca, "4", *files)
            figures["work"].append(nbytes / float(out.stdout.strip()))
            in_memory = ["-%d" % (args.layer_mib << 20)] * args.layers
            out = cluster.run("node-a", sys.executable, "-c", TLS_SOURCE, cluster.addr["node-b"],
                              str(PORT + 3), ca, "4", *in_memory)
            figures["work_mem"].append(nbytes / float(out.stdout.strip()))
            out = cluster.run("node-a", sys.executable, "-c", TLS_SOURCE, cluster.addr["node-b"],
                              str(PORT + 2), ca, "4", *in_memory)
            figures["tls4"].append(nbytes / float(out.stdout.strip()))
            before = scrape(cluster, "node-a", a)
            trainer(a, "rep", args, r, "--wait-tier=peer", *(["--restore"] if r > 1 else []))
            after = scrape(cluster, "node-a", a)
            figures["ckptd"].append(nbytes / (after.get("ckpt_peer_upload_seconds_sum", 0.0) -
                                              before.get("ckpt_peer_upload_seconds_sum", 0.0)))
            sent = [m.get(k, 0.0) for m in (before, after) for k in (
                "ckpt_peer_uploaded_bytes_total", "ckpt_peer_sent_from_memory_bytes_total")]
            memory_share.append((sent[3] - sent[1]) / max(1.0, sent[2] - sent[0]))
        # The CPU a stream costs: a long one of each kind (process start-up
        # is then a small part), the machine's busy time from /proc/stat.
        cost = {}
        long_bytes = 8 * nbytes
        for k, port, argv in (("tcp", PORT + 1, [SOURCE, cluster.addr["node-b"], str(PORT + 1),
                                                  str(long_bytes)]),
                              ("tls", PORT + 2, [TLS_SOURCE, cluster.addr["node-b"], str(PORT + 2),
                                                  ca, "1", "-%d" % long_bytes])):
            # Both ends' processes, start-up included (a little more than
            # the stream itself costs).
            busy0 = busy_seconds()
            out = cluster.run("node-a", sys.executable, "-c", *argv)
            busy = busy_seconds() - busy0
            secs = float(out.stdout.strip())
            cost[k] = (long_bytes / secs / 1e9, busy / (long_bytes / 1e9))
        for p in sinks:
            p.kill()
        m = {k: statistics.median(v) for k, v in figures.items()}
        print("1. one step of %d MiB (%d layers) from node A to node B, %d rounds (median):" %
              (nbytes >> 20, args.layers, args.rounds))
        for k, label in (("tcp", "raw TCP stream"), ("tls", "raw TLS stream"),
                         ("tls4", "raw TLS, 4 connections"),
                         ("work", "the same work by hand"),
                         ("work_mem", "... from A's memory"), ("ckptd", "ckptd peer tier")):
            print("   %-24s %.3f GB/s  %s" % (label, m[k] / 1e9,
                                              [round(x / 1e9, 3) for x in figures[k]]))
        print("   ckptd's bytes sent from its memory tier: %s" %
              ", ".join("%.0f%%" % (100 * x) for x in memory_share))
        print("   ratio ckptd / raw TCP         %.2f" % (m["ckptd"] / m["tcp"]))
        print("   ratio ckptd / raw TLS         %.2f" % (m["ckptd"] / m["tls"]))
        print("   ratio ckptd / same work       %.2f; from memory %.2f" %
              (m["ckptd"] / m["work"], m["ckptd"] / m["work_mem"]))
        print("   ratio by hand / raw TCP       %.2f; from memory %.2f; TLS, 4 connections %.2f" %
              (m["work"] / m["tcp"], m["work_mem"] / m["tcp"], m["tls4"] / m["tcp"]))
        print("   ratio raw TLS / raw TCP       %.2f" % (m["tls"] / m["tcp"]))
        print("   CPU of a %d MiB stream (both ends, the kernel's share included):" %
              (long_bytes >> 20))
        for k in ("tcp", "tls"):
            print("     %-4s %.3f GB/s, %.2f core-seconds per GB" % (k, cost[k][0], cost[k][1]))
        bound = os.cpu_count() / cost["tls"][1]
        print("   with all %d cores busy, no TLS stream here could pass %.2f GB/s: %.2f of that "
              "long TCP stream, %.2f of the rounds' TCP median" %
              (os.cpu_count(), bound, bound / cost["tcp"][0], bound * 1e9 / m["tcp"]))
        print("2. trainer, %d steps of %d x %d MiB, --compute-ms=%d:" %
              (args.steps, args.layers, args.step_layer_mib, args.compute_ms))
        for label, (per_step, stepdone) in walls.items():
            print("   %-20s %.1f ms wall per step; %s" % (label, per_step * 1000, stepdone))
        print("   the last step peer-durable %.2f s after the trainer's end" % backlog)
        a.stop()
        b.stop()
    finally:
        cluster.close()


def restore_sources(args, root, pool):
    import ceph_rgw
    rgw = ceph_rgw.CephRgw(os.path.join(root, "ceph"))
    rgw.start()
    try:
        creds = os.path.join(root, "s3.cred")
        rgw.write_credentials(creds)
        pki = netns.Pki(os.path.join(root, "pki2"))
        tls = {n: pki.issue(n, "127.0.0.1") + (pki.ca,) for n in ("node-a", "node-b", "node-c")}
        key = harness.remote_key(root)
        remote = ["--remote_kind=s3", "--remote_endpoint=" + rgw.endpoint,
                  "--remote_bucket=" + rgw.bucket, "--remote_region=" + rgw.region,
                  "--remote_credentials_file=" + creds]
        peer = ["--peer_address=127.0.0.1:%d" % (PORT + 2), "--peer_name=node-b"]
        b = harness.Daemon(os.path.join(root, "rb"), pool_bytes=pool,
                           extra=tls_args(tls["node-b"], key) + [
                               "--peer_listen=127.0.0.1:%d" % (PORT + 2),
                               "--peer_memory_bytes=%d" % (4 << 30)]).start()
        a = harness.Daemon(os.path.join(root, "ra"), pool_bytes=pool,
                           extra=tls_args(tls["node-a"], key) + peer + remote).start()
        trainer(a, "rs", args, 2)
        wait_peer(a, "rs", 2)
        wait_remote(a, "rs", 2)
        a.kill()
        shutil.rmtree(os.path.join(root, "ra"))
        nbytes = args.layers * args.layer_mib << 20
        print("3. replacement node: register + pull + restore of one %d MiB step:" % (nbytes >> 20))
        times = {}
        for label, extra in (("from the peer", peer), ("from radosgw", remote)):
            for r in range(args.rounds):
                c = harness.Daemon(os.path.join(root, "rc"), pool_bytes=pool,
                                   extra=tls_args(tls["node-c"], key) + extra).start()
                t0 = time.time()
                trainer(c, "rs", args, 0, "--restore")
                times.setdefault(label, []).append(time.time() - t0)
                c.kill()
                shutil.rmtree(os.path.join(root, "rc"))
        for label, t in times.items():
            print("   %-14s %.2f s median  %s" % (label, statistics.median(t),
                                                  [round(x, 2) for x in t]))
        print("   ratio radosgw / peer  %.2f" % (statistics.median(times["from radosgw"]) /
                                                 statistics.median(times["from the peer"])))
        b.stop()
    finally:
        rgw.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compute-ms", type=int, default=200)
    ap.add_argument("--step-layer-mib", type=int, default=4, help="layer size of part 2")
    ap.add_argument("--skip-rgw", action="store_true")
    args = ap.parse_args()
    why = netns.available()
    if why:
        print("needs network namespaces: " + why)
        return 77
    root = harness.tempdir("ckpt-peer-bench-")
    pool = max(256 << 20, 2 * args.layers * args.layer_mib << 20)
    try:
        throughput(args, root, pool)
        if not args.skip_rgw:
            restore_sources(args, root, pool)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
