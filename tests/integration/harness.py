"""Shared helpers for ckptd's integration tests: real daemon processes,
real sockets, temporary data directories. Standard library only."""

import atexit
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BUILD = os.environ.get("CKPT_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
CKPTD = os.path.join(BUILD, "daemon", "ckptd")
CKPTCTL = os.path.join(BUILD, "tools", "ckptctl")
TRAINER = os.path.join(BUILD, "tools", "ckpt_example_trainer")


def socket_accepts(path):
    """True once a Unix socket at `path` accepts a connection."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def require_torch(*modules):
    """For the scripts run with the project's PyTorch: exits 77 (ctest's
    skip) when torch, the ckpt module or one of `modules` cannot be
    imported, so that the script's own imports that follow succeed."""
    import importlib
    for name in ("torch", "ckpt", "ckpt.torch") + modules:
        try:
            importlib.import_module(name)
        except ImportError as e:  # pragma: no cover - reported as a skip
            print("skipping: %s" % e)
            sys.exit(77)


def rank_parser(steps):
    """The arguments of one rank of a multi-rank test script (`--worker`):
    its rank, its node's ckptd socket, torch.distributed's file store, the
    directory of the test's sync-point files and the steps to train."""
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--sync", required=True)
    p.add_argument("--steps", type=int, default=steps)
    return p


class Daemon:
    """One ckptd process on a private socket and data directory."""

    def __init__(self, root, pool_bytes=128 << 20, extra=(), env=None):
        self.root = root
        self.socket = os.path.join(root, "run", "ckptd.sock")
        self.data = os.path.join(root, "data")
        self.log_path = os.path.join(root, "ckptd.log")
        self.args = [CKPTD, "--socket=" + self.socket, "--data_dir=" + self.data,
                     "--staging_pool_bytes=%d" % pool_bytes, "--staging_chunk_bytes=1048576",
                     "--shutdown_grace_ms=5000", "--metrics_address=127.0.0.1:0"] + list(extra)
        self.env = env
        self.proc = None
        # A test that fails half-way must not leave its ckptd running.
        atexit.register(self.kill)

    def start(self, timeout=30.0):
        os.makedirs(self.root, exist_ok=True)
        log = open(self.log_path, "a")
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ckptd exited with %d; log:\n%s" % (self.proc.returncode, self.log()))
            if socket_accepts(self.socket):
                return self
            time.sleep(0.02)
        raise RuntimeError("ckptd did not become ready in %.0f s" % timeout)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout=60):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=timeout)
        return self.proc.returncode if self.proc else None

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def ctl_raw(self, *args, socket=None, timeout=120):
        """Runs ckptctl as given and returns the CompletedProcess (human output)."""
        return subprocess.run([CKPTCTL, "--socket=" + (socket or self.socket)] + list(args),
                              capture_output=True, text=True, timeout=timeout)

    def stable_plan(self, job, timeout=120):
        """The job's plan once two reads 0.5 s apart agree: versions staged
        before a kill or a full disk still become durable meanwhile."""
        deadline = time.time() + timeout
        plan = self.ctl("plan", job)
        while time.time() < deadline:
            time.sleep(0.5)
            again = self.ctl("plan", job)
            if again == plan:
                return plan
            plan = again
        raise RuntimeError("the plan of %s still changed after %d s" % (job, timeout))

    def ctl(self, *args, check=True, timeout=120):
        """Runs ckptctl --json and returns the parsed JSON."""
        out = subprocess.run([CKPTCTL, "--socket=" + self.socket, "--json",
                              "--timeout=%d" % timeout] + list(args),
                             capture_output=True, text=True, timeout=timeout + 30)
        if check and out.returncode != 0:
            raise RuntimeError("ckptctl %s failed (%d): %s" % (args, out.returncode, out.stderr))
        return json.loads(out.stdout) if out.stdout.strip() else None


def remote_key(root, name="remote.key"):
    """A cluster key for the remote tier under `root` (mode 0600): every ckptd
    of a test that shares one remote tier is given the same file."""
    path = os.path.join(root, name)
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
    return path


def trainer_cmd(daemon, job, *args):
    return [TRAINER, "--socket=" + daemon.socket, "--job=" + job] + list(args)


def run_trainer(daemon, job, *args, timeout=300):
    out = subprocess.run(trainer_cmd(daemon, job, *args), capture_output=True, text=True,
                         timeout=timeout)
    return out


