#!/usr/bin/env python3
"""ckptd against torch.save and torch.distributed.checkpoint (DCP) on the same
model, the same disk and the same AdamW training loop, in one run.

  tests/perf/compare_torch.py                     # the full run (docs/torch-comparison.md)
  tests/perf/compare_torch.py --quick             # the 10M model, 10 steps (about a minute)
  tests/perf/compare_torch.py --smoke             # a tiny model; asserts the outcomes (ctest)
  tests/perf/compare_torch.py --report-only OUT/results.json [--plots-dir docs/plots]

Options: --sizes 10M,100M,200M (presets, see SIZES), --steps 20,10,10 (per
size), --every N (torch.save and DCP checkpoint every N steps; default 5),
--repeats 2,1,1 (per size; the methods' order rotates between repeats; the
baseline runs first and last of each size), --methods, --out DIR
(results.json, tables.md, plots), --data-dir DIR (where every method writes;
one file system for all), --build-dir DIR (ckptd, ckptctl and python/ckpt;
default $CKPT_BUILD_DIR or build/), --lr, --tokens, --threads, --poll-ms,
--pool-mib (default: one step of every layer), --admission-ms.

Methods, each trained and restored in fresh processes of its own:
  none               the same loop without checkpoints (the baseline)
  ckptd_all          ckpt.torch, policy `all`: every layer at every step
  ckptd_layercheck   ckpt.torch, policy `layercheck` (warm-up 0, a full
                     checkpoint every N steps, drift-selected layers between)
  torch_save         torch.save(model and optimizer state_dict) every N steps
  torch_save_fsync   the same, then os.fsync of the file and of its directory
  dcp_save           torch.distributed.checkpoint.save every N steps
  dcp_async_thread   DCP async_save (AsyncCheckpointerType.THREAD) every N steps
  dcp_async_process  DCP async_save (AsyncCheckpointerType.PROCESS) every N steps
DCP runs in a one-process gloo group (the PROCESS checkpointer needs one).
ckptd runs as a separate daemon (tests/integration/harness.py), started for
each method's run with its defaults but for retention (keep the newest 2
events, collect every second, so that a run fits on the disk), a staging pool
that holds one step of every layer (ckptd stages a whole step before it
writes any of it) and an admission timeout of 600 s (policy `all` then writes
every layer of every step; the trainer waits when the disk falls behind).
Every trainer process runs with MALLOC_MMAP_THRESHOLD_=1048576 (a stable
VmHWM) and OMP_WAIT_POLICY=PASSIVE (CPU seconds without spinning).

What is measured, per method and model size:
  stall      time the training loop spends inside checkpoint calls: for ckptd
             the optimizer hooks of ckpt.torch (fence, StepDone, the state
             saved with each step), timed by hooks of this script registered
             around them; for the others the save call, and for async_save
             also the wait for the previous checkpoint before the next.
             ckptd's first step (registration) is reported apart as `setup`.
  step time  wall time per step (data, forward, backward, optimizer step,
             checkpoint call), median; the work that ckptd and the async
             savers do beside the loop shows up here on a shared CPU.
  CPU        user + system seconds per step of the trainer (loop and final
             drain) and its side process (the ckptd daemon, DCP's checkpoint
             process).
  bytes      bytes the writing processes sent to storage (write_bytes of
             /proc/PID/io: the trainer and its child processes; for ckptd the
             daemon), and the allocated size on disk of one checkpoint.
  durable    seconds from the end of a checkpointed step (or the save call's
             start) until that checkpoint is durable: ckptd's newest durable
             step as a watcher process polls it (plan of the job; resolution
             --poll-ms), the async_save future's completion, the end of the
             synchronous call. torch.save without fsync is never known to be
             durable; its figures assume that the page cache survives (a
             process crash, not a node crash).
  lost       expected steps of work lost by a failure at a uniformly random
             step f in 1..S: E = (1/S) * sum_f (f - D(f)), where D(f) is the
             newest step whose checkpoint was durable when step f ended (0 if
             none). For every-N checkpoints made durable at once this is
             (N-1)/2; asynchronous durability adds the lag in steps.
  restore    a new process builds the model and optimizer (other seed), then
             loads the last checkpoint into them; the seconds of that load
             (ckpt.torch: attach + restore(), registration included) with the
             checkpoint's files evicted from the page cache first
             (POSIX_FADV_DONTNEED; ckptd reads with O_DIRECT). Every tensor of
             the model and the optimizer is compared with a SHA-256 of the
             trained process's tensors at that step: bit-exact or not.
  memory     peak resident memory (VmHWM of /proc/self/status) of the trainer
             process minus that of the `none` run of the same size; the peak
             of the side process (the ckptd daemon, DCP's checkpoint
             process) apart.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.normpath(os.path.join(HERE, "..", ".."))

METHODS = ["none", "ckptd_all", "ckptd_layercheck", "torch_save", "torch_save_fsync",
           "dcp_save", "dcp_async_thread", "dcp_async_process"]
LABELS = {
    "none": "no checkpoint",
    "ckptd_all": "ckptd all (every step)",
    "ckptd_layercheck": "ckptd layercheck (every step)",
    "torch_save": "torch.save (no fsync)",
    "torch_save_fsync": "torch.save + fsync",
    "dcp_save": "DCP save",
    "dcp_async_thread": "DCP async_save (thread)",
    "dcp_async_process": "DCP async_save (process)",
}
# Model presets: an embedding, `blocks` pre-norm MLP blocks (d -> 4d -> d,
# residual), a final norm and a head. Parameters ~ 8 d^2 blocks + 2 vocab d.
SIZES = {
    "tiny": dict(vocab=256, width=32, blocks=3),
    "10M": dict(vocab=4096, width=256, blocks=16),
    "100M": dict(vocab=16384, width=768, blocks=16),
    "200M": dict(vocab=8192, width=1280, blocks=14),
    "400M": dict(vocab=8192, width=1536, blocks=20),
}
DEFAULT_STEPS = {"tiny": 6, "10M": 20, "100M": 10, "200M": 10, "400M": 10}


def layer_params(size):
    """Parameters of each layer as ckpt.torch groups them: the embedding,
    each block, the final norm, the head."""
    c = SIZES[size]
    v, d, n = c["vocab"], c["width"], c["blocks"]
    return [v * d] + [2 * d + 4 * d * d + 4 * d + 4 * d * d + d] * n + [2 * d, d * v + v]


def param_count(size):
    return sum(layer_params(size))


CHUNK = 4 << 20  # ckptd's staging_chunk_bytes (its default)


def pool_bytes(args, size):
    """ckptd's staging pool: --pool-mib, or (0) room for one step of every
    layer: each layer version (weights and both AdamW moments, f32, and 64 KiB
    for headers) in whole 4 MiB chunks, plus two chunks."""
    if args.pool_mib:
        return args.pool_mib << 20
    return sum(-(-(p * 12 + (64 << 10)) // CHUNK) * CHUNK for p in layer_params(size)) + 2 * CHUNK


# ---------------------------------------------------------------- /proc and files

def proc_status(pid="self"):
    """{field: bytes} of the VmHWM, VmRSS, RssAnon, RssShmem lines."""
    out = {}
    try:
        with open("/proc/%s/status" % pid) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def write_bytes(pid="self"):
    """Bytes process `pid` (its threads, and its children it reaped) sent to
    the storage layer."""
    try:
        with open("/proc/%s/io" % pid) as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid="self"):
    """User + system CPU seconds of process `pid` (all its threads, and the
    children it reaped)."""
    try:
        with open("/proc/%s/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # Fields 14 to 17 of proc(5): utime, stime, cutime, cstime (fields[0] is
    # field 3, the state).
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def children(pid="self"):
    """Pids of the live child processes of `pid` (any of its threads)."""
    out = []
    base = "/proc/%s/task" % pid
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(os.path.join(base, tid, "children")) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return sorted(set(out))


def descendants(pid="self"):
    out = []
    for c in children(pid):
        out += [c] + descendants(c)
    return out


def dir_bytes(path):
    """Allocated bytes of the files under `path`."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def evict(path):
    """Writes back and drops the page cache of every file under `path`."""
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def cpu_pressure_us():
    """Microseconds some task waited for a CPU (/proc/pressure/cpu), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def human_bytes(n):
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return "%.2f %s" % (n / scale, unit)
    return "%d B" % n


def fmt_n(x):
    return "-" if x is None else "%d" % x


def human_s(s):
    if s is None:
        return "-"
    if s >= 1:
        return "%.2f s" % s
    if s >= 1e-3:
        return "%.1f ms" % (s * 1e3)
    return "%.0f µs" % (s * 1e6)


# ---------------------------------------------------------------- the model

def build(size, seed, lr):
    import torch
    import torch.nn as nn

    cfg = SIZES[size]

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self, vocab, d, n):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.layers:
                x = b(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    model = Net(cfg["vocab"], cfg["width"], cfg["blocks"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, opt


def batch(size, step, tokens, seed):
    import torch
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randint(0, SIZES[size]["vocab"], (1, tokens + 1), generator=g)


def train_step(model, idx):
    import torch.nn.functional as F
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def named_state(model, opt):
    """Every tensor of the model and its optimizer, by a stable name."""
    out = {}
    for n, t in model.state_dict().items():
        out["model." + n] = t
    for n, p in model.named_parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            out["optim.%s.%s" % (n, k)] = v
    return out


def digests(model, opt):
    """{name: sha256 of the tensor's bytes}, hashed on two threads."""
    import torch

    def one(item):
        name, t = item
        if not torch.is_tensor(t):
            return name, repr(t)
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return name, hashlib.sha256(memoryview(b)).hexdigest()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, sorted(named_state(model, opt).items())))


