#!/usr/bin/env python3
"""ckpt.torch on a GPU: the checks and figures of the PyTorch 2.x work that
need a CUDA device. tests/gpu/run_on_gpu.sh runs each part as a step of its
own (`--part NAME`, under its own timeout); without --part every part runs.

    PYTHONPATH=<bundle>/python python3 tests/gpu/torch_gpu_check.py --build-dir <bundle> \
        [--part exact|gpt2|ddp|sandbox ...] [--budget-s SECONDS]

Parts:
  exact    bit-exact SIGKILL/restore: a small GPT on the device, AdamW, policy
           `all`, deterministic settings (torch.use_deterministic_algorithms,
           CUBLAS_WORKSPACE_CONFIG=:4096:8, the math attention kernel),
           SIGKILLed after step 12 and restored in a new process into its
           live tensors: the losses after the restore and the final weights
           must equal a failure-free run's bit for bit. On CUDA twice: with
           the default caching allocator, and with
           PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (pages handed
           over as descriptors), where a bit-exact restore is expected and
           the one refusal accepted is the one for a PyTorch whose pages
           allow no export (2.4, or TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0),
           naming the tensor; the line says which. With --socket the trainers use that ckptd instead of one
           of their own, default allocator only (tests/gpu/sandbox_check.sh
           runs this part so, as another uid). --quick: a tiny GPT.
  gpt2     a GPT-2-small-sized model built here (12 blocks, width 768,
           vocabulary 50,257, context 256: 123.85M parameters), bf16
           autocast, AdamW (fused on CUDA), at most 60 steps in each of four
           modes in one run: no checkpointing, ckptd `all`, ckptd
           `layercheck` and DCP async_save every 10 steps (with the pinned
           shared-memory stager and the process executor where this torch
           has them); step time against no checkpointing, the
           trainer-visible stall per step (fence wait and StepDone,
           run.stats()), and ckptd's device-to-host rate against a pinned
           copy measured in the same run. The modes share --budget-s: each
           stops early (after at least 10 steps) when its share is spent,
           and says how many steps it made.
  ddp      two DDP ranks on the one device (gloo), started with
           torch.multiprocessing, one ckptd, policy `all`: a failure-free
           run, a run SIGKILLed at step 10, and a restart that restores the
           step both ranks agree on; every rank's tensors then equal the
           failure-free run's bit for bit, and each layer has one writer.
  sandbox  tests/gpu/sandbox_check.sh: ckptd under the sandbox of
           deploy/systemd/ckptd.service, a trainer of another uid (this
           script's part exact); exit 77 from it (nothing possible here) is a
           skip.

Disk: each part's ckptd keeps one checkpoint event (--keep_last_events=1,
GC every second) and a job's data is deleted when its mode ends; DCP keeps
its newest finished checkpoint only; everything is under one temporary
directory, removed at the end.

Prints FIGURES lines (details) and SUMMARY lines (what run_on_gpu.sh puts in
its summary). Exit 0 when every part run passed, 1 otherwise, 2 without the
device asked for. A missed performance goal is reported, not failed.
`--device cpu --quick` runs every part on the CPU with tiny models (the
ctest python.gpu_check_on_cpu): it proves the logic, not the figures.
"""

import os

# cuBLAS reads it when its first handle is made: before any CUDA work.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

PROCESS_START = time.monotonic()  # --budget-s counts from here

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


# ---- a GPT in plain torch (no transformers on the GPU machine) ----

class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)
        self.heads = heads
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, blocks, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


SMALL = dict(vocab=512, context=64, width=128, blocks=4, heads=4)
GPT2_SMALL = dict(vocab=50257, context=256, width=768, blocks=12, heads=12)
TINY = dict(vocab=128, context=32, width=32, blocks=2, heads=2)


