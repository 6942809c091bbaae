#!/usr/bin/env python3
"""ckptd's DCP backend side by side with DCP's own savers, in one run, on the
same model, loop and disk.

  tests/perf/dcp_compare.py                       # 10M model, full and LoRA fine-tune
  tests/perf/dcp_compare.py --smoke               # a tiny model; asserts outcomes (ctest)
  tests/perf/dcp_compare.py --report docs/dcp-comparison.md --plots-dir docs/plots

Options: --size (a preset of compare_torch.py: tiny, 10M, 100M, ...),
--steps S and --every N (a save every N steps, the last step is one),
--kinds full,lora, --methods, --out DIR (results.json), --data-dir DIR,
--build-dir DIR, --threads, --tokens.

Methods, each trained in a fresh process and restored in another:
  none         the loop without saves (the baseline)
  ckptd_dcp    dcp.async_save(storage_writer=ckpt.dcp.CkptWriter(async_staging=True))
               (THREAD)
  dcp_zoc      DCP's zero-overhead configuration: DefaultStager with
               StagingOptions(pinned, shared memory, async staging,
               non-blocking copy) and the PROCESS executor, FileSystemWriter
               (without a GPU: shared memory and async staging, as DCP
               allows pinned memory and non-blocking copies only with one)
  dcp_async    dcp.async_save with its defaults (THREAD, FileSystemWriter)
  ckpt_torch   ckpt.torch.attach, policy `all`: every layer at every step
Every async saver waits for the previous save before the next, as
torchtitan does; ckptd_dcp and dcp_zoc, which stage on a thread, wait for
the staging before the next optimizer step (torchtitan's
maybe_wait_for_staging). Meta's
torch_checkpointing is not in this environment and not compared.

Figures per method: blocked (seconds the loop spends in save calls and
staging waits, per save); window (the median time of the steps that run,
at least in part, while a save is written in the background, over the
baseline's median step: the slowdown the background write causes);
durable (seconds from the save call to its future's completion:
FileSystemWriter fsyncs each file, ckptd fsyncs and commits its index); restore (a new process loads the last checkpoint into
a model of other weights, bit-exact or not); extra memory (the trainer's
peak RSS over the baseline's, and the side process's peak: ckptd, DCP's
checkpoint process); bytes per save (what the savers wrote to storage,
/proc/PID/io write_bytes, over the saves, and what a save after the
first added: sampled as each save completes). The LoRA kind freezes the model
and trains rank-8 adapters (peft) on every Linear.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402

METHODS = ["none", "ckptd_dcp", "dcp_zoc", "dcp_async", "ckpt_torch"]
LABELS = {"none": "no checkpoint", "ckptd_dcp": "ckptd DCP backend (async_save)",
          "dcp_zoc": "DCP zero-overhead (pinned, shm, process)",
          "dcp_async": "DCP async_save (defaults)", "ckpt_torch": "ckpt.torch (every step)"}


def build(spec):
    model, opt = ct.build(spec["size"], spec["seed"], 1e-3)
    if spec["kind"] == "lora":
        import torch
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16,
                                                 target_modules=["fc1", "fc2"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def state_of(model, opt):
    return ct.dcp_state(model, opt)


class Saves:
    """The saves of one DCP method: calls, staging waits, completions."""

    def __init__(self, spec):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.m, self.spec = spec["method"], spec
        self.writer = None
        if self.m == "ckptd_dcp":
            from ckpt.dcp import CkptWriter
            self.writer = CkptWriter(spec["job"], spec["socket"], async_staging=True)
        # Pinned memory and non-blocking copies need a GPU (DefaultStager
        # refuses non-blocking copies without one); shared memory and the
        # staging thread apply everywhere.
        import torch
        gpu = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(gpu, True, True, gpu)) \
            if self.m == "dcp_zoc" else None
        self.pending = self.staging = None
        self.start, self.done, self.blocked, self.written = {}, {}, {}, {}

    def write_bytes(self):
        """Bytes sent to storage so far by the savers: this process, its
        children (DCP's checkpoint process) and ckptd."""
        pids = ct.descendants() + ([self.spec["daemon_pid"]] if "daemon_pid" in self.spec else [])
        return ct.write_bytes() + sum(ct.write_bytes(p) for p in pids)

    def cid(self, step):
        return os.path.join(self.spec["ckpt_dir"], "step-%d" % step)

    def before_optimizer_step(self, step):
        if self.staging is None:
            return 0.0
        t0 = time.monotonic()
        s, fut = self.staging
        fut.result()
        self.staging = None
        self.blocked[s] += time.monotonic() - t0
        return time.monotonic() - t0

    def save(self, step, model, opt):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        t0 = time.monotonic()
        self.wait_pending()
        self.start[step] = t0
        kw = {"checkpoint_id": self.cid(step)}
        if self.writer is not None:
            kw["storage_writer"] = self.writer
        if self.stager is not None:
            kw.update(async_stager=self.stager,
                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        out = dcp.async_save(state_of(model, opt), **kw)
        if hasattr(out, "upload_completion"):
            self.staging = (step, out.staging_completion)
            out = out.upload_completion

        def record(_, step=step):
            self.done[step] = time.monotonic()
            self.written[step] = self.write_bytes()
        out.add_done_callback(record)
        self.pending = out
        self.blocked[step] = time.monotonic() - t0
        return self.blocked[step]

    def wait_pending(self):
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self):
        self.wait_pending()
        if self.stager is not None:
            self.stager.close()
        if self.writer is not None:
            self.writer.close()


def worker(spec):
    import torch
    torch.set_num_threads(spec["threads"])
    m, steps, every = spec["method"], spec["steps"], spec["every"]
    if m.startswith("dcp") or m == "ckptd_dcp":
        ct.init_gloo(spec["tmp"])
    model, opt = build(spec)
    wb0 = ct.write_bytes()
    saves = run = None
    if m == "ckpt_torch":
        import ckpt
        from ckpt import torch as ckpt_torch
        run = ckpt_torch.attach(model, opt, ckpt.Client(spec["socket"]), job_id=spec["job"])
    elif m != "none":
        saves = Saves(spec)
    step_s, step_end, blocked = [], [], []
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        idx = ct.batch(spec["size"], step, spec["tokens"], spec["seed"])
        loss = ct.train_step(model, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if saves is not None:
            saves.before_optimizer_step(step)
        t_opt = time.monotonic()
        opt.step()
        if run is not None:
            blocked.append(time.monotonic() - t_opt)  # fence + StepDone inside the hooks
        if saves is not None and step % every == 0:
            saves.save(step, model, opt)
        t1 = time.monotonic()
        step_s.append(t1 - t0)
        step_end.append(t1)
    res = {"method": m, "step_s": step_s, "step_end": step_end}
    if saves is not None:
        saves.close()
        res.update(start={str(k): v for k, v in saves.start.items()},
                   done={str(k): v for k, v in saves.done.items()},
                   blocked=[saves.blocked[s] for s in sorted(saves.blocked)],
                   written={str(k): v for k, v in saves.written.items()},
                   last=saves.cid(max(saves.start)))
    if run is not None:
        run.wait_durable()
        res["blocked"] = blocked[1:]  # the first step registers
        run.close()
    res["vm_hwm"] = ct.proc_status()["VmHWM"]
    kids = ct.descendants()
    res["side_hwm"] = max([ct.proc_status(p).get("VmHWM", 0) for p in kids] or [0])
    res["write_bytes"] = ct.write_bytes() - wb0 + sum(ct.write_bytes(p) for p in kids)
    res["digests"] = ct.digests(model, opt)
    if m == "dcp_zoc":
        sys.path.insert(0, os.path.join(HERE, "..", "integration"))
        import harness
        harness.stop_dcp_process()
    with open(spec["result"], "w") as f:
        json.dump(res, f)


def restorer(spec):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    torch.set_num_threads(spec["threads"])
    m = spec["method"]
    spec = dict(spec, seed=spec["seed"] + 1)  # other weights
    if m != "ckpt_torch":
        ct.init_gloo(spec["tmp"])
    model, opt = build(spec)
    if m == "ckpt_torch":
        import ckpt
        from ckpt import torch as ckpt_torch
        run = ckpt_torch.attach(model, opt, ckpt.Client(spec["socket"]), job_id=spec["job"])
        t0 = time.monotonic()
        run.restore()
        took = time.monotonic() - t0
        run.close(drain=False)
    else:
        # AdamW's state must exist to be loaded into: one step at lr 0.
        for g in opt.param_groups:
            g["lr"] = 0.0  # the load sets it back
        ct.train_step(model, ct.batch(spec["size"], 1, 8, 0)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.monotonic()
        sd = state_of(model, opt)
        kw = {"checkpoint_id": spec["last"]}
        if m == "ckptd_dcp":
            from ckpt.dcp import CkptReader
            kw["storage_reader"] = CkptReader(spec["job"], spec["socket"])
        dcp.load(sd, **kw)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        took = time.monotonic() - t0
    with open(spec["digests"]) as f:
        want = json.load(f)
    got = ct.digests(model, opt)
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    with open(spec["result"], "w") as f:
        json.dump({"restore_s": took, "bitexact": not bad, "mismatches": bad[:5]}, f)


def child(args, mode, spec):
    path = os.path.join(spec["tmp"], "%s.json" % mode)
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build_dir, "python"),
               CKPT_BUILD_DIR=args.build_dir, MALLOC_MMAP_THRESHOLD_="1048576",
               OMP_WAIT_POLICY="PASSIVE", MASTER_ADDR="127.0.0.1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_" + mode, path],
                         env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError("%s %s failed (%d):\n%s%s" % (mode, spec["method"], out.returncode,
                                                         out.stdout[-3000:], out.stderr[-6000:]))
    with open(spec["result"]) as f:
        return json.load(f)


def one(args, harness, kind, method, state_bytes):
    tmp = tempfile.mkdtemp(prefix="d-%s-" % method, dir=args.data_dir)
    spec = dict(method=method, kind=kind, size=args.size, steps=args.steps, every=args.every,
                seed=1, tokens=args.tokens, threads=args.threads, tmp=tmp,
                job="cmp-%s-%s" % (kind, method), ckpt_dir=os.path.join(tmp, "ckpt"),
                result=os.path.join(tmp, "train.json"))
    daemon = None
    try:
        if method in ("ckptd_dcp", "ckpt_torch"):
            pool = max(64 << 20, int(state_bytes * 1.25) + (8 << 20))
            daemon = harness.Daemon(os.path.join(tmp, "ckptd"), pool_bytes=pool,
                                    extra=["--keep_last_events=2", "--keep_every_steps=0",
                                           "--gc_interval_s=1"]).start()
            spec["socket"] = daemon.socket
            spec["daemon_pid"] = daemon.proc.pid
            io0 = ct.write_bytes(daemon.proc.pid)
        rec = child(args, "worker", spec)
        if daemon is not None:
            rec["write_bytes"] += ct.write_bytes(daemon.proc.pid) - io0
            rec["side_hwm"] = ct.proc_status(daemon.proc.pid).get("VmHWM", 0)
        if method != "none":
            dig = os.path.join(tmp, "digests.json")
            with open(dig, "w") as f:
                json.dump(rec.pop("digests"), f)
            ct.evict(daemon.data if daemon is not None else spec["ckpt_dir"])
            rec["restore"] = child(args, "restorer", dict(
                spec, result=os.path.join(tmp, "restore.json"), digests=dig,
                last=rec.get("last")))
        rec.pop("digests", None)
        return rec
    finally:
        if daemon is not None:
            daemon.stop(timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def summarize(rec, base_step, base_hwm, saves):
    med = ct.median
    out = {"method": rec["method"], "step_p50_s": med(rec["step_s"][1:])}
    out["hwm_extra"] = rec["vm_hwm"] - base_hwm if base_hwm else None
    out["side_hwm"] = rec.get("side_hwm") or None
    if rec["method"] == "none":
        return out
    out["blocked_p50_s"] = med(rec["blocked"][1:] or rec["blocked"])
    n_saves = saves if rec["method"] != "ckpt_torch" else len(rec["step_s"])
    out["bytes_per_save"] = rec["write_bytes"] / max(n_saves, 1)
    # After the first save: what each later save added (ckptd writes a
    # tensor again only when its bytes changed).
    written = sorted((int(k), v) for k, v in rec.get("written", {}).items())
    later = [b - a for (_, a), (_, b) in zip(written, written[1:])]
    out["bytes_later_save"] = med(later)
    start = {int(k): v for k, v in rec.get("start", {}).items()}
    done = {int(k): v for k, v in rec.get("done", {}).items()}
    out["durable_p50_s"] = med([done[s] - start[s] for s in start if s in done])
    # Steps that run, at least in part, while a save is written in the
    # background: between the save call's return and its completion.
    ends, blocked = rec["step_end"], dict(zip(sorted(start), rec["blocked"]))
    window = [rec["step_s"][i] for i, t in enumerate(ends)
              if any(t > start[s] + blocked.get(s, 0) and t - rec["step_s"][i] < done.get(s, 0)
                     for s in start)]
    out["window_steps"] = len(window)
    out["window_ratio"] = med(window) / base_step if window and base_step else None
    rs = rec.get("restore", {})
    out["restore_s"], out["bitexact"] = rs.get("restore_s"), rs.get("bitexact")
    return out


def run_all(args, harness):
    import torch  # noqa: F401 - the parent measures the state's size
    doc = {"meta": {"argv": sys.argv, "machine": harness.machine(HERE), "size": args.size,
                    "steps": args.steps, "every": args.every}, "kinds": {}}
    for kind in args.kinds:
        spec = dict(size=args.size, seed=1, kind=kind)
        model, opt = build(spec)
        ct.train_step(model, ct.batch(args.size, 1, 8, 0)).backward()
        opt.step()
        state = ct.state_bytes(model, opt)
        del model, opt
        recs = {m: one(args, harness, kind, m, state) for m in args.methods}
        base = recs.get("none")
        base_step = ct.median(base["step_s"][1:]) if base else None
        rows = [summarize(r, base_step, base["vm_hwm"] if base else None,
                          args.steps // args.every) for r in recs.values()]
        doc["kinds"][kind] = {"state_bytes": state, "rows": rows}
    return doc


# ---------------------------------------------------------------- report

def fmt(x, unit=""):
    if x is None:
        return "-"
    if unit == "s":
        return "%.3f s" % x if x >= 0.01 else "%.1f ms" % (x * 1e3)
    if unit == "B":
        return ct.human_bytes(x)
    if unit == "x":
        return "%.2f" % x
    return str(x)


def ratio_lines(doc):
    """ckptd's DCP backend over DCP's zero-overhead configuration."""
    out = []
    for kind, k in doc["kinds"].items():
        by = {r["method"]: r for r in k["rows"]}
        a, b = by.get("ckptd_dcp"), by.get("dcp_zoc")
        if not (a and b):
            continue
        for key, what in (("blocked_p50_s", "blocked per save"),
                          ("window_ratio", "window step time over baseline"),
                          ("durable_p50_s", "time until durable"),
                          ("restore_s", "restore"), ("bytes_per_save", "bytes written per save"),
                          ("bytes_later_save", "bytes a later save adds")):
            if a.get(key) and b.get(key):
                out.append("- %s, %s: ckptd %s, DCP zero-overhead %s: ratio %.2f" % (
                    kind, what, fmt(a[key], "B" if "bytes" in key else
                                    "x" if "ratio" in key else "s"),
                    fmt(b[key], "B" if "bytes" in key else "x" if "ratio" in key else "s"),
                    a[key] / b[key]))
    return out


def table(doc):
    lines = []
    for kind, k in doc["kinds"].items():
        lines += ["", "### %s fine-tune (state %s)" % (kind, ct.human_bytes(k["state_bytes"])), "",
                  "| method | step p50 | blocked / save | window / baseline | durable | "
                  "restore | bit-exact | extra peak RSS | side peak | bytes / save | a later save |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in k["rows"]:
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                LABELS[r["method"]], fmt(r["step_p50_s"], "s"), fmt(r.get("blocked_p50_s"), "s"),
                fmt(r.get("window_ratio"), "x"), fmt(r.get("durable_p50_s"), "s"),
                fmt(r.get("restore_s"), "s"), fmt(r.get("bitexact")),
                fmt(r.get("hwm_extra"), "B"), fmt(r.get("side_hwm"), "B"),
                fmt(r.get("bytes_per_save"), "B"), fmt(r.get("bytes_later_save"), "B")))
    return lines


def plot(doc, plots_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(plots_dir, exist_ok=True)
    kinds = list(doc["kinds"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, (("blocked_p50_s", "blocked per save (s)"),
                                       ("window_ratio", "window step / baseline step"),
                                       ("bytes_later_save", "bytes a later save adds (MiB)"))):
        for i, kind in enumerate(kinds):
            rows = [r for r in doc["kinds"][kind]["rows"] if r["method"] != "none"]
            vals = [(r.get(key) or 0) / (2**20 if "bytes" in key else 1) for r in rows]
            xs = [j + i * 0.4 for j in range(len(rows))]
            ax.bar(xs, vals, width=0.4, label=kind)
            ax.set_xticks([j + 0.2 for j in range(len(rows))])
            ax.set_xticklabels([r["method"] for r in rows], rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(plots_dir, "dcp-comparison.png")
    fig.savefig(path, dpi=110)
    return path


def smoke_checks(doc):
    for kind, k in doc["kinds"].items():
        for r in k["rows"]:
            if r["method"] != "none":
                if r.get("bitexact") is not True:
                    raise AssertionError("%s %s restored other bytes" % (kind, r["method"]))
                print("ok: %s %s restores bit-exact" % (kind, r["method"]))
    # A LoRA save writes the adapters, not the frozen base again. (Against
    # DCP's bytes only on a real model: every ckptd version is a file of at
    # least 8 KiB, so the tiny model's small tensors cost more than DCP's
    # one file per rank.)
    rows = {kind: {r["method"]: r for r in k["rows"]} for kind, k in doc["kinds"].items()}
    if "ckptd_dcp" in rows.get("full", {}) and "ckptd_dcp" in rows.get("lora", {}):
        full, lora = (rows[k]["ckptd_dcp"]["bytes_per_save"] for k in ("full", "lora"))
        if not lora < full:
            raise AssertionError("ckptd wrote %d bytes per LoRA save, %d per full one"
                                 % (lora, full))
        print("ok: ckptd writes %s per LoRA save, %s per full save"
              % (ct.human_bytes(lora), ct.human_bytes(full)))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="10M")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kinds", default="full,lora")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--report")
    p.add_argument("--plots-dir")
    p.add_argument("--data-dir")
    p.add_argument("--build-dir", default=os.environ.get("CKPT_BUILD_DIR",
                                                         os.path.join(TOP, "build")))
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--smoke", action="store_true")
    for mode in ("worker", "restorer"):
        p.add_argument("--_" + mode, dest=mode)
    a = p.parse_args()
    if a.smoke:
        a.size, a.steps, a.every, a.tokens = "tiny", 6, 3, 16
    a.kinds = a.kinds.split(",")
    a.methods = a.methods.split(",")
    if "none" in a.methods:
        a.methods = ["none"] + [m for m in a.methods if m != "none"]
    a.build_dir = os.path.abspath(a.build_dir)
    return a


def main():
    a = parse()
    for mode, fn in (("worker", worker), ("restorer", restorer)):
        if getattr(a, mode):
            with open(getattr(a, mode)) as f:
                fn(json.load(f))
            return
    sys.path.insert(0, os.path.join(HERE, "..", "integration"))
    sys.path.insert(0, os.path.join(a.build_dir, "python"))
    import harness
    if not os.path.exists(harness.CKPTD):
        print("skipping: no ckptd at %s" % harness.CKPTD)
        sys.exit(77)
    own_dir = a.data_dir is None
    a.data_dir = a.data_dir or tempfile.mkdtemp(prefix="ckpt-dcpcmp-")
    try:
        doc = run_all(a, harness)
    finally:
        if own_dir:
            shutil.rmtree(a.data_dir, ignore_errors=True)
    lines = table(doc) + [""] + ratio_lines(doc)
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(doc, f, indent=1)
    if a.smoke:
        smoke_checks(doc)
    if a.report:
        png = plot(doc, a.plots_dir or os.path.join(os.path.dirname(a.report), "plots"))
        with open(a.report + ".tables", "w") as f:
            f.write("\n".join(lines + ["", "![](%s)" % os.path.relpath(
                png, os.path.dirname(a.report)), ""]))
        print("tables for the report: %s.tables; plot: %s" % (a.report, png))


if __name__ == "__main__":
    main()