def state_bytes(model, opt):
    import torch
    return sum(t.numel() * t.element_size() for t in named_state(model, opt).values()
               if torch.is_tensor(t))


# ---------------------------------------------------------------- DCP

def init_gloo(tmp):
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "pg-store"),
                            rank=0, world_size=1)


def dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


# ---------------------------------------------------------------- trainer

class Saver:
    """torch.save / DCP every N steps; keeps the newest two checkpoints."""

    def __init__(self, method, root, every, model, opt):
        self.method, self.root, self.every = method, root, every
        self.model, self.opt = model, opt
        self.pending = None  # (step, future) of an async_save
        self.durable_at = {}  # step -> monotonic time durable
        self.call_start = {}
        self.sizes = {}  # step -> allocated bytes on disk
        self.kept = []
        os.makedirs(root, exist_ok=True)

    def path(self, step):
        return os.path.join(self.root, "step-%d" % step + (".pt" if "torch" in self.method else ""))

    def _done(self, step):
        self.sizes[step] = (os.lstat(self.path(step)).st_blocks * 512 if "torch" in self.method
                            else dir_bytes(self.path(step)))
        self.kept.append(step)
        while len(self.kept) > 2:
            old = self.path(self.kept.pop(0))
            if os.path.isdir(old):
                shutil.rmtree(old)
            else:
                os.unlink(old)

    def checkpoint(self, step):
        """Returns the seconds the loop spent in checkpoint calls."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        t0 = time.monotonic()
        self.call_start[step] = t0
        waited = None
        m = self.method
        if m.startswith("dcp_async") and self.pending is not None:
            prev, fut = self.pending
            fut.result()  # the previous checkpoint must be written first
            waited = prev
            self.pending = None
        if m in ("torch_save", "torch_save_fsync"):
            p = self.path(step)
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, p)
            if m == "torch_save_fsync":
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsync_dir(self.root)
            self.durable_at[step] = time.monotonic()
        elif m == "dcp_save":
            dcp.save(dcp_state(self.model, self.opt), checkpoint_id=self.path(step))
            self.durable_at[step] = time.monotonic()
        else:
            kind = (AsyncCheckpointerType.PROCESS if m == "dcp_async_process"
                    else AsyncCheckpointerType.THREAD)
            fut = dcp.async_save(dcp_state(self.model, self.opt), checkpoint_id=self.path(step),
                                 async_checkpointer_type=kind)

            def record(_, step=step):
                self.durable_at[step] = time.monotonic()
            fut.add_done_callback(record)
            self.pending = (step, fut)
        stall = time.monotonic() - t0
        if waited is not None:
            self._done(waited)
        elif not m.startswith("dcp_async"):
            self._done(step)
        return stall

    def drain(self):
        t0 = time.monotonic()
        if self.pending is not None:
            step, fut = self.pending
            fut.result()
            self.pending = None
            self._done(step)
        return time.monotonic() - t0


def worker(spec):
    """One method's training run in this (fresh) process; writes its JSON."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    torch.set_num_threads(spec["threads"])
    method, size, steps, every = spec["method"], spec["size"], spec["steps"], spec["every"]
    if method.startswith("dcp"):
        init_gloo(spec["tmp"])
    model, opt = build(size, spec["seed"], spec["lr"])
    res = {"method": method, "size": size, "steps": steps, "every": every,
           "params": sum(p.numel() for p in model.parameters()),
           "hwm_after_build": proc_status()["VmHWM"]}
    wb0 = write_bytes()

    # Timing hooks around whatever the checkpoint library hooks into the
    # optimizer step: a global pre-hook and a post-hook registered before it,
    # a pre- and a post-hook registered after it (hooks run in order).
    marks = {}
    h = [register_optimizer_step_pre_hook(lambda o, a, k: marks.__setitem__("pre0", time.monotonic())),
         opt.register_step_post_hook(lambda o, a, k: marks.__setitem__("post0", time.monotonic()))]
    run = saver = None
    if method.startswith("ckptd"):
        import ckpt
        from ckpt import torch as ckpt_torch
        kw = {}
        if method == "ckptd_layercheck":
            kw = dict(policy="layercheck", layercheck=spec["layercheck"])
        run = ckpt_torch.attach(model, opt, ckpt.Client(spec["socket"]), job_id=spec["job"], **kw)
    elif method != "none":
        saver = Saver(method, spec["ckpt_dir"], every, model, opt)
    h += [opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("pre1", time.monotonic())),
          opt.register_step_post_hook(lambda o, a, k: marks.__setitem__("post1", time.monotonic()))]

    step_s, stall_s, step_end, losses, ckpt_steps, ckpt_stall = [], [], [], [], [], []
    t_loop = time.monotonic()
    cpu0 = cpu_seconds()
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        idx = batch(size, step, spec["tokens"], spec["seed"])
        loss = train_step(model, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if run is not None:
            run.set_data_position(step)
        opt.step()
        stall = (marks["pre1"] - marks["pre0"]) + (marks["post1"] - marks["post0"])
        if saver is not None and step % every == 0:
            s = saver.checkpoint(step)
            stall += s
            ckpt_steps.append(step)
            ckpt_stall.append(s)
        elif run is not None:
            ckpt_steps.append(step)
            ckpt_stall.append(stall)
        t1 = time.monotonic()
        step_s.append(t1 - t0)
        stall_s.append(stall)
        step_end.append(t1)
        losses.append(loss.item())
    res["loop_s"] = time.monotonic() - t_loop
    t0 = time.monotonic()
    if run is not None:
        res["durable_step"] = run.wait_durable()
        res["layers"] = len(run.layer_names)
        # The daemon while the rank is still registered (its mappings of
        # this process's tensors go with the registration).
        res["daemon_status"] = proc_status(spec["daemon_pid"])
        stats = run.stats()
        res["fence_wait_s"] = list(stats.fence_wait_s)
        res["step_done_s"] = list(stats.step_done_s)
    if saver is not None:
        saver.drain()
    res["final_drain_s"] = time.monotonic() - t0
    res["cpu_s"] = cpu_seconds() - cpu0
    st = proc_status()
    res.update(vm_hwm=st["VmHWM"], vm_rss=st.get("VmRSS"), rss_shmem=st.get("RssShmem"))
    kids = descendants()
    res["side_hwm"] = max([proc_status(p).get("VmHWM", 0) for p in kids] or [0])
    res["side_cpu_s"] = sum(cpu_seconds(p) for p in kids)
    res["write_bytes"] = write_bytes() - wb0 + sum(write_bytes(p) for p in kids)
    if saver is not None:
        res["durable_at"] = {str(k): v for k, v in saver.durable_at.items()}
        res["call_start"] = {str(k): v for k, v in saver.call_start.items()}
        res["ckpt_disk_bytes"] = {str(k): v for k, v in saver.sizes.items()}
        res["last_checkpoint"] = saver.path(max(saver.durable_at)) if saver.durable_at else None
    res["state_bytes"] = state_bytes(model, opt)
    res.update(step_s=step_s, stall_s=stall_s, step_end=step_end, losses=losses,
               ckpt_steps=ckpt_steps, ckpt_stall_s=ckpt_stall)
    if method != "none":
        res["digests"] = digests(model, opt)
    if run is not None:
        run.close()
    for x in h:
        x.remove()
    if method == "dcp_async_process":
        sys.path.insert(0, os.path.join(HERE, "..", "integration"))
        import harness
        harness.stop_dcp_process()
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    if method.startswith("dcp"):
        import torch.distributed as dist
        dist.destroy_process_group()


def restorer(spec):
    """Loads the last checkpoint of a method into a new model and optimizer
    in this (fresh) process, times it and compares every tensor."""
    import torch
    torch.set_num_threads(spec["threads"])
    method = spec["method"]
    if method.startswith("dcp"):
        init_gloo(spec["tmp"])
    model, opt = build(spec["size"], spec["seed"] + 1, spec["lr"])  # other weights
    res = {"method": method, "size": spec["size"]}
    t0 = time.monotonic()
    if method.startswith("ckptd"):
        import ckpt
        from ckpt import torch as ckpt_torch
        kw = {}
        if method == "ckptd_layercheck":
            kw = dict(policy="layercheck", layercheck=spec["layercheck"])
        run = ckpt_torch.attach(model, opt, ckpt.Client(spec["socket"]), job_id=spec["job"], **kw)
        r = run.restore()
        res.update(restored_step=r.target_step, max_staleness=r.max_staleness,
                   daemon_restore_s=r.seconds, bytes_restored=r.bytes_restored)
    elif method.startswith("torch_save"):
        sd = torch.load(spec["path"], map_location="cpu", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        del sd
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sd = dcp_state(model, opt)
        dcp.load(sd, checkpoint_id=spec["path"])
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        del sd
    res["restore_s"] = time.monotonic() - t0
    res["vm_hwm"] = proc_status()["VmHWM"]
    with open(spec["digests"]) as f:
        want = json.load(f)
    got = digests(model, opt)
    res["tensors"] = len(want)
    res["mismatches"] = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    res["bitexact"] = not res["mismatches"]
    if method.startswith("ckptd"):
        run.close(drain=False)
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    if method.startswith("dcp"):
        import torch.distributed as dist
        dist.destroy_process_group()


def watcher(spec):
    """Polls ckptd for the job's newest durable step; appends 'time step' lines."""
    import ckpt
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    client = ckpt.Client(spec["socket"])
    last = 0
    with open(spec["out"], "w") as out:
        out.write("ready\n")
        out.flush()
        while not stop and last < spec["final"]:
            try:
                t = client.plan(0, job_id=spec["job"], rank=0)["target_step"]
            except ckpt.Error:
                t = 0
            now = time.monotonic()
            if t > last:
                out.write("%.6f %d\n" % (now, t))
                out.flush()
                last = t
            time.sleep(spec["poll_s"])


# ---------------------------------------------------------------- orchestration

def run_child(args, mode, spec, tmp, timeout):
    path = os.path.join(tmp, "%s-%s.json" % (mode, spec["method"]))
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(args.build_dir, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CKPT_BUILD_DIR"] = args.build_dir
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    # Measurement hygiene, the same for every method: a fixed glibc mmap
    # threshold (tensors above 1 MiB are mapped and unmapped, not kept in the
    # heap, so that VmHWM does not depend on the order of frees), and
    # OpenMP threads that sleep instead of spinning while they wait (CPU
    # seconds count work, not waiting for a CPU another process holds).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_" + mode, path],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError("%s %s (%s) failed with %d:\n%s%s" % (
            mode, spec["method"], spec["size"], out.returncode, out.stdout[-4000:],
            out.stderr[-8000:]))
    with open(spec["result"]) as f:
        return json.load(f)


DAEMON_METRICS = ("ckpt_committed_bytes_total", "ckpt_versions_committed_total",
                  "ckpt_snapshots_skipped_total", "ckpt_versions_failed_total",
                  "ckpt_gc_deleted_bytes_total", "ckpt_staged_bytes_total")


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def one_method(args, harness, size, steps, method, rep, base):
    """Trains, restores and cleans up one method; returns its record."""
    tmp = tempfile.mkdtemp(prefix="m-%s-" % method, dir=base)
    job = "cmp-%s-%s-%d" % (size, method, rep)
    spec = dict(method=method, size=size, steps=steps, every=args.every, seed=args.seed,
                lr=args.lr, tokens=args.tokens, threads=args.threads, tmp=tmp, job=job,
                ckpt_dir=os.path.join(tmp, "ckpt"), result=os.path.join(tmp, "train.json"),
                layercheck=layercheck_params(args))
    daemon = watch = None
    rec = {"size": size, "method": method, "repeat": rep}
    psi0, w0 = cpu_pressure_us(), time.monotonic()
    try:
        if method.startswith("ckptd"):
            metrics = "127.0.0.1:%d" % free_port()
            daemon = harness.Daemon(os.path.join(tmp, "ckptd"), pool_bytes=pool_bytes(args, size),
                                    extra=["--staging_chunk_bytes=%d" % CHUNK,
                                           "--keep_last_events=2", "--keep_every_steps=0",
                                           "--gc_interval_s=1", "--metrics_address=" + metrics,
                                           "--admission_timeout_ms=%d" % args.admission_ms]
                                    ).start()
            spec["socket"] = daemon.socket
            spec["daemon_pid"] = daemon.proc.pid
            rec["pool_bytes"] = pool_bytes(args, size)
            wfile = os.path.join(tmp, "durable.txt")
            wspec = os.path.join(tmp, "watch.json")
            with open(wspec, "w") as f:
                json.dump(dict(socket=daemon.socket, job=job, final=steps,
                               poll_s=args.poll_ms / 1000.0, out=wfile), f)
            env = dict(os.environ, PYTHONPATH=os.path.join(args.build_dir, "python"))
            watch = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_watch", wspec],
                                     env=env)
            deadline = time.time() + 60
            while not (os.path.exists(wfile) and open(wfile).read().startswith("ready")):
                if watch.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the durability watcher did not start")
                time.sleep(0.05)
            io0 = write_bytes(daemon.proc.pid)
            dcpu0 = cpu_seconds(daemon.proc.pid)
        train = run_child(args, "worker", spec, tmp, args.timeout)
        rec["train"] = train
        if daemon is not None:
            rec["daemon_write_bytes"] = write_bytes(daemon.proc.pid) - io0
            rec["daemon_cpu_s"] = cpu_seconds(daemon.proc.pid) - dcpu0
            st = proc_status(daemon.proc.pid)
            rec["daemon_hwm"] = st.get("VmHWM", 0)
            rec["daemon_rss_anon"] = st.get("RssAnon")
            rec["daemon_rss_shmem"] = st.get("RssShmem")
            try:
                watch.wait(timeout=30)
            except subprocess.TimeoutExpired:
                watch.send_signal(signal.SIGTERM)
                watch.wait(timeout=30)
            durable = {}
            with open(wfile) as f:
                for line in f.read().splitlines()[1:]:
                    t, s = line.split()
                    durable[int(s)] = float(t)
            # Step s is durable from the first poll that saw s or a later step.
            at = {}
            for s in range(1, steps + 1):
                later = [t for k, t in durable.items() if k >= s]
                if later:
                    at[str(s)] = min(later)
            train["durable_at"] = at
            train["ckpt_disk_bytes"] = {"all": dir_bytes(daemon.data)}
            rec["metrics"] = {k: harness.metric(metrics, k) for k in DAEMON_METRICS}
        if method != "none":
            dig = os.path.join(tmp, "digests.json")
            with open(dig, "w") as f:
                json.dump(train.pop("digests"), f)
            rspec = dict(spec, result=os.path.join(tmp, "restore.json"), digests=dig,
                         path=train.get("last_checkpoint"))
            evict(daemon.data if daemon is not None else spec["ckpt_dir"])
            rec["restore"] = run_child(args, "restorer", rspec, tmp, args.timeout)
        if daemon is not None:
            rec["daemon_hwm_after_restore"] = proc_status(daemon.proc.pid).get("VmHWM", 0)
        psi1 = cpu_pressure_us()
        if psi0 is not None and psi1 is not None:
            # The share of the time some runnable task waited for a CPU.
            rec["cpu_pressure"] = (psi1 - psi0) / 1e6 / (time.monotonic() - w0)
    except BaseException as e:
        if daemon is not None and os.path.exists(daemon.log_path):
            raise RuntimeError("%s\nckptd log (tail):\n%s" % (e, daemon.log()[-4000:])) from e
        raise
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait()
        if daemon is not None:
            try:
                daemon.stop(timeout=120)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