def read_jsonl(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line torn by SIGKILL
    return rows


def scrape(address):
    """{(name, labels): value} of every series ckptd's metrics endpoint
    serves (labels as written between the braces, "" for none)."""
    body = urllib.request.urlopen("http://%s/metrics" % address, timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            out[(name, labels.rstrip("}"))] = float(value)
    return out


def metric(address, name, labels=""):
    """The sum of the series of metric `name` whose labels contain
    `labels`; None when there is none."""
    values = [v for (n, l), v in scrape(address).items() if n == name and labels in l]
    return sum(values) if values else None


def rss_bytes(pid):
    """The resident set size of process `pid`."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path, allocated=False):
    """Bytes of the files under `path`: their sizes, or with `allocated`
    the blocks they take on disk."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            total += st.st_blocks * 512 if allocated else st.st_size
    return total


def kill_processes(procs):
    """SIGKILLs and reaps every process in `procs` still running (None skipped)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def ctl_jobs(d):
    """{job_id: job} as `ckptctl jobs` lists them."""
    return {j["job_id"]: j for j in d.ctl("jobs")["jobs"]}


def wait_tier(d, jobs, tier, timeout=600):
    """Waits until each job's every rank has its newest local step in `tier`
    ("remote" or "peer"); {job: that step of rank 0}."""
    field = tier + "_step"
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = ctl_jobs(d)
        if all(j in info and all(r.get(field, 0) > 0 and r[field] >= r["latest_durable_step"]
                                 for r in info[j]["ranks"]) for j in jobs):
            return {j: info[j]["ranks"][0][field] for j in jobs}
        time.sleep(0.2)
    raise AssertionError("the %s tier did not catch up: %s\n%s" %
                         (tier, ctl_jobs(d), d.log()[-3000:]))


def check(cond, what):
    """Fails the test with `what` unless `cond`; prints "ok: what" when it holds."""
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


def wait_for(predicate, timeout_s, what):
    """Polls `predicate` every 50 ms until it holds; fails naming `what`
    after `timeout_s`."""
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("timed out after %g s waiting for %s" % (timeout_s, what))
        time.sleep(0.05)


def rank_order_mean(_, bucket):
    """DDP comm hook: the mean of the ranks' gradients summed in rank order.
    Gloo's ring all-reduce sums each element in an order that depends on
    where it lies in its bucket, and DDP rebuilds its buckets after the
    first iteration of a process, so a run restored at step 10 (its first
    iteration is step 11) would round differently from one that was not.
    This makes the result a function of the gradients alone."""
    import torch
    import torch.distributed as dist
    t = bucket.buffer()
    world = dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(world)]
    fut = dist.all_gather(parts, t, async_op=True).get_future()

    def mean(f):
        got = f.value()
        total = got[0].clone()
        for x in got[1:]:
            total += x
        return total / world

    return fut.then(mean)


def stop_dcp_process():
    """Ends DCP's checkpoint process of async_save's process executor (a
    module-level singleton), so that a test's process can exit."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        try:
            proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
            proc._save_process.join(timeout=60)
        except Exception:  # noqa: BLE001 - best effort at the end of a run
            pass
        ape._CHECKPOINT_PROCESS = None


def other_uids_unavailable(python_client=False):
    """Why a test that runs processes as other uids (through setpriv, as
    root) cannot run here, or None. With `python_client`, the Python client
    must be built too (the sanitizer builds do not build it)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv"
    if python_client:
        probe = subprocess.run([sys.executable, "-c", "import ckpt"], capture_output=True,
                               text=True, env=dict(os.environ,
                                                   PYTHONPATH=os.path.join(BUILD, "python")))
        if probe.returncode != 0:
            return ("the Python client is not built here: " +
                    (probe.stderr.strip().splitlines() or ["?"])[-1])
    return None


def model_state(model, opt):
    """Copies of every parameter of `model`, its optimizer state in `opt`
    (step counts too) and every buffer, in order: what a restore must give
    back exactly."""
    import torch
    out = []
    for p in model.parameters():
        out.append(p.detach().clone())
        for _, v in sorted(opt.state.get(p, {}).items()):
            out.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
    out += [b.detach().clone() for b in model.buffers()]
    return out


def tempdir(prefix):
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("CKPT_TEST_TMP", "/tmp"))


def machine(path):
    """What a benchmark report says about the machine it ran on: kernel,
    CPUs and their model, memory, Python, the load average at the start and
    the file system that holds `path`."""
    import platform
    info = {"kernel": platform.release(), "cpus": os.cpu_count(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total"] = int(f.readline().split()[1]) * 1024
        with open("/proc/loadavg") as f:
            info["loadavg_start"] = f.read().split()[:3]
        fs = subprocess.run(["df", "-T", "--output=fstype,size", path], capture_output=True, text=True)
        info["fs"] = " ".join(fs.stdout.split()[2:])
    except OSError:
        pass
    return info
