#!/usr/bin/env python3
"""Recovery-fidelity experiment for ckptd (docs/fidelity.md).

A small GPT-style byte-level language model is pretrained on the Python
standard library shipped with Debian, then fine-tuned on Debian's man pages
(a different domain) with AdamW and a warm-up/cosine LR schedule. Every
fine-tuning run uses the same seed and the same data order:

  1. failure-free, no ckptd (the reference; torch.save every N steps, timed);
  2. ckptd policy `all`, trainer SIGKILLed mid-run, a new process restores
     and continues: the loss trajectory must equal run 1 bit for bit;
  3. ckptd `layercheck` at several K0: a failure-free run with the drift
     trace, a run killed at the step of maximum size-weighted staleness (from
     that trace), and a run with three cascading failures;
  4. torch.save of the full state every step (timed, bytes counted).

Each trainer is a separate process (this script in --worker mode); the
orchestrator (this script) starts one fresh ckptd per run, reads the
trainers' JSON-lines logs and the drift traces, and writes report.md plus
PNG figures.

    tests/fidelity/run_fidelity.py [--quick] [--out DIR]

The full run writes docs/fidelity/ (the report docs/fidelity.md cites);
--quick writes fidelity-quick/ in the build directory (--build).

Standard library + torch + numpy + matplotlib (Debian: python3-matplotlib).
"""

import argparse
import dataclasses
import datetime
import glob
import gzip
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
PYTHON = sys.executable or "python3"

# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

FULL = dict(
    name="full",
    # model: ~10.1M parameters, 8 blocks
    d_model=320, n_layer=8, n_head=8, ctx=128, batch=4, dropout=0.1,
    # pretraining (plain torch, cached)
    pretrain_steps=200, pretrain_batch=8, pretrain_lr=1e-3, pretrain_warmup=20,
    pretrain_cap=16 << 20,
    # fine-tuning (steps: at most this many, fewer when the measured step time
    # says the runs would not fit budget_min; never fewer than min_steps)
    # lr: a usual full fine-tuning rate (1/100 of pretraining's). At 3e-4 the
    # per-step drift of these small matrices is ~30x larger (README "Figures").
    steps=200, min_steps=100, lr=1e-5, warmup=10, warmup_start=0.1, min_lr_frac=0.1,
    weight_decay=0.1, grad_clip=1.0, finetune_cap=8 << 20, eval_batches=16,
    save_every=10, kill_frac_all=0.55, cascade_fracs=(0.30, 0.55, 0.80),
    k0s=(1e-4, 1e-3, 1e-2), k0_embedding_factor=10.0, s_max=50,
    # LayerCheck runs use ckptd's warm-up defaults. These (warmup, interval)
    # variants run at K0 = 1e-3 as well, for what a warm-up changes; the
    # first is the pre-change default (200 steps, full every 50).
    warmup_variants=((200, 50),),
    # A write budget at K0 = 1e-3, as a fraction of the full state per step,
    # declared in bytes/s with the calibrated step time.
    budget_fracs=(0.05,),
    budget_min=50.0, seed=20261130,
)

QUICK = dict(
    FULL, name="quick",
    d_model=64, n_layer=8, n_head=4, ctx=64, batch=4, pretrain_batch=4,
    pretrain_steps=40, pretrain_lr=2e-3, pretrain_warmup=5, pretrain_cap=2 << 20,
    steps=40, min_steps=20, lr=3e-4, warmup=4, finetune_cap=1 << 20, eval_batches=4,
    save_every=5, s_max=15, budget_min=10.0,
)

JOB = "ft"
VOCAB = 256


def log(msg):
    sys.stdout.write("[%s] %s\n" % (time.strftime("%H:%M:%S"), msg))
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Corpora (cached as raw bytes)
# --------------------------------------------------------------------------

def write_corpus(path, cap, files, seed, chunk_of):
    """Writes chunk_of(f) for each of `files` in a fixed shuffled order (a
    None chunk skips the file) up to `cap` bytes to `path`, atomically;
    returns the number of files."""
    files = sorted(files)
    random.Random(seed).shuffle(files)
    out, n = [], 0
    for f in files:
        chunk = chunk_of(f)
        if chunk is None:
            continue
        out.append(chunk)
        n += len(chunk)
        if n >= cap:
            break
    data = b"".join(out)[:cap]
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(path + ".tmp", path)
    return len(files)


def build_pretrain_corpus(path, cap):
    """Python standard library sources shipped with Debian, up to `cap` bytes."""
    def chunk_of(f):
        try:
            with open(f, "rb") as fh:
                b = fh.read()
        except OSError:
            return None
        return b"\n# ---- " + os.path.relpath(f, "/usr/lib/python3.11").encode() + b"\n" + b
    return write_corpus(path, cap, glob.glob("/usr/lib/python3.11/**/*.py", recursive=True), 1,
                        chunk_of)


_ROFF_ESC = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\\(..|\\\[[^\]]*\]|\\[&|^%:,/]|\\s[+-]?\d+"
                       r"|\\\*(\(..|\[[^\]]*\]|.)|\\n(\(..|\[[^\]]*\]|.)|\\[ ~0]|\\c$")
_ROFF_TEXT_MACROS = {"B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB", "TP", "IP", "HP",
                     "Nm", "Nd", "Ar", "Fl", "Op", "It", "Pa", "Em", "Sy", "Dq", "Ql", "Xr", "Cm",
                     "Ev", "Va", "Fn", "Ic", "Li", "Dv", "Er", "Ft", "Fa", "Sq", "Pq", "UR", "MT"}


def strip_roff(text):
    """Rough roff-to-text: drop comments and layout requests, keep the text
    arguments of font and section macros, remove inline escapes."""
    out, blank = [], False
    for line in text.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"', ".\\}")):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if macro in ("SH", "SS", "Sh", "Ss"):
                line = "\n" + rest.replace('"', "")
            elif macro in _ROFF_TEXT_MACROS:
                line = rest.replace('"', "")
            elif macro in ("PP", "LP", "P", "sp", "br", "Pp"):
                line = ""
            else:
                continue
        line = line.replace("\\-", "-")
        line = _ROFF_ESC.sub("", line)
        line = line.replace("\\e", "\\").replace("\\\\", "\\")
        if not line.strip():
            if blank:
                continue
            blank = True
        else:
            blank = False
        out.append(line)
    return "\n".join(out)


def build_finetune_corpus(path, cap):
    """Debian's man pages (sections 1-8, English), roff stripped roughly."""
    def chunk_of(f):
        try:
            with gzip.open(f, "rb") as fh:
                raw = fh.read()
        except (OSError, EOFError):
            return None
        text = strip_roff(raw.decode("utf-8", errors="replace"))
        if len(text) < 200:
            return None  # .so redirections and stubs
        return ("\n==== %s\n" % os.path.basename(f)).encode() + text.encode("utf-8")
    files = []
    for s in range(1, 9):
        files += glob.glob("/usr/share/man/man%d/*.gz" % s)
    return write_corpus(path, cap, files, 2, chunk_of)


# --------------------------------------------------------------------------
# Model, data, schedule (worker side; torch is imported only in workers)
# --------------------------------------------------------------------------

def torch_setup():
    import torch
    torch.set_num_threads(2)
    return torch


def make_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, d, h, ctx, p):
            super().__init__()
            self.n_head = h
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.attn_drop = nn.Dropout(p)
            self.resid_drop = nn.Dropout(p)
            self.register_buffer("mask", torch.ones(ctx, ctx, dtype=torch.bool).triu(1),
                                 persistent=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=2)
            q = q.view(b, t, self.n_head, -1).transpose(1, 2)
            k = k.view(b, t, self.n_head, -1).transpose(1, 2)
            v = v.view(b, t, self.n_head, -1).transpose(1, 2)
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            a = a.masked_fill(self.mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = (self.attn_drop(a) @ v).transpose(1, 2).reshape(b, t, d)
            return self.resid_drop(self.proj(y))

    class MLP(nn.Module):
        def __init__(self, d, p):
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.proj = nn.Linear(4 * d, d)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.proj(F.gelu(self.fc(x))))

    class Block(nn.Module):
        def __init__(self, d, h, ctx, p):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = Attention(d, h, ctx, p)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = MLP(d, p)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, d, n_layer, h, ctx, p):
            super().__init__()
            self.tok_emb = nn.Embedding(VOCAB, d)
            self.pos_emb = nn.Embedding(ctx, d)
            self.drop = nn.Dropout(p)
            self.blocks = nn.ModuleList([Block(d, h, ctx, p) for _ in range(n_layer)])
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, VOCAB, bias=False)
            self.register_buffer("pos", torch.arange(ctx), persistent=False)
            for name, prm in self.named_parameters():
                if prm.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(prm, 0.0, std)
                elif name.endswith("bias"):
                    nn.init.zeros_(prm)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.drop(self.tok_emb(idx) + self.pos_emb(self.pos[:t]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT(cfg["d_model"], cfg["n_layer"], cfg["n_head"], cfg["ctx"], cfg["dropout"])


def set_dropout(model, p):
    import torch.nn as nn
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


def lr_lambda_factory(steps, warmup, warmup_start, min_frac):
    def f(s):  # s = number of scheduler.step() calls so far; step t uses f(t - 1)
        if s < warmup:
            return warmup_start + (1.0 - warmup_start) * s / warmup
        prog = min(1.0, (s - warmup) / max(1, steps - warmup))
        return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * prog))
    return f


class Batches:
    """Training windows: batch number `cursor` is a pure function of
    (seed, cursor), so an integer cursor is the whole data position."""

    def __init__(self, path, ctx, batch, seed, holdout=0.05):
        import numpy as np
        self.np = np
        data = np.fromfile(path, dtype=np.uint8)
        split = int(len(data) * (1 - holdout))
        self.train, self.held = data[:split], data[split:]
        self.ctx, self.batch, self.seed = ctx, batch, seed

    def _take(self, data, rng, n):
        import torch
        offs = rng.integers(0, len(data) - self.ctx - 1, size=n)
        arr = self.np.stack([data[o:o + self.ctx + 1] for o in offs]).astype(self.np.int64)
        t = torch.from_numpy(arr)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def at(self, cursor):
        rng = self.np.random.default_rng([self.seed, int(cursor)])
        return self._take(self.train, rng, self.batch)

    def held_out(self, i):
        rng = self.np.random.default_rng([self.seed, 1 << 40, int(i)])
        return self._take(self.held, rng, self.batch)


def param_groups(model, wd):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def evaluate(model, batches, n):
    import torch
    import torch.nn.functional as F
    model.eval()
    tot = 0.0
    with torch.no_grad():
        for i in range(n):
            x, y = batches.held_out(i)
            tot += F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).item()
    model.train()
    return tot / n


# --------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------