def layercheck_params(args):
    """No warm-up, and a full checkpoint every --every steps (the run's last
    step is then whole, so that its restore can be compared bit for bit)."""
    return {"warmup": 0, "full_every": args.every}


def summarize(rec, base):
    """The figures of one run (one method, one size, one repeat); `base`:
    the medians of the size's `none` runs."""
    baseline_hwm, baseline_step = base.get("hwm"), base.get("step")
    tr, S = rec["train"], rec["train"]["steps"]
    m = rec["method"]
    out = {"size": rec["size"], "method": m, "repeat": rec["repeat"], "steps": S,
           "every": tr["every"], "params": tr["params"], "state_bytes": tr["state_bytes"]}
    steps_after_first = tr["step_s"][1:]
    out["step_p50_s"] = median(steps_after_first)
    out["step_ratio"] = (out["step_p50_s"] / baseline_step) if baseline_step else None
    out["loss_first"], out["loss_last"] = tr["losses"][0], tr["losses"][-1]
    out["vm_hwm"] = tr["vm_hwm"]
    out["cpu_pressure"] = rec.get("cpu_pressure")
    out["hwm_extra"] = tr["vm_hwm"] - baseline_hwm if baseline_hwm is not None else None
    side_cpu = rec.get("daemon_cpu_s", tr.get("side_cpu_s", 0.0)) or 0.0
    if "cpu_s" in tr:
        out["cpu_per_step_s"] = (tr["cpu_s"] + side_cpu) / S
        if base.get("cpu") is not None:
            out["cpu_extra_per_step_s"] = out["cpu_per_step_s"] - base["cpu"]
    if m == "none":
        return out
    stall = tr["stall_s"]
    ck = tr["ckpt_steps"]
    cks = tr["ckpt_stall_s"]
    if m.startswith("ckptd"):
        out["setup_s"] = stall[0]
        out["stall_per_step_s"] = sum(stall[1:]) / max(len(stall) - 1, 1)
        out["stall_p50_s"] = median(cks[1:])
        out["stall_max_s"] = max(cks[1:]) if len(cks) > 1 else None
        out["stall_per_ckpt_s"] = out["stall_p50_s"]
        out["fence_p50_s"] = median(tr.get("fence_wait_s", []))
        out["step_done_p50_s"] = median(tr.get("step_done_s", []))
        out["write_bytes"] = rec.get("daemon_write_bytes")
        out["side_hwm"] = rec.get("daemon_hwm")
        ds = tr.get("daemon_status", {})
        out["daemon_rss_anon"] = ds.get("RssAnon", rec.get("daemon_rss_anon"))
        out["daemon_rss_shmem"] = ds.get("RssShmem", rec.get("daemon_rss_shmem"))
        out["layers"] = tr.get("layers")
        met = rec.get("metrics", {})
        out["versions"] = met.get("ckpt_versions_committed_total")
        out["skipped_layers"] = met.get("ckpt_snapshots_skipped_total")
        out["failed_layers"] = met.get("ckpt_versions_failed_total")
        out["committed_bytes"] = met.get("ckpt_committed_bytes_total")
        # One checkpoint: the layer data ckptd made durable per step.
        out["ckpt_bytes"] = (out["committed_bytes"] / S) if out["committed_bytes"] else None
    else:
        out["setup_s"] = None
        out["stall_per_step_s"] = sum(stall) / S
        out["stall_p50_s"] = median(cks)
        out["stall_max_s"] = max(cks) if cks else None
        out["stall_per_ckpt_s"] = out["stall_p50_s"]
        out["write_bytes"] = tr["write_bytes"]
        out["side_hwm"] = tr.get("side_hwm") or None
        out["ckpt_bytes"] = median(list(tr.get("ckpt_disk_bytes", {}).values()))
    out["bytes_per_step"] = out["write_bytes"] / S if out["write_bytes"] is not None else None
    out["final_drain_s"] = tr["final_drain_s"]
    # Durability: from the end of the step (ckptd) or the call's start.
    at = {int(k): v for k, v in tr.get("durable_at", {}).items()}
    ends = tr["step_end"]
    if m.startswith("ckptd"):
        lags = [at[s] - ends[s - 1] for s in range(2, S + 1) if s in at]
    else:
        starts = {int(k): v for k, v in tr.get("call_start", {}).items()}
        lags = [at[s] - starts[s] for s in starts if s in at]
    out["durable_lag_p50_s"] = median(lags)
    out["durable_lag_max_s"] = max(lags) if lags else None
    lost = []
    for f in range(1, S + 1):
        d = max([s for s, t in at.items() if t <= ends[f - 1]] or [0])
        lost.append(f - d)
    out["lost_steps"] = sum(lost) / S
    out["lost_seconds"] = out["lost_steps"] * out["step_p50_s"]
    rs = rec.get("restore", {})
    out["restore_s"] = rs.get("restore_s")
    out["restore_hwm"] = rs.get("vm_hwm")
    out["bitexact"] = rs.get("bitexact")
    out["mismatches"] = rs.get("mismatches", [])[:5]
    out["tensors"] = rs.get("tensors")
    if m.startswith("ckptd"):
        out["restored_step"] = rs.get("restored_step")
        out["daemon_restore_s"] = rs.get("daemon_restore_s")
        out["pool_bytes"] = rec.get("pool_bytes")
        out["max_staleness"] = rs.get("max_staleness")
    return out


