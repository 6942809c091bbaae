"""Nodes as network namespaces on this machine, for the peer-replication
tests: each node is a namespace with one veth link to a switch namespace
holding a bridge, and an address on a private /24. Traffic stays between the
namespaces the test created; `close()` removes them (also at exit).

Also makes the TLS files peers authenticate each other with: a CA, and a
certificate and key per node name (mode 0600, as ckptd requires)."""

import atexit
import os
import subprocess
import uuid


def sh(*args, check=True, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), out.returncode, out.stderr))
    return out


def available():
    """Why nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = "ckpt-probe-%s" % uuid.uuid4().hex[:6]
    out = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if out.returncode != 0:
        return "ip netns add failed: %s" % out.stderr.strip()
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Cluster:
    """Nodes named by the caller, on 10.<net>.0.<i>/24 behind one bridge."""

    def __init__(self, names, net=77):
        self.tag = uuid.uuid4().hex[:6]
        self.switch = "ckpt-sw-" + self.tag
        self.ns = {}
        self.addr = {}
        self.links = {}
        atexit.register(self.close)
        sh("ip", "netns", "add", self.switch)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        sh("ip", "link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(names, start=1):
            ns = "ckpt-%s-%s" % (name, self.tag)
            sh("ip", "netns", "add", ns)
            here, there = "v%s%d" % (self.tag, i), "s%s%d" % (self.tag, i)
            sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            sh("ip", "link", "set", here, "netns", ns)
            sh("ip", "link", "set", there, "netns", self.switch)
            sh("ip", "link", "set", there, "master", "br0", ns=self.switch)
            sh("ip", "link", "set", there, "up", ns=self.switch)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            sh("ip", "addr", "add", "10.%d.0.%d/24" % (net, i), "dev", here, ns=ns)
            sh("ip", "link", "set", here, "up", ns=ns)
            self.ns[name] = ns
            self.addr[name] = "10.%d.0.%d" % (net, i)
            self.links[name] = here

    def run(self, name, *args, check=True):
        return sh(*args, check=check, ns=self.ns[name])

    def link(self, name, up):
        """Cuts (or restores) the node's only link: a partition."""
        self.run(name, "ip", "link", "set", self.links[name], "up" if up else "down")

    def rate_limit(self, name, rate):
        """Shapes what the node sends to `rate` (tc tbf, e.g. "20mbit"); None removes it."""
        if rate is None:
            self.run(name, "tc", "qdisc", "del", "dev", self.links[name], "root", check=False)
        else:
            self.run(name, "tc", "qdisc", "replace", "dev", self.links[name], "root", "tbf",
                     "rate", rate, "burst", "64kb", "latency", "200ms")

    def close(self):
        for ns in list(self.ns.values()) + ([self.switch] if self.switch else []):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.ns = {}
        self.switch = None


def _openssl(*args):
    out = subprocess.run(["openssl"] + list(args), capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError("openssl %s: %s" % (" ".join(args), out.stderr))


class Pki:
    """A CA under `root` and certificates it signs, one per node name."""

    def __init__(self, root, name="ckpt-test-ca"):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.ca_key = os.path.join(root, name + ".key")
        self.ca = os.path.join(root, name + ".pem")
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-nodes", "-keyout", self.ca_key, "-out", self.ca, "-days", "2",
                 "-subj", "/CN=" + name)
        os.chmod(self.ca, 0o600)
        os.chmod(self.ca_key, 0o600)

    def issue(self, cn, ip=None):
        """(cert, key) for `cn`, with `cn` (and `ip`) as subject alternative names."""
        key = os.path.join(self.root, cn + ".key")
        csr = os.path.join(self.root, cn + ".csr")
        cert = os.path.join(self.root, cn + ".pem")
        ext = os.path.join(self.root, cn + ".ext")
        with open(ext, "w") as f:
            f.write("subjectAltName=DNS:%s%s\n" % (cn, ",IP:" + ip if ip else ""))
            f.write("extendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", key, "-out", csr, "-subj", "/CN=" + cn)
        _openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key,
                 "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext)
        os.chmod(key, 0o600)
        os.chmod(cert, 0o600)
        return cert, key