def batch(step, cfg, device, size, seq, salt=0):
    g = torch.Generator().manual_seed(1000 + step + 100000 * salt)
    idx = torch.randint(0, cfg["vocab"], (size, seq + 1), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def weights_hash(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def tensors_hash(run):
    """Every tensor the rank registered, bit for bit (names included)."""
    h = hashlib.sha256()
    for _, ts in sorted(run.tensors().items()):
        for name, t in ts:
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


# ---- deterministic settings ----

def deterministic():
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def math_attention():
    """The math kernel of scaled_dot_product_attention: deterministic on
    every device (the fused kernels' backward passes need not be)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # torch < 2.3
        if torch.cuda.is_available():
            return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False,
                                                  enable_math=True)
        return contextlib.nullcontext()


def exact_loss(logits, y):
    """Cross entropy through log_softmax and gather: NLLLoss on CUDA has no
    deterministic kernel, gather's backward has."""
    logp = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)
    return -logp.gather(1, y.reshape(-1, 1)).mean()


# ---- ckptd ----

class Daemon:
    """A ckptd of this script's own (`socket` None), or the one at `socket`."""

    def __init__(self, build, root, pool_bytes, extra=(), socket=None):
        self.root = root
        self.proc = None
        self.metrics = None
        self.ctl_cmd = [os.path.join(build, "tools", "ckptctl")]
        if socket:
            self.socket = socket
            self.ctl_cmd.append("--socket=" + socket)
            return
        self.socket = os.path.join(root, "ckptd.sock")
        os.makedirs(root, exist_ok=True)
        self.log = open(os.path.join(root, "ckptd.log"), "a")
        self.proc = subprocess.Popen(
            [os.path.join(build, "daemon", "ckptd"), "--socket=" + self.socket,
             "--data_dir=" + os.path.join(root, "data"), "--staging_pool_bytes=%d" % pool_bytes,
             "--metrics_address=127.0.0.1:0", "--lock_staging_memory=false",
             # The check is the node's only tenant: expandable segments
             # exported as fabric handles (where the page allows no POSIX
             # descriptor) are taken too (docs/protocol.md).
             "--gpu_fabric_handles=true",
             "--keep_last_events=1", "--keep_every_steps=0", "--gc_interval_s=1"] + list(extra),
            stdout=self.log, stderr=self.log)
        deadline = time.time() + 60
        while not harness.socket_accepts(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("ckptd did not start; see " + self.log.name)
            time.sleep(0.05)
        self.ctl_cmd.append("--socket=" + self.socket)
        status = json.loads(subprocess.check_output(self.ctl_cmd + ["--json", "status"]))
        self.metrics = status["metrics_address"]

    def metric(self, name, labels=""):
        if not self.metrics:
            return 0.0
        return harness.metric(self.metrics, name, labels) or 0.0

    def delete(self, job):
        """Frees the job's disk once its ranks are gone."""
        subprocess.run(self.ctl_cmd + ["delete", job], capture_output=True, timeout=60)

    def stop(self):
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        if self.root:
            # The data directory goes with the part.
            shutil.rmtree(os.path.join(self.root, "data"), ignore_errors=True)


# ---- part exact: bit-exact SIGKILL / restore ----

def worker(a):
    """One trainer process of part exact; exit 3 after a refused registration
    (its message in the log)."""
    import ckpt
    from ckpt import torch as ckpt_torch
    deterministic()
    device = torch.device(a.device)
    cfg = TINY if a.quick else SMALL
    torch.manual_seed(7)
    model = GPT(**cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    run = None
    step = 0
    log = open(a.log, "a")
    if a.socket:
        run = ckpt_torch.attach(model, opt, ckpt.Client(a.socket, wait_timeout_s=120),
                                job_id=a.job, policy="all")
    try:
        if run is not None and a.restore:
            step = run.restore().target_step
            log.write(json.dumps({"restored": step}) + "\n")
        while step < a.steps:
            x, y = batch(step, cfg, device, 8, cfg["context"])
            with math_attention():
                loss = exact_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # the first one registers the rank
            step += 1
            log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            log.flush()
            if step == a.kill_at:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 - a refusal is an outcome this part reports
        if run is None or run.registered:
            raise
        prefixes = sorted({n.split(".")[0] for n, _ in model.named_parameters()})
        log.write(json.dumps({"refused": type(e).__name__, "message": str(e),
                              "modules": prefixes, "torch": torch.__version__}) + "\n")
        log.close()
        return 3
    log.write(json.dumps({"final": weights_hash(model)}) + "\n")
    if run:
        run.wait_durable()
        run.close()
    return 0


def spawn(args, env=None):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, err


# What the client says when a tensor lives in expandable segments whose
# pages allow no export to another process (client/src/gpu_export.cc).
REFUSAL = re.compile(r"tensor '(?P<name>[^']+)' lives in PyTorch expandable segments "
                     r"\(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\) whose pages allow no "
                     r"export")


def classify_refusal(row):
    """(True, tensor name) when `row` is the refusal of an expandable-segment
    tensor that names one of the model's tensors, else (False, why)."""
    msg = row.get("message", "")
    m = REFUSAL.search(msg)
    if not m:
        return False, "another error: %s: %s" % (row.get("refused"), msg[:300])
    name = m.group("name")
    if "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC" not in msg:
        return False, "the refusal does not say what to set: " + msg[:300]
    if name.split(".")[0] not in row.get("modules", []):
        return False, "the refusal names '%s', not a tensor of the model" % name
    return True, name


def bit_exact(daemon, root, device, alloc_conf, quick):
    """One case of part exact; returns (ok, summary line)."""
    name = "expandable_segments" if alloc_conf else "default allocator"
    tag = "expandable" if alloc_conf else "default"
    env = dict(os.environ)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    steps, kill_at = 30, 12
    ref = os.path.join(root, tag + "-ref.jsonl")
    log = os.path.join(root, tag + ".jsonl")
    job = "exact-%s-%d" % (tag, os.getpid())
    model = ["--quick"] if quick else []
    common = ["--device", device, "--log", log, "--steps", str(steps), "--socket",
              daemon.socket, "--job", job] + model
    # The failure-free run and the run that is killed, side by side.
    ref_p = spawn(["--device", device, "--log", ref, "--steps", str(steps)] + model, env)
    rc, err = finish(spawn(common + ["--kill-at", str(kill_at)], env))
    if rc == 3:
        ref_p.kill()
        ref_p.wait()
        row = [r for r in harness.read_jsonl(log) if "refused" in r][-1]
        accepted, what = classify_refusal(row)
        if alloc_conf and accepted:
            return True, ("%s: REFUSED at registration naming tensor '%s' (accepted: this "
                          "PyTorch's pages allow no export; torch %s)"
                          % (name, what, row.get("torch", "?")))
        return False, "%s: FAIL: the registration was refused: %s" % (name, what)
    if rc != -signal.SIGKILL:
        ref_p.kill()
        ref_p.wait()
        why = (err.strip().splitlines() or ["?"])[-1]
        return False, "%s: FAIL: the trainer exited %d before its SIGKILL: %s" % (name, rc, why)
    rc_restore, err_restore = finish(spawn(common + ["--restore"], env))
    rc_ref, err_ref = finish(ref_p)
    if rc_ref != 0 or rc_restore != 0:
        why = ((err_restore if rc_restore else err_ref).strip().splitlines() or ["?"])[-1]
        return False, ("%s: FAIL: the %s run exited %d: %s"
                       % (name, "restore" if rc_restore else "failure-free",
                          rc_restore or rc_ref, why))
    ref_rows, rows = harness.read_jsonl(ref), harness.read_jsonl(log)
    ref_loss = {r["step"]: r["loss"] for r in ref_rows if "step" in r}
    at = [i for i, r in enumerate(rows) if "restored" in r][0]
    restored = rows[at]["restored"]
    after = [r for r in rows[at:] if "step" in r]
    same_loss = bool(after) and all(r["loss"] == ref_loss[r["step"]] for r in after)
    same_final = rows[-1].get("final") is not None and rows[-1].get("final") == \
        ref_rows[-1].get("final")
    print("FIGURES bit_exact %s: killed after step %d, restored step %d into the live %s "
          "tensors; %d losses after it equal the failure-free run: %s; final weights equal: %s"
          % (tag, kill_at, restored, device, len(after), same_loss, same_final))
    if daemon.proc is not None:
        daemon.delete(job)  # an external ckptd's owner lists the job afterwards
    if same_loss and same_final:
        return True, ("%s: BIT-EXACT (killed after step %d, restored step %d, %d later losses "
                      "and the final weights equal the failure-free run's)"
                      % (name, kill_at, restored, len(after)))
    return False, ("%s: FAIL: restored step %d, later losses equal: %s, final weights equal: %s"
                   % (name, restored, same_loss, same_final))


def self_check_refusal():
    """The classifier on the client's refusal of pages that allow no export
    (part exact on the CPU cannot make an expandable segment)."""
    msg = ("INVALID_ARGUMENT: tensor 'h.0.attn.weight' lives in PyTorch expandable segments "
           "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) whose pages allow no export to "
           "another process. PyTorch 2.10 and newer: leave TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC "
           "unset or 1, set before the first CUDA allocation; PyTorch 2.4 cannot export them "
           "(upgrade, or turn expandable_segments off)")
    good = classify_refusal({"message": msg, "modules": ["h", "wte"]})
    other = classify_refusal({"message": msg.replace("h.0", "q.0"), "modules": ["h", "wte"]})
    wrong = classify_refusal({"message": "INVALID_ARGUMENT: something else", "modules": ["h"]})
    assert good == (True, "h.0.attn.weight") and not other[0] and not wrong[0], (good, other,
                                                                                 wrong)


def part_exact(a, root, device):
    daemon = Daemon(a.build_dir, os.path.join(root, "ckptd-exact"), pool_bytes=256 * MiB,
                    socket=a.socket)
    results = []
    try:
        results.append(bit_exact(daemon, root, a.device, None, a.quick))
        if device.type == "cuda" and not a.socket:
            results.append(bit_exact(daemon, root, a.device, "expandable_segments:True",
                                     a.quick))
        else:
            self_check_refusal()
            results.append((True, "expandable_segments: not run on %s (the refusal check "
                                  "classified a sample message right)" % device.type))
    finally:
        daemon.stop()
    for _, line in results:
        print("SUMMARY exact %s" % line)
    return all(ok for ok, _ in results)


# ---- part gpt2: a GPT-2-small-sized loop ----

def pinned_peak(device, nbytes):
    """Bytes/s of a device-to-host copy into pinned memory (best of 3), the
    cudaMemcpyAsync that torch issues for a non-blocking copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = 0.0
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0))
    del src, dst
    return best


class DcpSaver:
    """DCP async_save every `every` steps, as well as this torch offers:
    the pinned shared-memory stager (DefaultStager, StagingOptions) and the
    process executor (AsyncCheckpointerType.PROCESS), each checked for, else
    the default async_save (said in `how`). Keeps the newest finished
    checkpoint only."""

    def __init__(self, root, device):
        import torch.distributed as dist
        from torch.distributed.checkpoint import state_dict_saver as sds
        self.root = os.path.join(root, "dcp")
        os.makedirs(self.root, exist_ok=True)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # A one-process gloo group: the process executor needs one.
        dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "dcp-pg"),
                                rank=0, world_size=1)
        params = inspect.signature(sds.async_save).parameters
        self.kwargs = {}
        how = []
        kind = getattr(sds, "AsyncCheckpointerType", None)
        if kind is not None and hasattr(kind, "PROCESS") and "async_checkpointer_type" in params:
            self.kwargs["async_checkpointer_type"] = kind.PROCESS
            how.append("process executor")
        else:
            how.append("thread executor (this torch has no process executor)")
        self.stager = None
        try:
            from torch.distributed.checkpoint import staging
        except ImportError:
            staging = None
        if (staging is not None and hasattr(staging, "DefaultStager") and
                hasattr(staging, "StagingOptions") and "async_stager" in params):
            if device.type == "cuda":
                self.stager = staging.DefaultStager(staging.StagingOptions(
                    use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
                    use_non_blocking_copy=True))
                self.kwargs["async_stager"] = self.stager
                how.append("DefaultStager (pinned, shared memory, async staging)")
            else:
                how.append("the default stager (the pinned stager needs CUDA)")
        else:
            how.append("the default stager (this torch has no DefaultStager/StagingOptions)")
        self.how = ", ".join(how)
        self.staging = None  # a Future to wait for before the weights change
        self.upload = None   # (step, Future) of the checkpoint being written
        self.kept = None
        self.stalls = []

    def state(self, model, opt):
        try:
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(model, opt)
        except ImportError:
            msd, osd = model.state_dict(), opt.state_dict()
        return {"model": msd, "optim": osd}

    def path(self, step):
        return os.path.join(self.root, "step-%d" % step)

    def _finished(self, step):
        if self.kept is not None:
            shutil.rmtree(self.path(self.kept), ignore_errors=True)
        self.kept = step

    def before_step(self):
        """Before optimizer.step(): the stager must have read the weights."""
        if self.staging is not None:
            t0 = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.stalls[-1] += time.perf_counter() - t0

    def checkpoint(self, step, model, opt):
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        if self.upload is not None:
            prev, fut = self.upload
            fut.result()
            self._finished(prev)
        got = dcp.async_save(self.state(model, opt), checkpoint_id=self.path(step), **self.kwargs)
        if hasattr(got, "upload_completion"):  # AsyncSaveResponse
            self.staging, fut = got.staging_completion, got.upload_completion
        else:
            fut = got
        self.upload = (step, fut)
        self.stalls.append(time.perf_counter() - t0)

    def close(self):
        import torch.distributed as dist
        if self.staging is not None:
            self.staging.result()
        if self.upload is not None:
            self.upload[1].result()
            self._finished(self.upload[0])
        if self.stager is not None and hasattr(self.stager, "close"):
            self.stager.close()  # its staging threads and pinned buffers
        harness.stop_dcp_process()
        dist.destroy_process_group()
        shutil.rmtree(self.root, ignore_errors=True)


def median_after(xs, skip):
    xs = list(xs)
    return statistics.median(xs[skip:] if len(xs) > skip + 1 else xs) if xs else 0.0


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else 0.0


def loop(mode, daemon, root, device, g, deadline):
    """One mode of part gpt2: at most g["steps"] steps, fewer (at least
    g["min_steps"]) when `deadline` (time.monotonic()) passes."""
    import ckpt
    from ckpt import torch as ckpt_torch
    cfg = g["cfg"]
    torch.manual_seed(1)
    model = GPT(**cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    run = saver = None
    job = "gpt2-%s-%d" % (mode, os.getpid())
    if mode in ("all", "layercheck"):
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket, wait_timeout_s=60),
                                job_id=job, policy=mode,
                                layercheck={"warmup": 20, "warmup_interval": 10})
        before = {m: daemon.metric(m) for m in ("ckpt_staged_bytes_total",
                                                  "ckpt_snapshot_copy_seconds_sum",
                                                  "ckpt_snapshots_skipped_total")}
    elif mode == "dcp":
        saver = DcpSaver(root, device)
    times = []
    for t in range(g["steps"]):
        if t >= g["min_steps"] and time.monotonic() > deadline:
            break
        x, y = batch(t, cfg, device, g["batch"], g["seq"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if saver is not None:
            saver.before_step()
        opt.step()
        if saver is not None and (t + 1) % g["every"] == 0:
            saver.checkpoint(t + 1, model, opt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"steps": len(times), "median_step_s": median_after(times, g["warmup"])}
    if run is not None:
        st = run.stats()
        stall = [f + s for f, s in zip(st.fence_wait_s, st.step_done_s)]
        out.update(stall_median_s=median_after(stall, g["warmup"]), stall_p95_s=p95(stall),
                   stall_mean_s=statistics.mean(stall) if stall else 0.0,
                   fence_median_s=median_after(st.fence_wait_s, g["warmup"]),
                   fence_max_s=max(st.fence_wait_s) if st.fence_wait_s else 0.0)
        try:
            out["durable_step"] = run.wait_durable()
        except ckpt.Error as e:  # the disk fell behind past the client's wait
            out["durable_step"] = "not within 60 s (%s)" % e.code
        # Staged bytes over the seconds ckptd spent copying them (its
        # snapshot copy histogram): the rate of its device-to-host copies.
        after = {m: daemon.metric(m) - v for m, v in before.items()}
        copy_s = after["ckpt_snapshot_copy_seconds_sum"]
        out["d2h_bytes"] = after["ckpt_staged_bytes_total"]
        out["d2h_bytes_per_s"] = out["d2h_bytes"] / copy_s if copy_s > 0 else 0.0
        out["skipped_layer_snapshots"] = int(after["ckpt_snapshots_skipped_total"])
        run.close(drain=False)
        daemon.delete(job)
    if saver is not None:
        out.update(checkpoints=len(saver.stalls), every=g["every"], how=saver.how,
                   stall_median_s=statistics.median(saver.stalls) if saver.stalls else 0.0,
                   stall_max_s=max(saver.stalls) if saver.stalls else 0.0,
                   stall_per_step_s=sum(saver.stalls) / max(1, len(times)))
        saver.close()
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def gpt2_lines(results, params, peak, g, device):
    base = results["none"]["median_step_s"]

    def vs(r):
        return "%+.2f %%" % (100.0 * (r["median_step_s"] / base - 1)) if base > 0 else "?"

    lines = ["gpt2: %.2f M parameters, bf16 autocast, %s AdamW, batch %d x %d tokens, at most "
             "%d steps per mode; pinned D2H copy peak %.2f GB/s (torch, %d MiB)"
             % (params / 1e6, "fused" if device.type == "cuda" else "for-loop", g["batch"],
                g["seq"], g["steps"], peak / 1e9, g["peak_bytes"] // MiB)]
    r = results["none"]
    lines.append("gpt2 none: %d steps, median step %.4f s" % (r["steps"], base))
    for mode in ("all", "layercheck"):
        r = results.get(mode)
        if r is None:
            continue
        lines.append("gpt2 %s: %d steps, median step %.4f s (%s vs none, goal <= 1 %%); "
                     "trainer-visible stall per step median %.5f s, p95 %.5f s (fence median "
                     "%.5f s, max %.4f s); ckptd D2H %.2f GB at %.2f GB/s = %.2f of the pinned "
                     "peak; %d layer snapshots skipped; durable step %s"
                     % (mode, r["steps"], r["median_step_s"], vs(r), r["stall_median_s"],
                        r["stall_p95_s"], r["fence_median_s"], r["fence_max_s"],
                        r["d2h_bytes"] / 1e9, r["d2h_bytes_per_s"] / 1e9,
                        r["d2h_bytes_per_s"] / peak if peak else 0.0,
                        r["skipped_layer_snapshots"], r["durable_step"]))
    r = results.get("dcp")
    if r is not None:
        lines.append("gpt2 dcp: %d steps, median step %.4f s (%s vs none); %d checkpoints every "
                     "%d steps, stall per checkpoint median %.4f s, max %.4f s, %.5f s per step; "
                     "async_save with %s"
                     % (r["steps"], r["median_step_s"], vs(r), r["checkpoints"], r["every"],
                        r["stall_median_s"], r["stall_max_s"], r["stall_per_step_s"], r["how"]))
    return lines


def part_gpt2(a, root, device):
    if a.quick:
        g = dict(cfg=TINY, steps=12, min_steps=4, batch=2, seq=16, every=4, warmup=2,
                 pool=256 * MiB, disk=1 * GiB, peak_bytes=1 * MiB)
    else:
        g = dict(cfg=GPT2_SMALL, steps=60, min_steps=10, batch=8, seq=256, every=10, warmup=5,
                 pool=4 * GiB, disk=16 * GiB, peak_bytes=1 * GiB)
    start = time.monotonic()
    end = PROCESS_START + (a.budget_s if a.budget_s > 0 else 1e9) - 10  # 10 s to tear down
    params = sum(p.numel() for p in GPT(**g["cfg"]).parameters())
    daemon = Daemon(a.build_dir, os.path.join(root, "ckptd-gpt2"), pool_bytes=g["pool"],
                    extra=["--max_disk_bytes=%d" % g["disk"]])
    results = {}
    try:
        peak = pinned_peak(device, g["peak_bytes"])
        modes = ["none", "all", "layercheck", "dcp"]
        for i, mode in enumerate(modes):
            now = time.monotonic()
            share = (end - now) / (len(modes) - i)
            results[mode] = loop(mode, daemon, root, device, g, now + share)
            print("FIGURES loop %s: %s" % (mode, json.dumps(results[mode])))
            sys.stdout.flush()
    finally:
        daemon.stop()
    for line in gpt2_lines(results, params, peak, g, device):
        print("SUMMARY " + line)
    print("FIGURES gpt2 part took %.1f s" % (time.monotonic() - start))
    return True


# ---- part ddp: two DDP ranks on the one device ----

DDP_WORLD, DDP_STEPS, DDP_KILL_AT = 2, 16, 10


def ddp_rank(rank, spec):
    """One DDP rank (torch.multiprocessing.Process target)."""
    import ckpt
    import torch.distributed as dist
    from ckpt import torch as ckpt_torch
    torch.set_num_threads(1)
    deterministic()
    dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=rank,
                            world_size=DDP_WORLD)
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    cfg = spec["cfg"]
    torch.manual_seed(7)  # the same initial weights on both ranks
    model = nn.parallel.DistributedDataParallel(
        GPT(**cfg).to(device), device_ids=[0] if device.type == "cuda" else None)
    model.register_comm_hook(None, harness.rank_order_mean)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(spec["socket"], wait_timeout_s=120),
                            job_id=spec["job"], rank=rank, world_size=DDP_WORLD, policy="all")
    log = open(spec["log"] % rank, "a")
    first = 1
    if spec["restore"]:
        r = run.restore()
        first = r.target_step + 1
        log.write(json.dumps({"restored": r.target_step, "hash": tensors_hash(run)}) + "\n")
        log.flush()
    for t in range(first, DDP_STEPS + 1):
        x, y = batch(t, cfg, device, 4, cfg["context"], salt=rank + 1)  # each rank its own batch
        opt.zero_grad()
        with math_attention():
            loss = exact_loss(model(x), y)
        loss.backward()
        opt.step()
        log.write(json.dumps({"step": t, "hash": tensors_hash(run)}) + "\n")
        log.flush()
        if t == spec["pause_at"]:
            open(os.path.join(spec["sync"], "reached-%d" % rank), "w").close()
            time.sleep(600)  # SIGKILLed here by the parent
    durable = run.wait_durable()
    log.write(json.dumps({"durable": durable, "owned": run.owned_layers,
                          "layers": run.layer_names}) + "\n")
    log.close()
    run.close()
    dist.destroy_process_group()


def ddp_phase(root, daemon, device, cfg, job, tag, restore=False, pause_at=0):
    """Both ranks of `job` through one phase; returns each rank's log rows."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    sync = os.path.join(root, "%s-%s-sync" % (job, tag))
    os.makedirs(sync, exist_ok=True)
    spec = dict(store=os.path.join(root, "%s-%s-store" % (job, tag)), device=str(device),
                cfg=cfg, socket=daemon.socket, job=job, restore=restore, pause_at=pause_at,
                sync=sync, log=os.path.join(root, "%s-rank%%d.jsonl" % job))
    procs = [ctx.Process(target=ddp_rank, args=(r, spec)) for r in range(DDP_WORLD)]
    for p in procs:
        p.start()
    try:
        deadline = time.time() + 240
        if pause_at:
            while len(os.listdir(sync)) < DDP_WORLD:
                if time.time() > deadline or any(p.exitcode is not None for p in procs):
                    raise AssertionError("ddp %s: the ranks did not both reach step %d (exit "
                                         "codes %s)" % (tag, pause_at, [p.exitcode for p in procs]))
                time.sleep(0.02)
            for p in procs:
                p.kill()
        for p in procs:
            p.join(timeout=max(1, deadline - time.time()))
        if not pause_at and any(p.exitcode != 0 for p in procs):
            raise AssertionError("ddp %s: rank exit codes %s" % (tag, [p.exitcode for p in procs]))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [harness.read_jsonl(spec["log"] % r) for r in range(DDP_WORLD)]


def part_ddp(a, root, device):
    cfg = TINY if a.quick else SMALL
    daemon = Daemon(a.build_dir, os.path.join(root, "ckptd-ddp"), pool_bytes=256 * MiB)
    tag = "%d" % os.getpid()
    try:
        ref = ddp_phase(root, daemon, device, cfg, "ddp-ref-" + tag, "ref")
        want = [{row["step"]: row["hash"] for row in rows if "step" in row} for rows in ref]
        done = [[row for row in rows if "durable" in row][-1] for rows in ref]
        ddp_phase(root, daemon, device, cfg, "ddp-run-" + tag, "kill", pause_at=DDP_KILL_AT)
        logs = ddp_phase(root, daemon, device, cfg, "ddp-run-" + tag, "restore", restore=True)
    finally:
        daemon.stop()
    restored = [[row for row in rows if "restored" in row][-1] for rows in logs]
    target = restored[0]["restored"]
    agreed = all(r["restored"] == target for r in restored) and 1 <= target <= DDP_KILL_AT
    exact_at = all(r["hash"] == want[i][target] for i, r in enumerate(restored))
    starts = [[j for j, row in enumerate(rows) if "restored" in row][-1] for rows in logs]
    later = [[row for row in rows[s:] if "step" in row] for rows, s in zip(logs, starts)]
    exact_later = all(later) and all(row["hash"] == want[i][row["step"]]
                                     for i, rows in enumerate(later) for row in rows)
    owned = sorted(layer for d in done for layer in d["owned"])
    one_writer = owned == sorted(done[0]["layers"]) and len(set(owned)) == len(owned)
    durable = all(d["durable"] == DDP_STEPS for d in done)
    ok = agreed and exact_at and exact_later and one_writer and durable
    print("FIGURES ddp: ranks %d on %s, gloo; restored step %s on both ranks (agreed: %s); "
          "tensors equal the failure-free run's at it: %s, at the %d later steps: %s; layers "
          "written by rank: %s; failure-free run durable to step %d: %s"
          % (DDP_WORLD, device, [r["restored"] for r in restored], agreed, exact_at,
             DDP_STEPS - target, exact_later, [d["owned"] for d in done], DDP_STEPS, durable))
    print("SUMMARY ddp: %s (2 ranks on one %s, gloo, SIGKILL after step %d: both restored step "
          "%d, bit-exact at it and at every later step: %s; each of %d layers written by one "
          "rank: %s)" % ("PASS" if ok else "FAIL", device.type, DDP_KILL_AT, target,
                         exact_at and exact_later, len(done[0]["layers"]), one_writer))
    return ok


# ---- part sandbox ----

def part_sandbox(a, root, device):
    script = os.path.join(HERE, "sandbox_check.sh")
    cmd = ["bash", script, "--device", device.type, "--build-dir", os.path.abspath(a.build_dir),
           "--python", sys.executable, "--logs", os.path.join(root, "sandbox-logs")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    sys.stdout.write(p.stdout)
    if p.returncode not in (0, 77):
        sys.stdout.write(p.stderr[-3000:])
        logs = os.path.join(root, "sandbox-logs")
        for name in sorted(os.listdir(logs) if os.path.isdir(logs) else []):
            with open(os.path.join(logs, name), errors="replace") as f:
                print("---- %s (tail) ----\n%s" % (name, f.read()[-3000:]))
    return p.returncode in (0, 77)


PARTS = {"exact": part_exact, "gpt2": part_gpt2, "ddp": part_ddp, "sandbox": part_sandbox}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--build-dir", default=os.environ.get("CKPT_BUILD_DIR", ".gpu-bundle"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny models and few steps (also "
                    "for --worker)")
    ap.add_argument("--part", action="append", choices=sorted(PARTS),
                    help="the parts to run (repeatable; default: all)")
    # run_on_gpu.sh gives each step's timeout in CKPT_STEP_LIMIT_S.
    step_limit = float(os.environ.get("CKPT_STEP_LIMIT_S") or 0)
    ap.add_argument("--budget-s", type=float, default=max(0.0, step_limit - 8),
                    help="seconds part gpt2 may take in all (default: the step's timeout "
                         "CKPT_STEP_LIMIT_S less 8; 0: no bound)")
    ap.add_argument("--socket", help="part exact: an external ckptd's socket")
    ap.add_argument("--job", default="job")
    ap.add_argument("--log")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--restore", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    a.build_dir = os.path.abspath(a.build_dir)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_gpu_check: no CUDA device")
        return 2
    parts = a.part or ["exact", "gpt2", "ddp", "sandbox"]
    print("torch_gpu_check: torch %s, %s, parts %s" % (
        torch.__version__, torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        ",".join(parts)))
    sys.stdout.flush()
    root = tempfile.mkdtemp(prefix="ckpt-torch-gpu-")
    ok = True
    try:
        for name in parts:
            t0 = time.monotonic()
            try:
                passed = PARTS[name](a, root, device)
            except Exception as e:  # noqa: BLE001 - one part's failure is reported, the rest run
                import traceback
                traceback.print_exc()
                print("SUMMARY %s: FAIL: %s: %s" % (name, type(e).__name__, str(e)[:500]))
                passed = False
            print("torch_gpu_check: part %s %s in %.1f s"
                  % (name, "passed" if passed else "FAILED", time.monotonic() - t0))
            sys.stdout.flush()
            ok &= passed
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("torch_gpu_check: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