def aggregate(records):
    """Per (size, method): the median of each figure over the repeats."""
    runs = {}
    base_hwm, base_step, base_cpu = {}, {}, {}
    spread = {}
    for r in records:
        if r["method"] == "none":
            t = r["train"]
            base_hwm.setdefault(r["size"], []).append(t["vm_hwm"])
            base_step.setdefault(r["size"], []).append(median(t["step_s"][1:]))
            if "cpu_s" in t:
                base_cpu.setdefault(r["size"], []).append(t["cpu_s"] / t["steps"])
    per_run = []
    for r in records:
        z = r["size"]
        s = summarize(r, {"hwm": median(base_hwm.get(z, [])), "step": median(base_step.get(z, [])),
                          "cpu": median(base_cpu.get(z, []))})
        per_run.append(s)
        runs.setdefault((r["size"], r["method"]), []).append(s)
        if r["method"] == "none":
            hw = base_hwm[r["size"]]
            spread[r["size"]] = (min(hw), max(hw), len(hw))
    summary = []
    for (size, m), rs in runs.items():
        row = {"size": size, "method": m, "repeats": len(rs)}
        for k in rs[0]:
            vals = [x.get(k) for x in rs]
            if k in ("size", "method", "repeat"):
                continue
            if all(isinstance(v, bool) for v in vals):
                row[k] = all(vals)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                row[k] = median(vals)
            else:
                row[k] = vals[0]
        if m == "none" and size in spread:
            row["hwm_min"], row["hwm_max"], row["hwm_runs"] = spread[size]
        summary.append(row)
    order = {m: i for i, m in enumerate(METHODS)}
    sizes = list(dict.fromkeys(r["size"] for r in records))
    summary.sort(key=lambda r: (sizes.index(r["size"]), order.get(r["method"], 99)))
    return per_run, summary