class JsonLog:
    def __init__(self, path):
        self.f = open(path, "a")

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def worker_pretrain(w):
    torch = torch_setup()
    import torch.nn.functional as F
    cfg = w["cfg"]
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"])
    model = make_model(cfg)
    set_dropout(model, 0.0)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=cfg["pretrain_lr"], betas=(0.9, 0.95))
    steps = cfg["pretrain_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda_factory(steps, cfg["pretrain_warmup"], 0.05, 0.1))
    data = Batches(w["corpus"], cfg["ctx"], cfg["pretrain_batch"], cfg["seed"] + 1)
    out = JsonLog(w["log"])
    out.write(event="start", params=nparams, pid=os.getpid())
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = data.at(t - 1)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        sched.step()
        out.write(event="step", step=t, loss=repr(loss.item()), step_s=time.perf_counter() - t0)
        if t % 25 == 0 or t == steps:
            print("pretrain step %d/%d loss %.4f (%.2f s/step)" %
                  (t, steps, loss.item(), time.perf_counter() - t0), flush=True)
    ev = evaluate(model, data, cfg["eval_batches"])
    torch.save(model.state_dict(), w["out"] + ".tmp")
    os.replace(w["out"] + ".tmp", w["out"])
    out.write(event="end", eval_loss=ev, params=nparams)


def worker_finetune(w):
    torch = torch_setup()
    import torch.nn.functional as F
    cfg = w["cfg"]
    steps = w["steps"]
    torch.manual_seed(cfg["seed"] + 7)
    random.seed(cfg["seed"] + 7)
    model = make_model(cfg)
    model.load_state_dict(torch.load(w["pretrained"]))
    set_dropout(model, cfg["dropout"])
    model.train()
    opt = torch.optim.AdamW(param_groups(model, cfg["weight_decay"]), lr=cfg["lr"],
                            betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda_factory(steps, cfg["warmup"], cfg["warmup_start"], cfg["min_lr_frac"]))
    data = Batches(w["corpus"], cfg["ctx"], cfg["batch"], cfg["seed"] + 2)
    out = JsonLog(w["log"])
    out.write(event="start", pid=os.getpid(), segment=w.get("segment", 0), mode=w["mode"])

    h = None
    start, cursor = 1, 0
    if w["mode"] == "ckptd":
        import ckpt
        from ckpt import torch as ckpt_torch
        client = ckpt.Client(w["socket"], call_timeout_s=10.0, wait_timeout_s=120.0)
        t0 = time.perf_counter()
        h = ckpt_torch.attach(model, opt, client, job_id=JOB, rank=0, world_size=1,
                              policy=w["policy"], layercheck=w.get("layercheck"), layers=None,
                              scheduler=sched, record_trace=bool(w.get("record_trace")))
        attach_s = time.perf_counter() - t0
        out.write(event="attach", seconds=attach_s, layers=getattr(h, "layer_names", None))
        if w.get("restore"):
            t0 = time.perf_counter()
            restored = h.restore()
            restore_s = time.perf_counter() - t0
            plan = dataclasses.asdict(restored)
            start = int(plan["target_step"]) + 1
            cursor = plan["data_position"]
            rec = {k: v for k, v in plan.items() if k != "layers"}
            out.write(event="restore", seconds=restore_s, plan=rec, layers=plan["layers"],
                      lr_after=[g["lr"] for g in opt.param_groups], h_step=h.step)
            if cursor != plan["target_step"]:
                out.write(event="error", what="data_position %r != target_step %r" %
                          (cursor, plan["target_step"]))
    save_path = w.get("save_path")
    for t in range(start, steps + 1):
        t0 = time.perf_counter()
        x, y = data.at(cursor)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        cursor += 1
        lr = opt.param_groups[0]["lr"]
        if h is not None:
            h.set_data_position(cursor)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        sched.step()
        rec = dict(event="step", step=t, loss=repr(loss.item()), lr=lr,
                   fb_s=t1 - t0, opt_s=t2 - t1)
        if save_path and t % w["save_every"] == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "step": t, "data_position": cursor,
                     "torch_rng": torch.get_rng_state(), "py_random": random.getstate()}
            s0 = time.perf_counter()
            torch.save(state, save_path + ".tmp")
            s1 = time.perf_counter()
            fd = os.open(save_path + ".tmp", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            s2 = time.perf_counter()
            os.replace(save_path + ".tmp", save_path)
            rec.update(save_s=s1 - s0, fsync_s=s2 - s1, save_bytes=os.path.getsize(save_path))
        rec["step_s"] = time.perf_counter() - t0
        out.write(**rec)
        if w.get("progress") and (t % 20 == 0 or t == steps):
            print("  %s step %d/%d loss %.4f (%.2f s/step)" %
                  (w["name"], t, steps, loss.item(), rec["step_s"]), flush=True)
        if w.get("kill_after") == t:
            if h is not None:
                out.write(event="stats", step=t, **dataclasses.asdict(h.stats()))
            out.write(event="kill", step=t)
            os.kill(os.getpid(), signal.SIGKILL)
    end = {"event": "end"}
    if h is not None:
        t0 = time.perf_counter()
        end["durable"] = h.wait_durable()
        end["wait_durable_s"] = time.perf_counter() - t0
        out.write(event="stats", step=steps, **dataclasses.asdict(h.stats()))
    end["eval_loss"] = evaluate(model, data, cfg["eval_batches"])
    if h is not None:
        h.close()
    out.write(**end)


# --------------------------------------------------------------------------
# Orchestrator helpers
# --------------------------------------------------------------------------

def read_jsonl(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                rows.append({"event": "torn", "text": line[:200]})
    return rows


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Daemon:
    def __init__(self, stage, root):
        self.stage = stage
        self.root = root
        self.socket = os.path.join(root, "run", "ckptd.sock")
        self.data = os.path.join(root, "data")
        self.log_path = os.path.join(root, "ckptd.log")
        self.port = free_port()
        self.args = [os.path.join(stage, "ckptd"), "--socket=" + self.socket,
                     "--data_dir=" + self.data, "--metrics_address=127.0.0.1:%d" % self.port,
                     "--staging_pool_bytes=268435456", "--lock_staging_memory=false",
                     "--gc_interval_s=15", "--keep_last_events=5"]
        self.proc = None

    def start(self, timeout=60.0):
        os.makedirs(os.path.dirname(self.socket), exist_ok=True)
        self.logf = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.logf, stderr=self.logf)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ckptd exited with %d:\n%s" % (self.proc.returncode, self.log()))
            if os.path.exists(self.socket):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.05)
        raise RuntimeError("ckptd not ready in %.0f s" % timeout)

    def ctl(self, *args):
        out = subprocess.run([os.path.join(self.stage, "ckptctl"), "--socket=" + self.socket,
                              "--json"] + list(args), capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            return {"error": "ckptctl %s: rc %d: %s" % (" ".join(args), out.returncode,
                                                         out.stderr.strip())}
        return json.loads(out.stdout)

    def metrics(self):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10) as r:
                text = r.read().decode()
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            return {"error": str(e)}
        res = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, val = line.rpartition(" ")
            if name.startswith(("ckpt_staleness_invariant", "ckpt_snapshots_skipped",
                                "ckpt_versions_committed_total", "ckpt_committed_bytes_total",
                                "ckpt_versions_failed", "ckpt_errors_total",
                                "ckpt_fence_wait_seconds_sum", "ckpt_fence_wait_seconds_count",
                                "ckpt_restore_seconds_sum", "ckpt_drift_seconds_sum",
                                "ckpt_drift_seconds_count", "ckpt_snapshot_copy_seconds_sum",
                                "ckpt_snapshot_copy_seconds_count")):
                try:
                    res[name] = float(val)
                except ValueError:
                    pass
        return res

    def stop(self, timeout=120):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return "killed after SIGTERM timeout"
        return self.proc.returncode if self.proc else None

    def log(self):
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""