def ratios(summary):
    """ckptd's stall per step over DCP async_save's stall per checkpoint."""
    out = []
    by = {(r["size"], r["method"]): r for r in summary}
    for size in dict.fromkeys(r["size"] for r in summary):
        for c in ("ckptd_all", "ckptd_layercheck"):
            for d in ("dcp_async_thread", "dcp_async_process"):
                a, b = by.get((size, c)), by.get((size, d))
                if a and b and a.get("stall_per_step_s") is not None and b.get("stall_per_ckpt_s"):
                    out.append({"size": size, "ckptd": c, "dcp": d,
                                "ckptd_stall_per_step_s": a["stall_per_step_s"],
                                "ckptd_stall_p50_s": a["stall_p50_s"],
                                "dcp_stall_per_ckpt_s": b["stall_per_ckpt_s"],
                                "dcp_stall_per_step_s": b["stall_per_step_s"],
                                "ratio_per_ckpt": a["stall_per_step_s"] / b["stall_per_ckpt_s"],
                                "ratio_per_step": a["stall_per_step_s"] / b["stall_per_step_s"]})
    return out


# ---------------------------------------------------------------- report

def tables(doc):
    summary, meta = doc["summary"], doc["meta"]
    lines = []
    sizes = list(dict.fromkeys(r["size"] for r in summary))
    for size in sizes:
        rows = [r for r in summary if r["size"] == size]
        r0 = rows[0]
        lines.append("### %s: %.1fM parameters, %s of weights and AdamW state, %d steps, "
                     "checkpoint every %d steps (ckptd: every step)\n" % (
                         size, r0["params"] / 1e6, human_bytes(r0["state_bytes"]), r0["steps"],
                         r0["every"]))
        psi = [r["cpu_pressure"] for r in rows if r.get("cpu_pressure") is not None]
        if psi:
            lines.append("CPU pressure while these ran (share of the time some task waited for "
                         "a CPU, /proc/pressure/cpu): %.0f %% to %.0f %%.\n" % (
                             100 * min(psi), 100 * max(psi)))
        lines.append("| method | stall / step | stall / checkpoint (p50, max) | step time (p50, "
                     "vs none) | CPU / step (vs none) | bytes written / step | one checkpoint on "
                     "disk | durable after (p50) | expected steps lost | restore | bit-exact | "
                     "peak extra memory (trainer; side process) |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :-: "
                     "| ---: |")
        for r in rows:
            m = r["method"]
            if m == "none":
                hw = "VmHWM %s" % human_bytes(r["vm_hwm"])
                if r.get("hwm_runs", 1) > 1:
                    hw = "VmHWM %s to %s in %d runs" % (human_bytes(r["hwm_min"]),
                                                       human_bytes(r["hwm_max"]), r["hwm_runs"])
                lines.append("| %s | - | - | %s | %s | - | - | - | - | - | - | (%s) |" % (
                    LABELS[m], human_s(r["step_p50_s"]), human_s(r.get("cpu_per_step_s")), hw))
                continue
            stall_ck = "%s, %s" % (human_s(r["stall_p50_s"]), human_s(r["stall_max_s"]))
            if r.get("setup_s") is not None:
                stall_ck += " (setup %s)" % human_s(r["setup_s"])
            lost = "%.2f" % r["lost_steps"]
            if m == "torch_save":
                lost += " ¹"
            durable = human_s(r["durable_lag_p50_s"]) + (" ¹" if m == "torch_save" else "")
            one = human_bytes(r["ckpt_bytes"]) if not m.startswith("ckptd") else \
                "%s / step" % human_bytes(r["ckpt_bytes"])
            side = human_bytes(r.get("side_hwm")) if r.get("side_hwm") else "-"
            cpu = "-"
            if r.get("cpu_per_step_s") is not None:
                cpu = human_s(r["cpu_per_step_s"])
                if r.get("cpu_extra_per_step_s") is not None:
                    cpu += " (%s%s)" % ("+" if r["cpu_extra_per_step_s"] >= 0 else "−",
                                        human_s(abs(r["cpu_extra_per_step_s"])))
            lines.append("| %s | %s | %s | %s (%.2fx) | %s | %s | %s | %s | %s | %s | %s | %s; %s |"
                         % (
                LABELS[m], human_s(r["stall_per_step_s"]), stall_ck, human_s(r["step_p50_s"]),
                r["step_ratio"] or float("nan"), cpu, human_bytes(r["bytes_per_step"]), one, durable,
                lost, human_s(r["restore_s"]), "yes" if r["bitexact"] else "**no**",
                human_bytes(r["hwm_extra"]), side))
        extra = [r for r in rows if r["method"].startswith("ckptd")]
        if extra:
            lines.append("")
            for r in extra:
                lines.append("- %s: fence wait p50 %s, StepDone p50 %s; %s layer versions "
                             "written (%s layers, %d steps), %s layer snapshots skipped (staging "
                             "full), %s failed; staging pool %s; the daemon's resident memory "
                             "after the last step: %s anonymous (the pool, RocksDB) + %s of the "
                             "trainer's tensors, mapped shared; restored step %s (max staleness %s), %s of "
                             "the restore inside ckptd." % (
                                 LABELS[r["method"]], human_s(r.get("fence_p50_s")),
                                 human_s(r.get("step_done_p50_s")), fmt_n(r.get("versions")),
                                 fmt_n(r.get("layers")), r["steps"], fmt_n(r.get("skipped_layers")),
                                 fmt_n(r.get("failed_layers")), human_bytes(r.get("pool_bytes")),
                                 human_bytes(r.get("daemon_rss_anon")),
                                 human_bytes(r.get("daemon_rss_shmem")),
                                 fmt_n(r.get("restored_step")), fmt_n(r.get("max_staleness")),
                                 human_s(r.get("daemon_restore_s"))))
        lines.append("")
    rt = doc.get("ratios", [])
    if rt:
        lines.append("### ckptd's stall per step against DCP async_save's stall per checkpoint\n")
        lines.append("| size | ckptd | DCP | ckptd stall / step | DCP stall / checkpoint | ratio | "
                     "DCP stall / step (amortized) | ratio per step |")
        lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rt:
            lines.append("| %s | %s | %s | %s | %s | **%.4f** | %s | %.2f |" % (
                r["size"], LABELS[r["ckptd"]], LABELS[r["dcp"]],
                human_s(r["ckptd_stall_per_step_s"]), human_s(r["dcp_stall_per_ckpt_s"]),
                r["ratio_per_ckpt"], human_s(r["dcp_stall_per_step_s"]), r["ratio_per_step"]))
        lines.append("")
    return "\n".join(lines)