class Experiment:
    def __init__(self, args):
        self.args = args
        self.cfg = dict(QUICK if args.quick else FULL)
        self.out = os.path.abspath(args.out)
        self.cache = os.path.join(self.out, "cache")
        self.logs = os.path.join(self.out, "logs")
        self.traces = os.path.join(self.out, "traces")
        for d in (self.out, self.cache, self.logs, self.traces):
            os.makedirs(d, exist_ok=True)
        self.tmp_root = tempfile.mkdtemp(prefix="ckpt-fidelity-", dir=args.tmp)
        self.stage = os.path.join(self.tmp_root, "stage")
        self.t_start = time.time()
        self.results = {"config": self.cfg, "runs": {}, "command": args.command_line,
                        "started": datetime.datetime.now().isoformat(timespec="seconds"),
                        "host": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}}
        self.ckpt_ok = False

    # ---- stage the binaries and the module, so a concurrent rebuild cannot
    # ---- change them under a running experiment
    def stage_build(self):
        b = os.path.abspath(self.args.build)
        os.makedirs(self.stage, exist_ok=True)
        self.script = os.path.join(self.stage, "run_fidelity.py")
        shutil.copy2(os.path.abspath(__file__), self.script)
        prov = {}
        for src, dst in ((os.path.join(b, "daemon", "ckptd"), "ckptd"),
                         (os.path.join(b, "tools", "ckptctl"), "ckptctl")):
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(self.stage, dst))
                prov[dst] = file_digest(src)
        mod = os.path.join(b, "python", "ckpt")
        if os.path.exists(os.path.join(mod, "__init__.py")):
            shutil.copytree(mod, os.path.join(self.stage, "python", "ckpt"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            for f in sorted(os.listdir(mod)):
                if f.endswith((".py", ".so")):
                    prov["python/ckpt/" + f] = file_digest(os.path.join(mod, f))
        self.results["build"] = {"dir": b, "files": prov}
        env = self.worker_env()
        chk = subprocess.run([PYTHON, "-c", "import ckpt; from ckpt import torch as t; "
                              "print(ckpt.__file__)"], capture_output=True, text=True, env=env)
        have_daemon = os.path.exists(os.path.join(self.stage, "ckptd"))
        self.ckpt_ok = chk.returncode == 0 and have_daemon
        self.results["ckpt_available"] = self.ckpt_ok
        if not self.ckpt_ok:
            self.results["ckpt_unavailable_reason"] = (chk.stderr.strip().splitlines() or
                                                       ["no ckptd binary"])[-1]
            log("ckpt module not importable (%s): running the no-ckptd parts only" %
                self.results["ckpt_unavailable_reason"])
        else:
            log("ckpt module: %s" % chk.stdout.strip())

    def worker_env(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.join(self.stage, "python")
        env["OMP_NUM_THREADS"] = "2"
        # idle OpenMP threads sleep instead of spinning: same numerics, far less
        # damage when other processes share the 2 cores
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONHASHSEED"] = "0"
        return env

    def run_worker(self, w, timeout):
        path = os.path.join(self.tmp_root, "w-%s-%d.json" % (w["name"], w.get("segment", 0)))
        with open(path, "w") as f:
            json.dump(w, f)
        t0 = time.time()
        errf = tempfile.TemporaryFile(mode="w+")
        # the staged copy of this script: editing the source during a run
        # cannot change the workers of that run
        p = subprocess.Popen([PYTHON, self.script, "--worker", path], env=self.worker_env(),
                             stdout=subprocess.PIPE, stderr=errf, text=True)

        def forward():  # the worker's progress lines, live
            for line in p.stdout:
                sys.stdout.write("    " + line)
                sys.stdout.flush()
        th = threading.Thread(target=forward, daemon=True)
        th.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
            errf.write("\nworker killed after its %d s timeout" % timeout)
        th.join(timeout=10)
        errf.seek(0)
        err = errf.read()
        errf.close()
        return rc, time.time() - t0, err[-4000:]

    # ---- data and the pretrained model
    def prepare(self):
        c = self.cfg
        self.pre_corpus = os.path.join(self.cache, "pretrain-%d.bin" % c["pretrain_cap"])
        self.ft_corpus = os.path.join(self.cache, "finetune-%d.bin" % c["finetune_cap"])
        if not os.path.exists(self.pre_corpus):
            log("building pretraining corpus (Python stdlib sources)")
            build_pretrain_corpus(self.pre_corpus, c["pretrain_cap"])
        if not os.path.exists(self.ft_corpus):
            log("building fine-tuning corpus (man pages)")
            build_finetune_corpus(self.ft_corpus, c["finetune_cap"])
        self.results["corpora"] = {
            "pretrain": {"path": self.pre_corpus, "bytes": os.path.getsize(self.pre_corpus),
                         "source": "/usr/lib/python3.11/**/*.py"},
            "finetune": {"path": self.ft_corpus, "bytes": os.path.getsize(self.ft_corpus),
                         "source": "/usr/share/man/man[1-8]/*.gz, roff stripped"}}
        key = hashlib.sha256(json.dumps(
            [c[k] for k in ("d_model", "n_layer", "n_head", "ctx", "pretrain_batch", "pretrain_steps",
                            "pretrain_lr", "pretrain_warmup", "pretrain_cap", "seed",
                            "grad_clip", "eval_batches")]).encode()).hexdigest()[:12]
        self.pretrained = os.path.join(self.cache, "pretrained-%s.pt" % key)
        meta_path = self.pretrained + ".json"
        if not (os.path.exists(self.pretrained) and os.path.exists(meta_path)):
            log("pretraining %d steps (plain torch, failure-free)" % c["pretrain_steps"])
            plog = os.path.join(self.logs, "pretrain.jsonl")
            if os.path.exists(plog):
                os.remove(plog)
            w = {"kind": "pretrain", "name": "pretrain", "cfg": c, "corpus": self.pre_corpus,
                 "log": plog, "out": self.pretrained}
            rc, wall, err = self.run_worker(w, timeout=4 * 3600)
            if rc != 0:
                raise RuntimeError("pretraining failed (rc %s):\n%s" % (rc, err))
            rows = read_jsonl(plog)
            st = [r["step_s"] for r in rows if r.get("event") == "step"]
            end = [r for r in rows if r.get("event") == "end"][-1]
            meta = {"wall_s": wall, "median_step_s": sorted(st[len(st) // 2:])[len(st[len(st) // 2:]) // 2],
                    "first_loss": float([r for r in rows if r.get("event") == "step"][0]["loss"]),
                    "last_loss": float([r for r in rows if r.get("event") == "step"][-1]["loss"]),
                    "eval_loss": end["eval_loss"], "params": end["params"], "cached": False}
            with open(meta_path, "w") as f:
                json.dump(meta, f)
        else:
            log("using cached pretrained model %s" % self.pretrained)
        with open(meta_path) as f:
            meta = json.load(f)
        meta["cached_file"] = self.pretrained
        self.results["pretrain"] = meta
        log("pretrained: %.2fM parameters, loss %.3f -> %.3f, held-out %.3f, %.2f s/step" %
            (meta["params"] / 1e6, meta["first_loss"], meta["last_loss"], meta["eval_loss"],
             meta["median_step_s"]))

    def calibrate(self):
        """A few fine-tuning steps in a worker: the step time that sizes the runs."""
        cal = os.path.join(self.tmp_root, "calibrate.jsonl")
        self.steps = 10
        w = dict(self.base_worker("calibrate"), log=cal, mode="plain", progress=False)
        rc, wall, err = self.run_worker(w, timeout=1800)
        st = sorted(r["step_s"] for r in read_jsonl(cal) if r.get("event") == "step")[2:]
        step_s = st[len(st) // 2] if (rc == 0 and st) else self.results["pretrain"]["median_step_s"]
        self.results["calibration"] = {"median_step_s": step_s, "wall_s": wall, "rc": rc}
        log("fine-tuning step time (calibration): %.2f s" % step_s)
        return step_s

    def choose_steps(self):
        c = self.cfg
        if self.args.steps:
            n = self.args.steps
        else:
            step_s = self.calibrate()
            left = c["budget_min"] * 60 - (time.time() - self.t_start)
            runs = (12.5 + 2 * len(c["warmup_variants"]) + 2 * len(c["budget_fracs"])
                    if self.ckpt_ok else 2.0)
            est_n = int((left - 25 * 8) / (runs * step_s * 1.2))
            n = max(c["min_steps"], min(c["steps"], est_n))
        self.steps = n
        self.results["steps"] = n
        log("fine-tuning runs: %d steps each" % n)

    def base_worker(self, name):
        return {"kind": "finetune", "name": name, "cfg": self.cfg, "steps": self.steps,
                "corpus": self.ft_corpus, "pretrained": self.pretrained,
                "log": os.path.join(self.logs, name + ".jsonl"), "progress": True}

    def timeout(self):
        step_s = self.results.get("calibration", self.results["pretrain"])["median_step_s"]
        return int(600 + self.steps * step_s * 10)

    # ---- runs
    def run_plain(self, name, save_every):
        log("run %s: failure-free, no ckptd, torch.save every %d step(s)" % (name, save_every))
        w = self.base_worker(name)
        if os.path.exists(w["log"]):
            os.remove(w["log"])
        w.update(mode="plain", save_every=save_every,
                 save_path=os.path.join(self.tmp_root, name + "-state.pt"))
        rc, wall, err = self.run_worker(w, self.timeout())
        res = {"kind": "plain", "save_every": save_every, "wall_s": wall, "rc": rc,
               "log": os.path.relpath(w["log"], self.out)}
        if rc != 0:
            res["error"] = "worker rc %s: %s" % (rc, err)
            log("  FAILED: rc %s\n%s" % (rc, err))
        if os.path.exists(w["save_path"]):
            os.remove(w["save_path"])
        self.results["runs"][name] = res
        self.save_results()

    def run_ckptd(self, name, policy, kills, layercheck=None, record_trace=False):
        log("run %s: ckptd policy %s, failures after steps %s" % (name, policy, kills or "none"))
        root = tempfile.mkdtemp(prefix=name + "-", dir=self.tmp_root)
        d = Daemon(self.stage, root)
        w = self.base_worker(name)
        if os.path.exists(w["log"]):
            os.remove(w["log"])
        w.update(mode="ckptd", policy=policy, layercheck=layercheck, record_trace=record_trace,
                 socket=d.socket)
        res = {"kind": "ckptd", "policy": policy, "layercheck": layercheck, "kills": kills,
               "log": os.path.relpath(w["log"], self.out), "segments": []}
        t0 = time.time()
        try:
            d.start()
            for i, k in enumerate(list(kills) + [None]):
                wi = dict(w, segment=i, restore=i > 0, kill_after=k)
                rc, wall, err = self.run_worker(wi, self.timeout())
                seg = {"segment": i, "kill_after": k, "rc": rc, "wall_s": wall}
                expected = -signal.SIGKILL if k else 0
                if rc != expected:
                    seg["error"] = "worker rc %s (expected %s): %s" % (rc, expected, err)
                    log("  segment %d FAILED: rc %s\n%s" % (i, rc, err))
                    res["segments"].append(seg)
                    res["error"] = seg["error"]
                    break
                if k:
                    log("  segment %d: killed after step %d (%.0f s)" % (i, k, wall))
                res["segments"].append(seg)
            res["status"] = d.ctl("status")
            res["metrics"] = d.metrics()
            res["jobs"] = d.ctl("jobs")
        except Exception as e:  # noqa: BLE001 - reported
            res["error"] = "%s: %s" % (type(e).__name__, e)
            log("  FAILED: %s" % res["error"])
        finally:
            res["daemon_stop"] = d.stop()
        dlog = d.log()
        res["invariant_log_lines"] = dlog.count("staleness invariant broken")
        res["daemon_errors"] = [l for l in dlog.splitlines() if "] " in l and
                                l.split(" ", 2)[1][:1] in ("E", "F")][:20]
        shutil.copy2(d.log_path, os.path.join(self.logs, name + ".ckptd.log"))
        trace = os.path.join(d.data, "jobs", JOB, "rank-00000000", "drift.jsonl")
        if os.path.exists(trace):
            dst = os.path.join(self.traces, name + ".drift.jsonl")
            shutil.copy2(trace, dst)
            res["trace"] = os.path.relpath(dst, self.out)
        res["wall_s"] = time.time() - t0
        shutil.rmtree(root, ignore_errors=True)
        self.results["runs"][name] = res
        self.save_results()
        return res

    def save_results(self):
        self.results["elapsed_s"] = time.time() - self.t_start
        with open(os.path.join(self.out, "results.json.tmp"), "w") as f:
            json.dump(self.results, f, indent=1)
        os.replace(os.path.join(self.out, "results.json.tmp"),
                   os.path.join(self.out, "results.json"))

    def run_all(self):
        c = self.cfg
        self.stage_build()
        self.prepare()
        self.choose_steps()
        n = self.steps
        self.run_plain("ff", c["save_every"])
        if self.ckpt_ok:
            self.run_ckptd("all_kill", "all", [max(2, round(c["kill_frac_all"] * n))])
        self.run_plain("torchsave_every_step", 1)
        if self.ckpt_ok:
            cascade = sorted(set(max(2, round(f * n)) for f in c["cascade_fracs"]))
            for k0 in c["k0s"]:
                tag = "lc_%s" % fmt_k0(k0)
                # ckptd's defaults for everything but K0 and S_max
                lc = {"k0": k0, "k0_embedding": k0 * c["k0_embedding_factor"],
                      "s_max": c["s_max"]}
                ff = self.run_ckptd(tag + "_ff", "layercheck", [], lc, record_trace=True)
                kstar = None
                if ff.get("trace"):
                    tr = parse_trace(os.path.join(self.out, ff["trace"]))
                    kstar, sws = max_sws_step(tr, n)
                    ff["max_sws_step"] = kstar
                    ff["max_sws"] = sws
                    self.save_results()
                if kstar is None:
                    kstar = round(0.5 * n)
                    ff["max_sws_step_fallback"] = True
                log("  %s: max size-weighted staleness at step %d" % (tag, kstar))
                self.run_ckptd(tag + "_fail1", "layercheck", [kstar], lc, record_trace=True)
                self.run_ckptd(tag + "_cascade", "layercheck", cascade, lc, record_trace=True)
                if k0 == 1e-3:
                    self.run_variants(lc, ff, cascade)
        self.results["wall_s"] = time.time() - self.t_start
        self.results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        self.save_results()
        shutil.rmtree(self.tmp_root, ignore_errors=True)

    def run_variants(self, lc, ff, cascade):
        """K0 = 1e-3 with the warm-up variants and with write budgets. A
        warm-up variant fails at its own step of maximum size-weighted
        staleness (its selections replayed over the default run's trace) and
        in the same cascade; a budget run is failure-free, then fails at the
        default run's failure step."""
        c, n = self.cfg, self.steps
        tr = parse_trace(os.path.join(self.out, ff["trace"])) if ff.get("trace") else []
        for w, wi in c["warmup_variants"]:
            tag = "lc_1e-3_w%d" % w
            v = dict(lc, warmup=w, warmup_interval=wi)
            kstar = None
            if tr:
                sim = dict(tr[0], steps=simulate_selection(tr[0], dict(v, k_floor=1e-5)))
                kstar, sws = max_sws_step([sim], n)
            kstar = kstar or round(0.5 * n)
            log("  %s: max size-weighted staleness of its selections at step %d" % (tag, kstar))
            self.run_ckptd(tag + "_fail1", "layercheck", [kstar], v, record_trace=True)
            self.run_ckptd(tag + "_cascade", "layercheck", cascade, v, record_trace=True)
        full = sum(l["bytes"] for l in tr[0]["header"]["layers"]) if tr else 0
        step_s = self.results.get("calibration", {}).get("median_step_s")
        if not step_s:  # --steps: no calibration; the failure-free run's median step
            st = sorted(r["step_s"] - r.get("save_s", 0) - r.get("fsync_s", 0)
                        for r in read_jsonl(os.path.join(self.logs, "ff.jsonl"))
                        if r.get("event") == "step")
            step_s = st[len(st) // 2] if st else None
        kstar = ff.get("max_sws_step") or round(0.5 * n)
        for frac in c["budget_fracs"]:
            if not (full and step_s):
                break
            tag = "lc_1e-3_budget%g" % (100 * frac)
            v = dict(lc, budget={"bytes_per_s": frac * full / step_s, "step_s": step_s})
            self.run_ckptd(tag + "_ff", "layercheck", [], v, record_trace=True)
            self.run_ckptd(tag + "_fail1", "layercheck", [kstar], v, record_trace=True)


def file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    st = os.stat(path)
    return {"sha256": h.hexdigest()[:16], "mtime": datetime.datetime.fromtimestamp(
        st.st_mtime).isoformat(timespec="seconds"), "bytes": st.st_size}


def lc_label(lc):
    """ K0=..., with a warm-up or a budget where the run set one."""
    if not lc:
        return ""
    out = " K0=%s" % fmt_k0(lc["k0"])
    if "warmup" in lc:
        out += ", warm-up %d/%d" % (lc["warmup"], lc.get("warmup_interval", 50))
    if lc.get("budget"):
        out += ", budget %.1f MiB/s" % (lc["budget"]["bytes_per_s"] / 2 ** 20)
    return out


def fmt_k0(k0):
    return ("%.0e" % k0).replace("e-0", "e-")


# --------------------------------------------------------------------------
# Trace analysis
# --------------------------------------------------------------------------

def parse_trace(path):
    """drift.jsonl of a single registration -> [{header, steps}]."""
    regs, _ = split_trace(path, None)
    return regs


def read_json_objects(path):
    """Every JSON object in a JSON-lines file, in byte order, also where two
    objects share a line (ckptd's drift.jsonl: a registration's buffered
    lines can be flushed in the middle of a line, with the next
    registration's header appended right after). Returns (objects, number of
    lines that held more than one object or an unparsable rest)."""
    dec = json.JSONDecoder()
    objs, glued = [], 0
    with open(path) as f:
        text = f.read()
    for line in text.split("\n"):
        i, n = 0, 0
        while i < len(line):
            while i < len(line) and line[i] in " \t\r":
                i += 1
            if i >= len(line):
                break
            try:
                o, j = dec.raw_decode(line, i)
            except ValueError:
                objs.append({"event": "torn", "text": line[i:i + 200]})
                n += 1
                break
            objs.append(o)
            n += 1
            i = j
        if n > 1:
            glued += 1
    return objs, glued


def segment_ranges(rows):
    """(first step, last step) that each trainer process (segment) reported."""
    segs = []
    for r in rows:
        if r.get("event") == "start":
            segs.append([None, None])
        elif r.get("event") == "step" and segs:
            if segs[-1][0] is None:
                segs[-1][0] = r["step"]
            segs[-1][1] = r["step"]
    return [tuple(s) for s in segs if s[0] is not None]


def split_trace(path, segs):
    """Splits drift.jsonl into registrations. ckptd writes one header per
    Register, but the step lines are buffered per registration and reach the
    file when that registration ends, i.e. after the next registration's
    header; so the step lines are assigned to the trainer segments by the
    step ranges the trainers reported (segs), in file order."""
    headers, lines, torn, order = [], [], 0, []
    objs, glued = read_json_objects(path)
    for r in objs:
        if "layers" in r and "step" not in r:
            headers.append(r)
            order.append(("h", len(headers) - 1))
        elif "step" in r:
            lines.append(r)
            order.append(("s", len(lines) - 1))
        else:
            torn += 1
    info = {"headers": len(headers), "torn": torn, "glued": glued, "unassigned": 0,
            "late_lines": 0,
            "config": headers[0].get("config") if headers else None,
            "layers": [(l["name"], l["kind"], l["bytes"]) for l in headers[0]["layers"]]
            if headers else []}
    if not headers:
        return [], info
    if not segs:
        return [{"header": headers[0], "steps": lines}], info
    regs = [{"header": headers[min(i, len(headers) - 1)], "steps": []} for i in range(len(segs))]
    si, expect = 0, segs[0][0]
    owner = []
    for ln in lines:
        while si < len(segs) and ln["step"] != expect and si + 1 < len(segs) and \
                ln["step"] == segs[si + 1][0]:
            si += 1
            expect = segs[si][0]
        if si < len(segs) and ln["step"] == expect:
            regs[si]["steps"].append(ln)
            owner.append(si)
            expect += 1
            if expect > segs[si][1] and si + 1 < len(segs):
                si += 1
                expect = segs[si][0]
        else:
            info["unassigned"] += 1
            owner.append(None)
    # lines of registration i written after header i+1 (buffered until it ended)
    hseen = 0
    for kind, idx in order:
        if kind == "h":
            hseen = idx + 1
        elif owner[idx] is not None and hseen > owner[idx] + 1:
            info["late_lines"] += 1
    return regs, info


def staleness_series(reg, init_last=None):
    """Per step: last selected step per layer (after that step's decision)
    and size-weighted staleness sum_l bytes_l * (t - last_l)."""
    sizes = [l["bytes"] for l in reg["header"]["layers"]]
    last = list(init_last) if init_last else [None] * len(sizes)
    out = []
    for s in reg["steps"]:
        t = s["step"]
        for l in s.get("persist", []):
            last[l] = t
        sws = sum(b * (t - (p if p is not None else 0)) for b, p in zip(sizes, last))
        out.append((t, list(last), sws))
    return out


def replay_layercheck(regs, config, restores, job_lr_ref, resume):
    """Replays LayerCheck (docs/layercheck.md, with ckptd's reference LR,
    daemon/policy/layercheck.h) over the trace's drift vectors and LRs and
    counts the steps whose persist set equals the one ckptd recorded.
    Registration 0 starts with no layer persisted. lr_ref is the largest LR
    so far; after a restore, `job_lr_ref` keeps it from the job's earlier
    registrations (else it starts over) and `resume` starts each layer at its
    restored version's step (else as never persisted); the accumulated drift
    starts at 0 in both."""
    k0, k0e = config["k0"], config["k0_embedding"]
    kfloor, smax = config["k_floor"], config["s_max"]
    match = total = 0
    first_mismatch = None
    lr_ref = 0.0
    for gi, g in enumerate(regs):
        if not g["steps"]:
            continue
        kinds = [l["kind"] for l in g["header"]["layers"]]
        L = len(kinds)
        if gi == 0 or not resume or gi - 1 >= len(restores):
            last = [0] * L
        else:
            byname = {x["name"]: x["step"] for x in restores[gi - 1]["layers"]}
            last = [byname.get(l["name"], 0) for l in g["header"]["layers"]]
        acc = [0.0] * L
        if not job_lr_ref:
            lr_ref = 0.0
        for st in g["steps"]:
            t, lr, d = st["step"], st["lr"], st["d"]
            lr_ref = max(lr_ref, lr)
            ratio = lr / lr_ref if lr_ref > 0 else 1.0
            pers = []
            for l in range(L):
                acc[l] += d[l]
                k = max((k0e if kinds[l] == 1 else k0) * ratio, kfloor)
                if last[l] == 0 or t - last[l] >= smax or acc[l] >= k:
                    pers.append(l)
                    acc[l] = 0.0
                    last[l] = t
            total += 1
            if pers == sorted(st.get("persist", [])):
                match += 1
            elif first_mismatch is None:
                first_mismatch = (gi, t, pers, st.get("persist"))
    return {"match": match, "total": total, "first_mismatch": first_mismatch}


def simulate_selection(reg, config):
    """The steps of one registration's trace with `persist` replaced by what
    LayerCheck (no budget) selects under `config` (k0, k0_embedding, k_floor,
    s_max, warmup, warmup_interval), from the recorded drift and LR."""
    kinds = [l["kind"] for l in reg["header"]["layers"]]
    L = len(kinds)
    last, acc, lr_ref, out = [0] * L, [0.0] * L, 0.0, []
    w, wi = config.get("warmup", 1), config.get("warmup_interval", 50)
    for i, st in enumerate(reg["steps"]):
        t, lr = st["step"], st["lr"]
        lr_ref = max(lr_ref, lr)
        ratio = lr / lr_ref if lr_ref > 0 else 1.0
        in_w = t <= w
        full = in_w and (i == 0 or t == w or (wi and t % wi == 0))
        pers = []
        for l in range(L):
            acc[l] += st["d"][l]
            k = max((config["k0_embedding"] if kinds[l] == 1 else config["k0"]) * ratio,
                    config.get("k_floor", 1e-5))
            if last[l] == 0 or full or (not in_w and (t - last[l] >= config["s_max"] or
                                                       acc[l] >= k)):
                pers.append(l)
                acc[l], last[l] = 0.0, t
        out.append(dict(st, persist=pers))
    return out


def max_sws_step(regs, n):
    if not regs:
        return None, None
    series = staleness_series(regs[0])
    lo, hi = max(2, int(0.1 * n)), int(0.9 * n)
    cand = [(sws, t) for t, _, sws in series if lo <= t <= hi]
    if not cand:
        return None, None
    sws, t = max(cand, key=lambda x: (x[0], -x[1]))
    return t, sws


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def trajectory(rows):
    """Step -> loss repr, the last process's value winning (a restored
    process re-executes the steps after its restore target)."""
    traj = {}
    for r in rows:
        if r.get("event") == "step":
            traj[r["step"]] = r["loss"]
    return traj


def pct(x):
    return "%.3f%%" % (100 * x) if x is not None else "n/a"


def human_bytes(b):
    if b is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return ("%.1f %s" % (b, unit)) if unit != "B" else "%d B" % b
        b /= 1024.0


def quantiles(xs):
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]
    return {"n": len(s), "mean": sum(s) / len(s), "p50": q(0.5), "p95": q(0.95), "max": s[-1]}


def analyse(out_dir, results):
    """Everything the report needs, computed from the logs and traces."""
    A = {"runs": {}}
    runs = results["runs"]
    n = results.get("steps")
    rows = {name: read_jsonl(os.path.join(out_dir, r["log"])) for name, r in runs.items()
            if r.get("log")}
    ff = trajectory(rows.get("ff", []))
    A["ff_steps"] = len(ff)
    ff_end = [r for r in rows.get("ff", []) if r.get("event") == "end"]
    ff_eval = ff_end[-1]["eval_loss"] if ff_end else None
    A["ff_eval"] = ff_eval
    ff_losses = [float(ff[t]) for t in sorted(ff)]
    if len(ff_losses) >= 40:
        A["ff_progress"] = (sum(ff_losses[:20]) / 20, sum(ff_losses[-20:]) / 20)

    # torch.save baselines
    for name in ("ff", "torchsave_every_step"):
        if name not in rows:
            continue
        st = [r for r in rows[name] if r.get("event") == "step"]
        saves = [r for r in st if "save_s" in r]
        steps = len(st)
        A["runs"][name] = {
            "steps": steps, "saves": len(saves),
            "save_every": runs[name]["save_every"],
            "save_s": quantiles([r["save_s"] for r in saves]),
            "save_fsync_s": quantiles([r["save_s"] + r["fsync_s"] for r in saves]),
            "bytes": sum(r["save_bytes"] for r in saves),
            "bytes_per_save": (saves[0]["save_bytes"] if saves else None),
            "stall_per_step_mean": (sum(r["save_s"] for r in saves) / steps) if steps else None,
            "stall_fsync_per_step_mean": (sum(r["save_s"] + r["fsync_s"] for r in saves) / steps)
            if steps else None,
            "fb_s": quantiles([r["fb_s"] for r in st]),
            "opt_s": quantiles([r["opt_s"] for r in st]),
            "step_s": quantiles([r["step_s"] - r.get("save_s", 0) - r.get("fsync_s", 0)
                                 for r in st]),
        }
    ts = trajectory(rows.get("torchsave_every_step", []))
    A["torchsave_bitexact"] = bool(ts) and ts == ff

    for name, r in runs.items():
        if r.get("kind") != "ckptd":
            continue
        rr = rows.get(name, [])
        traj = trajectory(rr)
        a = {"policy": r["policy"], "kills": r["kills"], "error": r.get("error")}
        a["complete"] = n is not None and sorted(traj) == list(range(1, n + 1))
        mism = [t for t in sorted(traj) if t in ff and traj[t] != ff[t]]
        a["steps_compared"] = len([t for t in traj if t in ff])
        a["mismatches"] = len(mism)
        a["first_mismatch"] = mism[0] if mism else None
        a["bitexact"] = a["complete"] and not mism
        # the killed process's own steps (before its kill) against ff
        pre = {}
        seg = -1
        for x in rr:
            if x.get("event") == "start":
                seg += 1
            if x.get("event") == "step" and seg == 0:
                pre[x["step"]] = x["loss"]
        a["segment0_bitexact_vs_ff"] = all(ff.get(t) == v for t, v in pre.items()) and bool(pre)
        restores = [x for x in rr if x.get("event") == "restore"]
        a["restores"] = [{"target_step": x["plan"]["target_step"],
                          "max_staleness": x["plan"].get("max_staleness"),
                          "size_weighted_staleness": x["plan"].get("size_weighted_staleness"),
                          "seconds": x["seconds"], "bytes_restored": x["plan"].get("bytes_restored"),
                          "layers": x["layers"]} for x in restores]
        a["errors_logged"] = [x for x in rr if x.get("event") == "error"]
        # deviation after the first recovery
        if restores:
            first = a["restores"][0]["target_step"] + 1
            devs = [(t, abs(float(traj[t]) - float(ff[t])) / float(ff[t]))
                    for t in sorted(traj) if t >= first and t in ff]
            a["dev_series"] = devs
            a["max_dev"] = max(d for _, d in devs) if devs else None
            a["max_dev_step"] = max(devs, key=lambda x: x[1])[0] if devs else None
            a["final_dev"] = devs[-1][1] if devs else None
            a["mean_dev"] = sum(d for _, d in devs) / len(devs) if devs else None
            # the same on a 10-step running mean of the loss (both runs alike)
            K = 10
            fs_ = sorted(ff)
            ffv = [float(ff[t]) for t in fs_]
            trv = [float(traj.get(t, ff[t])) for t in fs_]
            sm = []
            for i in range(K - 1, len(fs_)):
                if fs_[i] >= first:
                    mf = sum(ffv[i - K + 1:i + 1]) / K
                    mt = sum(trv[i - K + 1:i + 1]) / K
                    sm.append(abs(mt - mf) / mf)
            a["max_dev_smooth10"] = max(sm) if sm else None
        end = [x for x in rr if x.get("event") == "end"]
        if end and ff_eval:
            a["eval_loss"] = end[-1]["eval_loss"]
            a["eval_dev"] = abs(end[-1]["eval_loss"] - ff_eval) / ff_eval
            a["durable"] = end[-1].get("durable")
        # trainer-visible stall per step (fence wait + StepDone) per segment
        stalls = []
        for x in rr:
            if x.get("event") == "stats":
                fw, sd = x["fence_wait_s"], x["step_done_s"]
                for i in range(len(sd)):
                    stalls.append((fw[i - 1] if 0 < i <= len(fw) else 0.0) + sd[i])
        a["stall_s"] = quantiles(stalls)
        a["fence_s"] = quantiles([v for x in rr if x.get("event") == "stats"
                                  for v in x["fence_wait_s"]])
        a["step_done_s"] = quantiles([v for x in rr if x.get("event") == "stats"
                                      for v in x["step_done_s"]])
        st = [x for x in rr if x.get("event") == "step"]
        a["opt_s"] = quantiles([x["opt_s"] for x in st])
        a["fb_s"] = quantiles([x["fb_s"] for x in st])
        a["steps_reported"] = len(st)
        status = r.get("status") or {}
        a["bytes_committed"] = status.get("bytes_committed")
        a["versions_committed"] = status.get("versions_committed")
        a["snapshots_skipped"] = status.get("snapshots_skipped")
        a["write_errors"] = status.get("write_errors")
        m = r.get("metrics") or {}
        a["metric_invariant_violations"] = m.get("ckpt_staleness_invariant_violations_total")
        a["invariant_log_lines"] = r.get("invariant_log_lines")
        # trace: invariant on selections, per-registration summary
        if r.get("trace"):
            segs = segment_ranges(rr)
            regs, tinfo = split_trace(os.path.join(out_dir, r["trace"]), segs)
            a["trace_registrations"] = tinfo["headers"]
            a["trace_torn"] = tinfo["torn"]
            a["trace_glued_lines"] = tinfo["glued"]
            a["trace_unassigned_lines"] = tinfo["unassigned"]
            a["trace_late_lines"] = tinfo["late_lines"]
            a["trace_header_config"] = tinfo["config"]
            a["trace_layers"] = tinfo["layers"]
            s_max = (r.get("layercheck") or {}).get("s_max")
            # docs/layercheck.md: the invariant holds from the base checkpoint at
            # the end of the warm-up on (selection and the guard are off before).
            base_step = (tinfo["config"] or {}).get("warmup", 0)
            worst, viol = 0, []
            for gi, g in enumerate(regs):
                init = None
                if gi > 0 and gi - 1 < len(a["restores"]):
                    byname = {L_["name"]: L_["step"] for L_ in a["restores"][gi - 1]["layers"]}
                    init = [byname.get(l["name"]) for l in g["header"]["layers"]]
                for t, last, _ in staleness_series(g, init):
                    for li, p in enumerate(last):
                        age = t - (p if p is not None else 0)
                        if t < base_step:
                            continue
                        worst = max(worst, age)
                        if s_max and age >= s_max:
                            viol.append((gi, t, li, age))
            cfgt = tinfo["config"]
            if cfgt and regs and cfgt.get("warmup", 0) <= 1 and not cfgt.get("full_every") \
                    and not cfgt.get("budget"):
                a["replay_spec"] = replay_layercheck(regs, cfgt, a["restores"], True, True)
                if len(regs) > 1:
                    a["replay_fresh_registration"] = replay_layercheck(
                        regs, cfgt, a["restores"], False, False)
            a["trace_max_selected_staleness"] = worst
            sizes = [l[2] for l in tinfo["layers"]]
            tsteps = [st for g in regs for st in g["steps"]]
            a["trace_steps"] = len(tsteps)
            a["trace_selected_bytes"] = sum(sizes[l] for st in tsteps for l in st.get("persist", [])
                                            if l < len(sizes))
            km = [st["k_mult"] for st in tsteps if "k_mult" in st]
            if km:
                a["trace_k_mult"] = {"mean": sum(km) / len(km), "min": min(km), "max": max(km),
                                     "last": km[-1]}
            a["layercheck"] = r.get("layercheck")
            a["trace_invariant_violations"] = len(viol)
            a["trace_invariant_examples"] = viol[:5]
            if regs:
                a["trace_first_reg_layer_writes"] = sum(len(s.get("persist", []))
                                                        for s in regs[0]["steps"])
                if len(regs) > 1:
                    a["trace_after_restore_first_persist"] = [
                        (g["steps"][0]["step"], len(g["steps"][0].get("persist", [])))
                        for g in regs[1:] if g["steps"]]
                    # layer writes per step before the first failure vs after the last restore
                    pre = regs[0]["steps"]
                    post = [s for g in regs[1:] for s in g["steps"][1:]]
                    if pre and post:
                        a["trace_writes_per_step_before_after"] = (
                            sum(len(s["persist"]) for s in pre[1:]) / max(1, len(pre) - 1),
                            sum(len(s["persist"]) for s in post) / len(post))
        if "max_sws_step" in r:
            a["max_sws_step"] = r["max_sws_step"]
            a["max_sws"] = r["max_sws"]
        A["runs"][name] = a
    return A


def make_figures(out_dir, results, A):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    figs = {}

    def save(fig, key, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        figs[key] = name

    runs = results["runs"]
    n = results.get("steps")
    rows = {name: read_jsonl(os.path.join(out_dir, r["log"])) for name, r in runs.items()
            if r.get("log")}
    ff = {t: float(v) for t, v in trajectory(rows.get("ff", [])).items()}
    if not ff:
        return figs
    fs = sorted(ff)

    def smooth(ys, k=9):
        if len(ys) < k:
            return ys
        ker = np.ones(k) / k
        pad = np.pad(np.asarray(ys, dtype=float), (k // 2, k // 2), mode="edge")
        return np.convolve(pad, ker, mode="valid")

    # 1. policy `all`: failure-free vs recovered
    if "all_kill" in runs and rows.get("all_kill"):
        tr = {t: float(v) for t, v in trajectory(rows["all_kill"]).items()}
        fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                               gridspec_kw={"height_ratios": [3, 1]})
        ax[0].plot(fs, [ff[t] for t in fs], lw=2.5, color="0.7", label="failure-free")
        ts = sorted(tr)
        ax[0].plot(ts, [tr[t] for t in ts], lw=0.9, color="C0",
                   label="policy all, SIGKILL + restore")
        for k in runs["all_kill"]["kills"]:
            ax[0].axvline(k, color="C3", ls="--", lw=1)
        for r in A["runs"]["all_kill"].get("restores", []):
            ax[0].axvline(r["target_step"], color="C2", ls=":", lw=1)
        ax[0].set_ylabel("training loss (per step)")
        ax[0].set_title("policy all: killed after step %s, restored (dotted: restore target)"
                        % runs["all_kill"]["kills"])
        ax[0].legend()
        diff = [(t, float(tr[t]) - ff[t]) for t in ts if t in ff]
        ax[1].plot([t for t, _ in diff], [d for _, d in diff], color="C0")
        ax[1].set_ylabel("loss - failure-free")
        ax[1].set_xlabel("step")
        save(fig, "loss_all", "loss_all.png")

    # 2. LayerCheck: loss overlays and relative deviation per K0
    k0s = [k for k in results["config"]["k0s"] if "lc_%s_fail1" % fmt_k0(k) in runs]
    if k0s:
        fig, ax = plt.subplots(2, len(k0s), figsize=(5.2 * len(k0s), 7), squeeze=False,
                               sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        for j, k0 in enumerate(k0s):
            tag = "lc_%s" % fmt_k0(k0)
            a0, a1 = ax[0][j], ax[1][j]
            a0.plot(fs, smooth([ff[t] for t in fs]), lw=3, color="0.7", label="failure-free")
            for suffix, color, lab in (("_fail1", "C1", "1 failure (max SWS step)"),
                                       ("_cascade", "C4", "3 cascading failures")):
                name = tag + suffix
                if not rows.get(name):
                    continue
                tr = {t: float(v) for t, v in trajectory(rows[name]).items()}
                ts = sorted(tr)
                a0.plot(ts, smooth([tr[t] for t in ts]), lw=1, color=color, label=lab)
                a = A["runs"].get(name, {})
                if a.get("dev_series"):
                    a1.plot([t for t, _ in a["dev_series"]], [100 * d for _, d in a["dev_series"]],
                            color=color, lw=1, label=lab)
                for k in runs[name]["kills"]:
                    a0.axvline(k, color=color, ls="--", lw=0.8)
                    a1.axvline(k, color=color, ls="--", lw=0.8)
            a0.set_title("LayerCheck K0=%s (loss smoothed over 9 steps)" % fmt_k0(k0))
            a0.set_ylabel("training loss")
            a0.legend(fontsize=8)
            a1.set_ylabel("|loss - ff| / ff  [%] (per step, raw)")
            a1.set_xlabel("step")
            a1.axhline(0.54, color="k", lw=0.6, ls=":")
        save(fig, "loss_layercheck", "loss_layercheck.png")

    # 3. bytes written
    bars = []
    for name, lab in (("torchsave_every_step", "torch.save every step"),
                      ("ff", "torch.save every %s" % results["config"]["save_every"])):
        if name in A["runs"]:
            bars.append((lab, A["runs"][name]["bytes"] * n / max(1, A["runs"][name]["steps"])))
    if "all_kill" in A["runs"] and A["runs"]["all_kill"].get("bytes_committed"):
        a = A["runs"]["all_kill"]
        bars.append(("ckptd all (per step x %d)" % n,
                     a["bytes_committed"] * n / max(1, a["steps_reported"])))
    for k0 in results["config"]["k0s"]:
        name = "lc_%s_ff" % fmt_k0(k0)
        if name in A["runs"] and A["runs"][name].get("bytes_committed"):
            bars.append(("ckptd layercheck K0=%s" % fmt_k0(k0), A["runs"][name]["bytes_committed"]))
    if bars:
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh([b[0] for b in bars], [b[1] / 2 ** 20 for b in bars], color="C0")
        ax.set_xscale("log")
        ax.set_xlabel("MiB written over %d failure-free steps (log)" % n)
        for i, b in enumerate(bars):
            ax.text(b[1] / 2 ** 20, i, " " + human_bytes(b[1]), va="center", fontsize=8)
        ax.invert_yaxis()
        save(fig, "bytes", "bytes.png")

    # 4. trainer-visible stall per step
    bars = []
    for name, lab in (("torchsave_every_step", "torch.save every step"),):
        if name in A["runs"]:
            a = A["runs"][name]
            bars.append((lab + " (call)", a["stall_per_step_mean"]))
            bars.append((lab + " (call + fsync)", a["stall_fsync_per_step_mean"]))
    if "ff" in A["runs"]:
        a = A["runs"]["ff"]
        bars.append(("torch.save every %d (amortized)" % a["save_every"], a["stall_per_step_mean"]))
    for name in [x for x in A["runs"] if x == "all_kill" or x.endswith("_ff")]:
        a = A["runs"][name]
        if a.get("stall_s", {}).get("n"):
            lab = "ckptd all" if name == "all_kill" else "ckptd layercheck K0=%s" % name[3:-3]
            bars.append((lab + " (fence + StepDone)", a["stall_s"]["mean"]))
    if bars:
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh([b[0] for b in bars], [1e3 * b[1] for b in bars], color="C1")
        ax.set_xscale("log")
        ax.set_xlabel("mean trainer-visible stall per step [ms] (log)")
        for i, b in enumerate(bars):
            ax.text(1e3 * b[1], i, " %.2f ms" % (1e3 * b[1]), va="center", fontsize=8)
        ax.invert_yaxis()
        save(fig, "stall", "stall.png")

    # 5. staleness distribution at each restore
    groups = []
    for k0 in results["config"]["k0s"]:
        st = []
        for suffix in ("_fail1", "_cascade"):
            a = A["runs"].get("lc_%s%s" % (fmt_k0(k0), suffix), {})
            for r in a.get("restores", []):
                st += [L["staleness"] for L in r["layers"]]
        if st:
            groups.append(("K0=%s" % fmt_k0(k0), st))
    if groups:
        fig, ax = plt.subplots(figsize=(8, 4))
        mx = max(max(s) for _, s in groups)
        bins = np.arange(0, mx + 2) - 0.5 if mx < 60 else 30
        ax.hist([s for _, s in groups], bins=bins, label=[g for g, _ in groups])
        ax.set_xlabel("per-layer staleness at restore [steps] (all restores of the run pair)")
        ax.set_ylabel("layers")
        ax.legend()
        save(fig, "staleness", "staleness_hist.png")

    # 6. accumulated-drift heatmaps with persistence events
    heat = []
    for k0 in results["config"]["k0s"]:
        r = runs.get("lc_%s_ff" % fmt_k0(k0))
        if r and r.get("trace"):
            regs = parse_trace(os.path.join(out_dir, r["trace"]))
            if regs and regs[0]["steps"]:
                heat.append((k0, regs[0]))
    if heat:
        fig, ax = plt.subplots(len(heat), 1, figsize=(11, 3.2 * len(heat)), squeeze=False)
        for i, (k0, reg) in enumerate(heat):
            names = [l["name"] for l in reg["header"]["layers"]]
            L, steps = len(names), [s["step"] for s in reg["steps"]]
            acc = np.zeros((L, len(steps)))
            cur = np.zeros(L)
            px, py = [], []
            for j, s in enumerate(reg["steps"]):
                cur += np.asarray(s["d"], dtype=float)
                acc[:, j] = cur
                for l in s.get("persist", []):
                    px.append(s["step"])
                    py.append(l)
                    cur[l] = 0.0
            a = ax[i][0]
            im = a.imshow(acc, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, L - 0.5))
            a.scatter(px, py, marker="|", color="red", s=30, lw=1.0, label="persisted")
            a.set_yticks(range(L))
            a.set_yticklabels(names, fontsize=7)
            a.set_title("LayerCheck K0=%s: accumulated drift D (before reset); red = layer persisted"
                        % fmt_k0(k0), fontsize=9)
            fig.colorbar(im, ax=a, pad=0.01)
        ax[-1][0].set_xlabel("step")
        save(fig, "drift", "drift_heatmap.png")

    # 7. size-weighted staleness over time (failure-free traces) and the chosen failure step
    if heat:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        for i, (k0, reg) in enumerate(heat):
            ser = staleness_series(reg)
            tot = sum(l["bytes"] for l in reg["header"]["layers"])
            ax.plot([t for t, _, _ in ser], [s / tot for _, _, s in ser], color="C%d" % i,
                    label="K0=%s" % fmt_k0(k0))
            k = runs.get("lc_%s_ff" % fmt_k0(k0), {}).get("max_sws_step")
            if k:
                ax.axvline(k, color="C%d" % i, ls="--", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("size-weighted staleness [steps]")
        ax.set_title("selected versions, failure-free traces (dashed: injected failure step)")
        ax.legend()
        save(fig, "sws", "sws.png")
    return figs


def write_variants_section(w, out_dir, c, n, runs, R):
    """K0 = 1e-3 with ckptd's warm-up default, with the warm-up variants and
    with a write budget."""
    base = R.get("lc_1e-3_ff")
    names = [nm for nm in runs if nm.startswith(("lc_1e-3_w", "lc_1e-3_budget"))]
    if not base or not names:
        return
    tr_path = runs["lc_1e-3_ff"].get("trace")
    reg = None
    if tr_path:
        regs = parse_trace(os.path.join(out_dir, tr_path))
        reg = regs[0] if regs else None
    sizes = [l["bytes"] for l in reg["header"]["layers"]] if reg else []
    cfg = (base.get("trace_header_config") or {})
    w("## Warm-up and write budget (K0 = 1e-3)")
    w("")
    w("The default LayerCheck runs above use ckptd's warm-up default (W = %s: the first step "
      "is the base checkpoint, the drift rule runs from the second). A warm-up variant runs "
      "with selection off up to step W and every layer persisted every I steps; its "
      "failure-free bytes and staleness are its selections replayed over the default run's "
      "drift trace (the failure-free trajectory is the same bit for bit under every policy), "
      "its single failure is at its own step of maximum size-weighted staleness, its cascade "
      "at the same steps as the default's. A budget run declares bytes_per_s with a "
      "measured step time (the calibration's, or with --steps the failure-free run's median); "
      "its achieved rate is the bytes LayerCheck selected (the trace) "
      "per step and per second of the trainer's measured steps." % cfg.get("warmup", "?"))
    w("")
    w("| config | failure-free: bytes | layer writes | mean size-weighted staleness | 1 failure "
      "(step): max / final / eval dev | 3 failures: max / final / eval dev |")
    w("| --- | --- | --- | --- | --- | --- |")

    def sws_mean(steps):
        last, tot, out = [0] * len(sizes), float(sum(sizes)) or 1.0, []
        for st in steps:
            for l in st.get("persist", []):
                last[l] = st["step"]
            out.append(sum(b * (st["step"] - p) for b, p in zip(sizes, last)) / tot)
        return sum(out) / len(out) if out else 0

    def row(label, bytes_, writes, sws, f1, f3):
        w("| %s | %s | %s | %.2f steps | %s | %s |" % (
            label, human_bytes(bytes_), writes, sws,
            "(%s) %s / %s / %s" % (f1.get("kills"), pct(f1.get("max_dev")),
                                   pct(f1.get("final_dev")), pct(f1.get("eval_dev")))
            if f1 else "-",
            "%s / %s / %s" % (pct(f3.get("max_dev")), pct(f3.get("final_dev")),
                              pct(f3.get("eval_dev"))) if f3 else "-"))
    if reg:
        row("default (W = %s)" % cfg.get("warmup", "?"), base.get("trace_selected_bytes"),
            sum(len(st["persist"]) for st in reg["steps"]), sws_mean(reg["steps"]),
            R.get("lc_1e-3_fail1", {}), R.get("lc_1e-3_cascade", {}))
    for wv, wi in c.get("warmup_variants", ()):
        tag = "lc_1e-3_w%d" % wv
        if tag + "_fail1" not in R:
            continue
        sim = simulate_selection(reg, dict(runs[tag + "_fail1"]["layercheck"], k_floor=1e-5)) \
            if reg else []
        row("warm-up W = %d, full every %d" % (wv, wi),
            sum(sizes[l] for st in sim for l in st["persist"]) if sim else None,
            sum(len(st["persist"]) for st in sim) if sim else "-",
            sws_mean(sim) if sim else float("nan"), R.get(tag + "_fail1", {}),
            R.get(tag + "_cascade", {}))
    budget_rows = []
    for nm in names:
        if not (nm.startswith("lc_1e-3_budget") and nm.endswith("_ff")):
            continue
        x = R[nm]
        regs = parse_trace(os.path.join(out_dir, runs[nm]["trace"])) \
            if runs[nm].get("trace") else []
        b = (runs[nm].get("layercheck") or {}).get("budget") or {}
        row("budget %.1f MiB/s (%.2f s/step declared)" % (b.get("bytes_per_s", 0) / 2 ** 20,
                                                           b.get("step_s", 0)),
            x.get("trace_selected_bytes"), sum(len(st["persist"]) for st in regs[0]["steps"])
            if regs else "-", sws_mean(regs[0]["steps"]) if regs else float("nan"),
            R.get(nm[:-3] + "_fail1", {}), None)
        step_s = [float(y["step_s"]) for y in read_jsonl(os.path.join(out_dir,
                                                                       runs[nm]["log"]))
                  if y.get("event") == "step"]
        budget_rows.append((nm, b, x, sum(step_s), len(step_s)))
    w("")
    for nm, b, x, wall, steps in budget_rows:
        per_step = b["bytes_per_s"] * b["step_s"]
        sel = x.get("trace_selected_bytes") or 0
        km = x.get("trace_k_mult") or {}
        w("Budget run `%s`: budget %.2f MiB per step (%.2f MiB/s at the declared %.3f s per step); "
          "achieved **%.2f MiB per step (%.3fx the budget)** over %d steps; the trainer's measured "
          "steps took %.3f s on average, so the wall-clock rate was %.2f MiB/s (%.3fx the budget "
          "in bytes/s); bytes committed by ckptd %s; K0 multiplier mean %.2f (%.2f..%.2f)."
          % (nm, per_step / 2 ** 20, b["bytes_per_s"] / 2 ** 20, b["step_s"],
             sel / max(1, steps) / 2 ** 20, sel / max(1, steps) / per_step, steps,
             wall / max(1, steps), sel / wall / 2 ** 20 if wall else 0,
             (sel / wall) / b["bytes_per_s"] if wall else 0,
             human_bytes(x.get("bytes_committed")), km.get("mean", 0), km.get("min", 0),
             km.get("max", 0)))
        w("")


def write_report(out_dir, results):
    A = analyse(out_dir, results)
    try:
        figs = make_figures(out_dir, results, A)
    except ImportError as e:
        figs = {}
        A["figure_error"] = "matplotlib missing (%s): apt-get install -y python3-matplotlib" % e
    c = results["config"]
    n = results.get("steps")
    runs = results["runs"]
    R = A["runs"]
    L = []
    w = L.append
    w("# ckptd recovery fidelity (%s mode)" % c["name"])
    w("")
    w("Produced by:")
    w("")
    w("```")
    w(results.get("command", "?"))
    w("```")
    w("")
    wall = results.get("wall_s") or results.get("elapsed_s")
    w("Started %s, wall time **%.1f min** (%.0f s)%s on %s (%d CPUs). Every number below is "
      "measured in this run; nothing is copied from elsewhere." %
      (results.get("started"), wall / 60, wall,
       "" if results.get("finished") else " (run did not finish)",
       results["host"]["uname"].split()[1], results["host"]["cpus"]))
    w("")
    if results.get("rendered"):
        w("This text and the figures were re-drawn from that run's `results.json`, logs and "
          "traces by `%s` at %s (the analysis code was extended after the run; the measured "
          "data are the run's)." % (results["rendered"]["command"], results["rendered"]["at"]))
        w("")
    if not results.get("ckpt_available"):
        w("**The `ckpt` Python module was not importable** (%s): only the runs without ckptd "
          "were done." % results.get("ckpt_unavailable_reason"))
        w("")
    pre = results.get("pretrain", {})
    w("## Setup")
    w("")
    w("- Model: GPT-style decoder-only transformer, %.2fM parameters, %d blocks, d_model %d, "
      "%d heads, context %d, byte vocabulary (256), untied head, dropout %.2f in fine-tuning. "
      "Automatic layer grouping of `ckpt.torch` (`tok_emb`, `pos_emb`, `blocks.N`, `ln_f`, `head`)."
      % (pre.get("params", 0) / 1e6, c["n_layer"], c["d_model"], c["n_head"], c["ctx"],
         c["dropout"]))
    corp = results.get("corpora", {})
    w("- Pretraining: %d steps, batch %d x %d bytes, AdamW lr %.0e, plain torch, on the Python "
      "3.11 standard library sources (%s, `%s`); loss %.3f -> %.3f, held-out %.3f; cached in "
      "`%s` (torch.save once)." %
      (c["pretrain_steps"], c["pretrain_batch"], c["ctx"], c["pretrain_lr"],
       human_bytes(corp.get("pretrain", {}).get("bytes")), corp.get("pretrain", {}).get("source"),
       pre.get("first_loss", 0), pre.get("last_loss", 0), pre.get("eval_loss", 0),
       os.path.relpath(pre.get("cached_file", "?"), out_dir)))
    w("- Fine-tuning: %d steps, batch %d x %d bytes, on Debian's man pages (%s, `%s`), AdamW lr %.0e (betas 0.9/0.95, "
      "weight decay %.1f on matrices, 2 param groups), grad clip %.1f, LambdaLR: linear warm-up "
      "from %.0f%% over %d steps, cosine to %.0f%%; the scheduler is passed to `attach` so its "
      "state rides along. Batch number c is a pure function of (seed, c); the integer cursor is "
      "saved with `set_data_position`. Same seed and data order in every run." %
      (n or 0, c["batch"], c["ctx"], human_bytes(corp.get("finetune", {}).get("bytes")),
       corp.get("finetune", {}).get("source"), c["lr"], c["weight_decay"], c["grad_clip"],
       100 * c["warmup_start"], c["warmup"], 100 * c["min_lr_frac"]))
    if A.get("ff_progress"):
        first, last = A["ff_progress"]
        w("- What fine-tuning did in the failure-free run: training loss %.3f (mean of the first "
          "20 steps) -> %.3f (mean of the last 20), %.1f%% lower; held-out loss at the end %.3f. "
          "The lr is a usual full fine-tuning rate. The earlier run in git history (commit "
          "795ff4f) used lr 3e-4, where these small matrices drift ~15x more per step, with "
          "the paper's lr_0 (first step's LR), where the warm-up made the threshold at the peak "
          "10 x K0: 1.12%% deviation and 4.2x fewer bytes at K0 = 1e-3." %
          (first, last, 100 * (first - last) / first, A.get("ff_eval") or 0))
    w("- Every trainer is its own process; a failure is `os.kill(os.getpid(), SIGKILL)` right "
      "after `optimizer.step()` (StepDone) of the failure step; a new process attaches, calls "
      "`h.restore()` and continues at `target_step + 1`. One fresh ckptd per run "
      "(`--staging_pool_bytes=268435456 --lock_staging_memory=false --gc_interval_s=15 "
      "--keep_last_events=5`), its own temp dir, stopped with SIGTERM.")
    w("- LayerCheck: K0 in %s, K0_embedding = %g x K0, S_max = %d (scaled to the run length; "
      "the paper's 200 never binds in a %d-step run), the warm-up and everything else "
      "ckptd's defaults (the trace headers give what ckptd used). Failure step of the "
      "single-failure run = step of maximum size-weighted staleness "
      "(sum over layers of bytes x (t - last persisted step)) in the failure-free run's trace, "
      "searched in [10%%, 90%%] of the run; cascading failures after steps %s. ckptd's "
      "threshold is K(t) = max(K0 lr_t / lr_ref, K_floor) with lr_ref the largest LR of the job "
      "so far (README \"LayerCheck\"): K = K0 through the warm-up and at the peak, K0 x %.0f%% at "
      "the end of the cosine." %
      (", ".join(fmt_k0(k) for k in c["k0s"]), c["k0_embedding_factor"], c["s_max"], n or 0,
       [max(2, round(f * n)) for f in c["cascade_fracs"]] if n else "?",
       100 * c["min_lr_frac"]))
    cal = results.get("calibration")
    w("- Steps per fine-tuning run: %d (%s). Trainers run with torch.set_num_threads(2), "
      "OMP_WAIT_POLICY=PASSIVE." %
      (n or 0, "calibrated: %.2f s per fine-tuning step, sized to a %.0f-minute budget, at most %d, "
       "at least %d" % (cal["median_step_s"], c["budget_min"], c["steps"], c["min_steps"])
       if cal else "given with --steps"))
    b = results.get("build", {})
    w("- Binaries and module staged from `%s` at start: %s." %
      (b.get("dir"), ", ".join("%s %s (%s)" % (k, v["sha256"], v["mtime"])
                                for k, v in sorted(b.get("files", {}).items()))))
    w("")

    # ---- headline
    w("## Results against the targets")
    w("")
    w("| what | measured | target |")
    w("| --- | --- | --- |")
    a = R.get("all_kill")
    if a:
        w("| bit-exact recovery, policy `all` (kill after step %s, restore target %s) | **%s** "
          "(%d steps compared, %d differ%s) | yes |" %
          (a["kills"], [r["target_step"] for r in a["restores"]],
           "yes" if a["bitexact"] else "NO", a["steps_compared"], a["mismatches"],
           "" if not a["first_mismatch"] else ", first at step %d" % a["first_mismatch"]))
    lc3 = "lc_1e-3"
    f1, cc = R.get(lc3 + "_fail1"), R.get(lc3 + "_cascade")
    if f1:
        w("| max relative loss deviation after recovery, K0=1e-3, 1 failure at step %s (per-step "
          "training loss, same batch and dropout mask) | **%s** (final step %s; on the 10-step "
          "running mean %s; held-out eval at the end %s) | <= 0.54%% |" %
          (f1["kills"], pct(f1.get("max_dev")), pct(f1.get("final_dev")),
           pct(f1.get("max_dev_smooth10")), pct(f1.get("eval_dev"))))
    if cc:
        w("| same, 3 cascading failures %s | **%s** (final step %s; 10-step running mean %s; "
          "held-out eval %s) | <= 0.54%% |"
          % (cc["kills"], pct(cc.get("max_dev")), pct(cc.get("final_dev")),
             pct(cc.get("max_dev_smooth10")), pct(cc.get("eval_dev"))))
    lff = R.get(lc3 + "_ff")
    full_state = None
    if a and a.get("bytes_committed") and a.get("steps_reported"):
        full_state = a["bytes_committed"] / a["steps_reported"]
    if lff and lff.get("bytes_committed") and full_state:
        all_eq = full_state * n
        w("| bytes written, LayerCheck K0=1e-3 vs `all` (%d failure-free steps) | **%.1fx fewer** "
          "(%s vs %s; layer writes %s vs %s) | >= 5x |" %
          (n, all_eq / lff["bytes_committed"], human_bytes(lff["bytes_committed"]),
           human_bytes(all_eq), lff["versions_committed"],
           int(round(a["versions_committed"] * n / a["steps_reported"]))))
    ts = R.get("torchsave_every_step")
    if lff and ts and lff.get("bytes_committed"):
        w("| bytes written, LayerCheck K0=1e-3 vs torch.save every step | **%.1fx fewer** "
          "(%s vs %s) | - |" % (ts["bytes"] / lff["bytes_committed"],
                                human_bytes(lff["bytes_committed"]), human_bytes(ts["bytes"])))
    if lff and ts and lff["stall_s"].get("n"):
        w("| trainer-visible stall per step, LayerCheck K0=1e-3 (fence + StepDone) vs "
          "torch.save every step (save call) | **%.0fx less** (%.2f ms vs %.1f ms; with fsync "
          "%.1f ms) | >= 10x |" %
          (ts["stall_per_step_mean"] / lff["stall_s"]["mean"], 1e3 * lff["stall_s"]["mean"],
           1e3 * ts["stall_per_step_mean"], 1e3 * ts["stall_fsync_per_step_mean"]))
    if a and ts and a["stall_s"].get("n"):
        w("| same for policy `all` | **%.0fx less** (%.2f ms vs %.1f ms) | - |" %
          (ts["stall_per_step_mean"] / a["stall_s"]["mean"], 1e3 * a["stall_s"]["mean"],
           1e3 * ts["stall_per_step_mean"]))
    inv = [(nm, x) for nm, x in R.items() if x.get("policy") == "layercheck"]
    if inv:
        broken = [nm for nm, x in inv if (x.get("trace_invariant_violations") or 0) > 0 or
                  (x.get("metric_invariant_violations") or 0) > 0 or
                  (x.get("invariant_log_lines") or 0) > 0]
        w("| staleness invariant (no layer's newest selected version >= S_max = %d steps old) | "
          "**%s** over %d LayerCheck runs (trace check + `ckpt_staleness_invariant_violations_total`"
          " + ckptd log) | never broken |" %
          (c["s_max"], "never broken" if not broken else "BROKEN in " + ", ".join(broken),
           len(inv)))
    w("")

    # ---- per-run table
    w("## All runs")
    w("")
    w("| run | policy | failures after | restore targets | complete | bit-exact vs ff | max dev "
      "| final dev | eval dev | bytes committed | layer writes | stall/step mean (p95) | wall |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        x = R.get(name, {})
        if r.get("kind") == "plain":
            w("| %s | none (torch.save every %d) | - | - | %s | %s | - | - | - | %s (torch.save) | - "
              "| save %.1f ms (%.1f ms) | %.0f s |" %
              (name, r["save_every"], "yes" if x.get("steps") == n else "no",
               "reference" if name == "ff" else ("yes" if A.get("torchsave_bitexact") else "no"),
               human_bytes(x.get("bytes")), 1e3 * (x.get("save_s", {}).get("mean") or 0),
               1e3 * (x.get("save_s", {}).get("p95") or 0), r.get("wall_s", 0)))
            continue
        st = x.get("stall_s", {})
        w("| %s | %s%s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f s |" %
          (name, r["policy"], lc_label(r.get("layercheck")), r["kills"] or "-",
           [z["target_step"] for z in x.get("restores", [])] or "-",
           "yes" if x.get("complete") else "NO", "yes" if x.get("bitexact") else
           "no (%d of %d differ)" % (x.get("mismatches", 0), x.get("steps_compared", 0)),
           pct(x.get("max_dev")), pct(x.get("final_dev")), pct(x.get("eval_dev")),
           human_bytes(x.get("bytes_committed")), x.get("versions_committed"),
           "%.2f ms (%.2f)" % (1e3 * st["mean"], 1e3 * st["p95"]) if st.get("n") else "-",
           r.get("wall_s", 0)))
    w("")
    errs = [(nm, r.get("error")) for nm, r in runs.items() if r.get("error")]
    if errs:
        w("**Errors:**")
        w("")
        for nm, e in errs:
            w("- `%s`: `%s`" % (nm, e.strip().replace("\n", " | ")[:1500]))
        w("")

    # ---- figures
    if figs.get("loss_all"):
        w("## Policy `all`: bit-exact recovery")
        w("")
        w("![loss all](%s)" % figs["loss_all"])
        w("")
        if a:
            w("The killed process's own steps equal the failure-free run: %s. Restore: %s." %
              ("yes" if a["segment0_bitexact_vs_ff"] else "NO",
               "; ".join("target %d, %s in %.2f s, max staleness %s" %
                         (r["target_step"], human_bytes(r["bytes_restored"]), r["seconds"],
                          r["max_staleness"]) for r in a["restores"])))
            w("")
    if figs.get("loss_layercheck"):
        w("## LayerCheck: loss after composite recovery")
        w("")
        w("![loss layercheck](%s)" % figs["loss_layercheck"])
        w("")
        w("| K0 | failure-free layer writes | bytes | vs `all` | failure step (max SWS) | "
          "1 failure: max / final / eval dev | 3 failures: max / final / eval dev | "
          "restore max staleness | LC ff == plain ff |")
        w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for k0 in c["k0s"]:
            tag = "lc_%s" % fmt_k0(k0)
            xf, x1, x3 = R.get(tag + "_ff", {}), R.get(tag + "_fail1", {}), R.get(tag + "_cascade", {})
            ratio = ("%.1fx fewer" % (full_state * n / xf["bytes_committed"])
                     if full_state and xf.get("bytes_committed") else "n/a")
            w("| %s | %s | %s | %s | %s (SWS %s) | %s / %s / %s | %s / %s / %s | %s | %s |" %
              (fmt_k0(k0), xf.get("versions_committed"), human_bytes(xf.get("bytes_committed")),
               ratio, xf.get("max_sws_step"),
               human_bytes(xf.get("max_sws")) + "-steps" if xf.get("max_sws") else "n/a",
               pct(x1.get("max_dev")), pct(x1.get("final_dev")), pct(x1.get("eval_dev")),
               pct(x3.get("max_dev")), pct(x3.get("final_dev")), pct(x3.get("eval_dev")),
               [r["max_staleness"] for r in x1.get("restores", []) + x3.get("restores", [])],
               "yes" if xf.get("bitexact") else "NO"))
        w("")
        w("Deviation = |loss - failure-free loss| / failure-free loss on the same batch and "
          "dropout mask (RNG restored), over the steps after the first restore; *eval dev* is "
          "the same for the held-out loss (%d batches of held-out man pages) at the end." %
          c["eval_batches"])
        w("")
    write_variants_section(w, out_dir, c, n, runs, R)
    if figs.get("bytes"):
        w("## Bytes written")
        w("")
        w("![bytes](%s)" % figs["bytes"])
        w("")
        if full_state:
            w("Full state (weights + exp_avg + exp_avg_sq) per step as ckptd writes it: %s; "
              "torch.save file per save: %s. The `all` bar is the measured bytes per reported "
              "step of the `all` run (which re-executes %d steps after its restore) times %d." %
              (human_bytes(full_state), human_bytes((R.get("torchsave_every_step") or {})
                                                    .get("bytes_per_save")),
               a["steps_reported"] - n, n))
            w("")
    if figs.get("stall"):
        w("## Trainer-visible stall per step")
        w("")
        w("![stall](%s)" % figs["stall"])
        w("")
        w("| run | stall mean | p50 | p95 | max | fence wait mean | StepDone mean | "
          "optimizer.step (wrapped) mean | fwd+bwd mean |")
        w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, x in R.items():
            if x.get("stall_s", {}).get("n"):
                s = x["stall_s"]
                w("| %s | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %.1f ms | "
                  "%.0f ms |" % (name, 1e3 * s["mean"], 1e3 * s["p50"], 1e3 * s["p95"],
                                 1e3 * s["max"], 1e3 * x["fence_s"].get("mean", 0),
                                 1e3 * x["step_done_s"]["mean"], 1e3 * x["opt_s"]["mean"],
                                 1e3 * x["fb_s"]["mean"]))
        for name in ("torchsave_every_step", "ff"):
            x = R.get(name)
            if x and x["saves"]:
                s, sf = x["save_s"], x["save_fsync_s"]
                w("| %s (torch.save every %d; per save) | %.1f ms | %.1f ms | %.1f ms | %.1f ms | "
                  "with fsync: mean %.1f ms, p95 %.1f ms | - | %.1f ms | %.0f ms |" %
                  (name, x["save_every"], 1e3 * s["mean"], 1e3 * s["p50"], 1e3 * s["p95"],
                   1e3 * s["max"], 1e3 * sf["mean"], 1e3 * sf["p95"], 1e3 * x["opt_s"]["mean"],
                   1e3 * x["fb_s"]["mean"]))
        w("")
        w("ckptd stall = `fence_wait_s` + `step_done_s` from `h.stats()` (the trainer-side "
          "cost of the protocol; the aux pickling inside the wrapped `optimizer.step` is not in "
          "it, the *optimizer.step (wrapped)* column includes it). torch.save stall = the "
          "`torch.save` call (and separately the `fsync` that makes it durable). The machine "
          "is a shared 2-core VM: absolute times swing, ratios are within one run.")
        w("")
    if figs.get("staleness"):
        w("## Staleness at restore")
        w("")
        w("![staleness](%s)" % figs["staleness"])
        w("")
        for name, x in R.items():
            for r in x.get("restores", []):
                if x["policy"] != "layercheck":
                    continue
                w("- `%s` restore to %d: max staleness %s, size-weighted %.2f, %s in %.2f s; per "
                  "layer %s" % (name, r["target_step"], r["max_staleness"],
                                r.get("size_weighted_staleness") or 0,
                                human_bytes(r["bytes_restored"]), r["seconds"],
                                ", ".join("%s:%d" % (L_["name"], L_["staleness"])
                                          for L_ in r["layers"])))
        w("")
    if figs.get("drift"):
        w("## Drift and persistence (failure-free LayerCheck traces)")
        w("")
        w("![drift](%s)" % figs["drift"])
        w("")
    if figs.get("sws"):
        w("![sws](%s)" % figs["sws"])
        w("")
    w("## Staleness invariant")
    w("")
    w("| run | trace: max age of a layer's newest selected version | trace violations (>= S_max) "
      "| metric violations | ckptd log lines | trace registrations | snapshots skipped |")
    w("| --- | --- | --- | --- | --- | --- | --- |")
    for name, x in R.items():
        if x.get("policy") == "layercheck":
            w("| %s | %s | %s | %s | %s | %s | %s |" %
              (name, x.get("trace_max_selected_staleness"), x.get("trace_invariant_violations"),
               x.get("metric_invariant_violations"), x.get("invariant_log_lines"),
               x.get("trace_registrations"), x.get("snapshots_skipped")))
    w("")
    w("After a restore the trace check starts each layer at the step of its restored version "
      "(from the plan).")
    w("")
    obs = []
    for name, x in R.items():
        if x.get("trace_late_lines"):
            obs.append("`%s`: %d drift.jsonl step lines of a registration were written after the "
                       "next registration's header (the trace is buffered per registration)"
                       % (name, x["trace_late_lines"]))
        if x.get("trace_unassigned_lines"):
            obs.append("`%s`: %d drift.jsonl step lines match no step a trainer reported"
                       % (name, x["trace_unassigned_lines"]))
        if x.get("trace_writes_per_step_before_after"):
            b_, a_ = x["trace_writes_per_step_before_after"]
            obs.append("`%s`: layer writes per step before the first failure %.2f, after restores "
                       "(excluding each registration's first step) %.2f" % (name, b_, a_))
        if x.get("trace_glued_lines"):
            obs.append("`%s`: %d drift.jsonl line(s) held two JSON objects (a step line flushed "
                       "without its newline, then the next registration's header)"
                       % (name, x["trace_glued_lines"]))
        if x.get("trace_torn"):
            obs.append("`%s`: %d unparsable drift.jsonl lines" % (name, x["trace_torn"]))
        if x.get("errors_logged"):
            obs.append("`%s`: %s" % (name, x["errors_logged"]))
        if x.get("trace_header_config") and name.endswith("_ff"):
            obs.append("`%s`: trace header config %s" % (name, json.dumps(x["trace_header_config"])))
    rp = [(nm, x) for nm, x in R.items() if x.get("replay_spec")]
    if rp:
        w("## LayerCheck decisions replayed against SPEC section 4")
        w("")
        w("Every step's persist set in `drift.jsonl` is recomputed in Python from the trace's "
          "drift vector and LR with SPEC section 4's rules, lr_ref in place of lr_0 (persist when never persisted, when "
          "t - t_l >= S_max, or when the accumulated drift D >= max(K0 lr_t / lr_ref, K_floor), "
          "lr_ref the largest LR so far). *spec*: lr_ref spans the job's registrations and, after "
          "a restore, each layer resumes from its restored version with D = 0. *fresh*: every "
          "registration starts over (lr_ref from its own steps, every layer never persisted), "
          "the behaviour of ckptd before commit 9705e3b.")
        w("")
        w("| run | registrations | steps matching *spec* | steps matching *fresh* | first *spec* "
          "mismatch (registration, step, replay, ckptd) |")
        w("| --- | --- | --- | --- | --- |")
        for nm, x in rp:
            sp, fr = x["replay_spec"], x.get("replay_fresh_registration")
            w("| %s | %s | %d / %d | %s | %s |" %
              (nm, x.get("trace_registrations"), sp["match"], sp["total"],
               "%d / %d" % (fr["match"], fr["total"]) if fr else "(same)",
               sp["first_mismatch"] or "-"))
        w("")
        after = [(nm, x) for nm, x in rp if x.get("trace_after_restore_first_persist")]
        if after:
            w("First step after each restore (step, layers persisted): %s." %
              "; ".join("`%s` %s" % (nm, x["trace_after_restore_first_persist"])
                        for nm, x in after))
            w("")
        late = sum(x.get("trace_late_lines", 0) for _, x in R.items())
        glued = sum(x.get("trace_glued_lines", 0) for _, x in R.items())
        if late or glued:
            w("`drift.jsonl` was not flushed per line: %d step lines of a registration landed "
              "after the next registration's header and %d lines held a step record glued to "
              "that header (the parser here splits them and assigns steps by the ranges the "
              "trainers reported). Reproduction: `tests/fidelity/repro_layercheck_restore.py`."
              % (late, glued))
            w("")
    if obs:
        w("## Observations from the traces")
        w("")
        for o in obs:
            w("- " + o)
        w("")
    if "figure_error" in A:
        w("Figures: " + A["figure_error"])
        w("")
    w("Raw data: `results.json`, trainer logs in `logs/` (JSON lines per step), drift traces in "
      "`traces/`, ckptd logs in `logs/*.ckptd.log`.")
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    with open(os.path.join(out_dir, "analysis.json"), "w") as f:
        json.dump({k: v for k, v in A.items()}, f, indent=1, default=str)
    return A


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke run)")
    ap.add_argument("--out", default=None, help="output dir (default docs/fidelity, or "
                    "BUILD/fidelity-quick with --quick)")
    ap.add_argument("--steps", type=int, default=0, help="fine-tuning steps per run "
                    "(default: from the config, reduced to fit --budget-min)")
    ap.add_argument("--budget-min", type=float, default=0, help="time budget for sizing steps")
    ap.add_argument("--build", default=os.path.join(REPO, "build"),
                    help="build dir with daemon/ckptd, tools/ckptctl, python/ckpt")
    ap.add_argument("--tmp", default=None, help="parent of the per-run temp dirs")
    ap.add_argument("--report-only", action="store_true", help="rewrite report from results.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with open(args.worker) as f:
            w = json.load(f)
        {"pretrain": worker_pretrain, "finetune": worker_finetune}[w["kind"]](w)
        return
    if args.out is None:
        args.out = (os.path.join(args.build, "fidelity-quick") if args.quick else
                    os.path.join(REPO, "docs", "fidelity"))
    args.command_line = " ".join(shlex.quote(a) for a in [os.path.relpath(
        os.path.abspath(sys.argv[0]), REPO)] + sys.argv[1:])
    if args.report_only:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
        results["rendered"] = {"command": args.command_line,
                               "at": datetime.datetime.now().isoformat(timespec="seconds")}
        write_report(os.path.abspath(args.out), results)
        log("report rewritten: %s" % os.path.join(args.out, "report.md"))
        return
    exp = Experiment(args)
    if args.budget_min:
        exp.cfg["budget_min"] = args.budget_min
    log("ckpt fidelity experiment (%s), out %s, tmp %s" % (exp.cfg["name"], exp.out, exp.tmp_root))
    try:
        exp.run_all()
    finally:
        shutil.rmtree(exp.tmp_root, ignore_errors=True)
        exp.results.setdefault("wall_s", time.time() - exp.t_start)
        exp.save_results()
        write_report(exp.out, exp.results)
        log("report: %s (wall %.1f min)" % (os.path.join(exp.out, "report.md"),
                                             (time.time() - exp.t_start) / 60))


if __name__ == "__main__":
    main()