def plots(doc, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(outdir, exist_ok=True)
    summary = doc["summary"]
    sizes = list(dict.fromkeys(r["size"] for r in summary))
    methods = [m for m in METHODS if m != "none" and any(r["method"] == m for r in summary)]
    by = {(r["size"], r["method"]): r for r in summary}
    colors = plt.get_cmap("tab10")
    written = []

    if not methods:
        return written

    def bars(key, ylabel, title, name, scale=1.0, log=True):
        fig, ax = plt.subplots(figsize=(8.6, 3.2), dpi=90)
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = [(by.get((s, m), {}).get(key) or 0) * scale for s in sizes]
            ax.bar([j + (i - (len(methods) - 1) / 2) * w for j in range(len(sizes))], ys, w,
                   label=LABELS[m], color=colors(i))
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels(["%.1fM parameters" % (by[(s, methods[0])]["params"] / 1e6)
                            if (s, methods[0]) in by else s for s in sizes])
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        p = os.path.join(outdir, name)
        fig.savefig(p)
        plt.close(fig)
        written.append(p)

    bars("stall_per_step_s", "seconds per step (log)",
         "Trainer-visible checkpoint stall per training step (amortized)", "compare_stall.png")
    bars("bytes_per_step", "bytes per step (log)", "Bytes written per training step (measured)",
         "compare_bytes.png")
    bars("restore_s", "seconds (log)", "Restore into a new process (page cache dropped)",
         "compare_restore.png")

    # Steps at risk after each step, for the largest size: f - D(f), the
    # quantity the expected loss averages.
    size = sizes[-1]
    fig, ax = plt.subplots(figsize=(8.6, 3.2), dpi=90)
    for i, m in enumerate(methods):
        rec = next((r for r in doc["records"] if r["size"] == size and r["method"] == m), None)
        if rec is None:
            continue
        tr = rec["train"]
        at = {int(k): v for k, v in tr.get("durable_at", {}).items()}
        ends = tr["step_end"]
        risk = [f - max([s for s, t in at.items() if t <= ends[f - 1]] or [0])
                for f in range(1, len(ends) + 1)]
        off = (i - (len(methods) - 1) / 2) * 0.06  # keeps equal lines apart
        ax.step(range(1, len(ends) + 1), [x + off for x in risk], where="mid", label=LABELS[m],
                color=colors(i), lw=1.4, alpha=0.85)
    ax.set_xlabel("failure after step f")
    ax.set_ylabel("steps lost: f - newest durable")
    ax.set_title("%s: work lost by a failure after each step (one run each; lines offset "
                 "slightly)" % size, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    p = os.path.join(outdir, "compare_durable.png")
    fig.savefig(p)
    plt.close(fig)
    written.append(p)
    return written


def report(doc, out, plots_dir):
    md = tables(doc)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no matplotlib: no plots")
        return
    for p in plots(doc, plots_dir):
        print("plot:", p)


# ---------------------------------------------------------------- main

def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,100M,200M")
    ap.add_argument("--steps", default=None, help="steps per size, comma-separated")
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeats", default="2,1,1", help="repeats per size, comma-separated")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--data-dir", default=os.environ.get("CKPT_TEST_TMP") or "/var/tmp")
    ap.add_argument("--build-dir", default=os.environ.get("CKPT_BUILD_DIR") or
                    os.path.join(TOP, "build"))
    ap.add_argument("--plots-dir", default=None, help="default: OUT")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--poll-ms", type=float, default=10.0)
    ap.add_argument("--pool-mib", type=int, default=0,
                    help="ckptd's staging pool (0: one step of the model's state, +5%%)")
    ap.add_argument("--admission-ms", type=int, default=600000,
                    help="ckptd admission_timeout_ms (its default, 2000, skips layers when "
                    "the staging pool stays full)")
    ap.add_argument("--timeout", type=int, default=1200, help="per process, seconds")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--report-only", default=None, metavar="RESULTS_JSON")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_restorer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_watch", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.steps, args.repeats = "10M", "10", "1"
    if args.smoke:
        args.sizes, args.steps, args.repeats, args.every = "tiny", "6", "1", 3
        args.poll_ms, args.threads = 5.0, 1
    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            ap.error("unknown size %s (one of %s)" % (s, ", ".join(SIZES)))
    args.size_list = sizes
    steps = [int(x) for x in args.steps.split(",")] if args.steps else \
        [DEFAULT_STEPS[s] for s in sizes]
    reps = [int(x) for x in args.repeats.split(",")]
    if len(steps) == 1:
        steps *= len(sizes)
    reps = (reps + [reps[-1]] * len(sizes))[:len(sizes)]
    if len(steps) != len(sizes):
        ap.error("--steps needs one number per size")
    args.step_list, args.rep_list = steps, reps
    args.method_list = args.methods.split(",")
    for m in args.method_list:
        if m not in METHODS:
            ap.error("unknown method %s" % m)
    for s, n in zip(sizes, steps):
        if n < 2 * args.every or n % args.every:
            ap.error("steps (%d for %s) must be a multiple of --every (%d), at least twice it"
                     % (n, s, args.every))
    args.build_dir = os.path.abspath(args.build_dir)
    return args


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


def smoke_checks(doc):
    by = {r["method"]: r for r in doc["summary"]}
    for m in METHODS:
        check(m in by, "%s ran" % m)
    for m in METHODS[1:]:
        r = by[m]
        check(r["bitexact"] is True and r["tensors"] > 0,
              "%s: restore is bit-exact (%s tensors)" % (m, r["tensors"]))
        check(r["write_bytes"] > 0, "%s: %d bytes written" % (m, r["write_bytes"]))
        check(r["restore_s"] > 0, "%s: restore timed" % m)
        check(r["lost_steps"] >= 0 and r["durable_lag_p50_s"] is not None,
              "%s: durability measured, %.2f steps lost on average" % (m, r["lost_steps"]))
    for m in ("ckptd_all", "ckptd_layercheck"):
        rec = next(r for r in doc["records"] if r["method"] == m)
        S = rec["train"]["steps"]
        check(len(rec["train"]["ckpt_stall_s"]) == S and
              all(0 < x < 60 for x in rec["train"]["stall_s"]),
              "%s: the stall of each of the %d steps is measured" % (m, S))
        check(by[m]["restored_step"] == S and by[m]["max_staleness"] == 0,
              "%s: restored step %d, every layer of that step" % (m, S))
        check(len(rec["train"]["durable_at"]) == S, "%s: every step became durable" % m)
    state = by["ckptd_all"]["state_bytes"]
    check(by["ckptd_all"]["write_bytes"] >= state * by["ckptd_all"]["steps"],
          "ckptd all wrote at least the state at every step")
    for m in ("torch_save", "dcp_save"):
        check(by[m]["ckpt_bytes"] >= state, "%s: a checkpoint holds the whole state" % m)
    check(len(doc["ratios"]) == 4, "the stall ratios against async_save are computed")


def main():
    args = parse()
    if args._worker or args._restorer or args._watch:
        path = args._worker or args._restorer or args._watch
        with open(path) as f:
            spec = json.load(f)
        (worker if args._worker else restorer if args._restorer else watcher)(spec)
        return
    if args.report_only:
        with open(args.report_only) as f:
            doc = json.load(f)
        # The figures are computed again from the raw records.
        doc["per_run"], doc["summary"] = aggregate(doc["records"])
        doc["ratios"] = ratios(doc["summary"])
        out = args.out or os.path.dirname(os.path.abspath(args.report_only))
        report(doc, out, args.plots_dir or out)
        return

    os.environ["CKPT_BUILD_DIR"] = args.build_dir
    sys.path.insert(0, os.path.join(HERE, "..", "integration"))
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    import harness
    if args.smoke:
        import importlib
        for name in ("torch", "torch.distributed.checkpoint", "ckpt", "ckpt.torch"):
            try:
                importlib.import_module(name)
            except ImportError as e:
                print("skipping: %s" % e)
                sys.exit(77)
    if not os.path.exists(harness.CKPTD):
        print("skipping: no ckptd at %s (build it, or pass --build-dir)" % harness.CKPTD)
        sys.exit(77)
    out = args.out or tempfile.mkdtemp(prefix="ckpt-compare-out-", dir=args.data_dir)
    os.makedirs(out, exist_ok=True)
    base = tempfile.mkdtemp(prefix="ckpt-compare-", dir=args.data_dir)
    t_start = time.time()
    doc = {"meta": {"argv": sys.argv, "machine": harness.machine(HERE), "every": args.every, "lr": args.lr,
                    "admission_ms": args.admission_ms,
                    "tokens": args.tokens, "threads": args.threads, "poll_ms": args.poll_ms,
                    "pool_mib": args.pool_mib, "data_dir": args.data_dir,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S")},
           "records": []}
    try:
        import torch
        doc["meta"]["torch"] = torch.__version__
        git = subprocess.run(["git", "-C", TOP, "rev-parse", "HEAD"], capture_output=True,
                             text=True)
        doc["meta"]["git_head"] = git.stdout.strip() or None
        doc["meta"]["ckptd"] = {"path": harness.CKPTD,
                                "mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(
                                    os.path.getmtime(harness.CKPTD)))}
        for size, steps, reps in zip(args.size_list, args.step_list, args.rep_list):
            # The baseline runs first and last of each size; the others
            # `reps` times each, their order rotated between repeats.
            others = [m for m in args.method_list if m != "none"]
            order = [("none", 0)] if "none" in args.method_list else []
            for rep in range(reps):
                k = rep % max(len(others), 1)
                order += [(m, rep) for m in others[k:] + others[:k]]
            if "none" in args.method_list and not args.smoke:
                order.append(("none", 1))
            for m, rep in order:
                t0 = time.time()
                try:
                    rec = one_method(args, harness, size, steps, m, rep, base)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    if args.smoke:
                        raise
                    print("FAILED: %s" % e, flush=True)
                    doc.setdefault("failures", []).append(
                        {"size": size, "method": m, "repeat": rep, "error": str(e)[-3000:]})
                    continue
                doc["records"].append(rec)
                print("%-5s %-18s repeat %d: %.1f s" % (size, m, rep, time.time() - t0),
                      flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc["meta"]["wall_s"] = time.time() - t_start
    doc["meta"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    doc["per_run"], doc["summary"] = aggregate(doc["records"])
    doc["ratios"] = ratios(doc["summary"])
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("results:", os.path.join(out, "results.json"), "(%.0f s)" % doc["meta"]["wall_s"])
    report(doc, out, args.plots_dir or out)
    if args.smoke:
        smoke_checks(doc)
        print("compare_torch smoke: OK")
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
