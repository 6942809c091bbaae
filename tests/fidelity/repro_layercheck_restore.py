#!/usr/bin/env python3
"""Minimal reproduction: LayerCheck state after a composite restore.

A 4-layer model, AdamW, an LR warm-up from 10% to 100% over 5 steps then
constant, policy layercheck (k0=5e-2, s_max=1000, warm-up 0, trace on), so
that no layer reaches its threshold after step 1.
Process A trains 20 steps, prints `ckptctl layers` (threshold per layer) and
SIGKILLs itself; process B attaches, restores, trains 5 steps, prints
`ckptctl layers` again. Then the drift trace is printed.

Expected (README "first step after registration persists every layer
(skipped after a successful Restore)"; the LayerCheck paper's "lr_0 the first step's
learning rate"): step 21 persists only drifted layers (none here), and the
thresholds at the same LR are the same before and after the restore.

Exits 1 (FAIL) when any of the three expectations is broken, 0 (PASS) else.

Observed with ckptd 27540ab (fixed by 9705e3b): step 21 persists
all 4 layers; `ckptctl layers` shows threshold 5.00e-01 before the kill and
5.00e-02 after the restore at the same lr 1e-3 (lr_0 is re-taken from the
first step after the restore; the accumulated drift and last-persisted step
also start from zero in the new registration); and in drift.jsonl the second
registration's header comes before the first registration's step lines
(step lines are buffered per registration and flushed when it ends).

    PYTHONPATH=build/python tests/fidelity/repro_layercheck_restore.py [BUILD_DIR]
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BUILD = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--worker"
                        else (sys.argv[1] if len(sys.argv) > 1 else
                              os.path.join(os.path.dirname(__file__), "..", "..", "build")))


THRESHOLDS = {}


def layers_json(sock):
    out = subprocess.run([os.path.join(BUILD, "tools", "ckptctl"), "--socket=" + sock, "--json",
                          "layers", "ft"], capture_output=True, text=True)
    j = json.loads(out.stdout)
    return [(l["name"], l.get("last_step"), "%.2e" % l.get("threshold", float("nan")))
            for l in j["layers"]]


def worker(sock, restore):
    import torch
    import torch.nn as nn
    import ckpt
    from ckpt import torch as ckpt_torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * min(s, 5) / 5)
    h = ckpt_torch.attach(model, opt, ckpt.Client(sock), job_id="ft", policy="layercheck",
                          layercheck=dict(k0=5e-2, s_max=1000, warmup=0), scheduler=sched,
                          record_trace=True)
    start = 1
    if restore:
        restored = h.restore()
        start = restored.target_step + 1
        print("B: restored to step %d; per-layer steps %s" %
              (restored.target_step, [l.step for l in restored.layers]))
    x = torch.randn(64, 32)
    for t in range(start, start + (20 if not restore else 5)):
        y = x
        for b in model.blocks:
            y = torch.tanh(b(y))
        loss = (y - 0.5).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    h.wait_durable()
    time.sleep(0.5)
    print("%s: after step %d (lr %.2e) ckptctl layers (name, last step, threshold): %s" %
          ("B" if restore else "A", h.step, opt.param_groups[0]["lr"], layers_json(sock)))
    print("THRESHOLDS %s %s" % ("B" if restore else "A",
                                json.dumps([t for _, _, t in layers_json(sock)])))
    sys.stdout.flush()
    if not restore:
        os.kill(os.getpid(), signal.SIGKILL)
    h.close()


def main():
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[3], sys.argv[4] == "1")
        return
    root = tempfile.mkdtemp(prefix="repro-lc-")
    sock = os.path.join(root, "run", "ckptd.sock")
    os.makedirs(os.path.dirname(sock))
    d = subprocess.Popen([os.path.join(BUILD, "daemon", "ckptd"), "--socket=" + sock,
                          "--data_dir=" + os.path.join(root, "data"), "--metrics_address=",
                          "--staging_pool_bytes=67108864", "--lock_staging_memory=false"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(sock):
        time.sleep(0.05)
    time.sleep(0.2)
    for restore in ("0", "1"):
        out = subprocess.run([sys.executable, __file__, "--worker", BUILD, sock, restore],
                             stdout=subprocess.PIPE, text=True).stdout
        for line in out.splitlines():
            if line.startswith("THRESHOLDS "):
                _, who, val = line.split(" ", 2)
                THRESHOLDS[who] = json.loads(val)
            else:
                print(line)
    d.send_signal(signal.SIGTERM)
    d.wait()
    print("drift.jsonl in file order (H = header):")
    recs, ok = [], True
    for line in open(os.path.join(root, "data", "jobs", "ft", "rank-00000000", "drift.jsonl")):
        try:
            r = json.loads(line)
        except ValueError:
            print("  unparsable line: %r" % line[:120])
            ok = False
            continue
        recs.append(r)
        print("  H" if "step" not in r else "  step %d lr %.2e persist %s" %
              (r["step"], r["lr"], r["persist"]))
    order = ["H" if "step" not in r else r["step"] for r in recs]
    if order != ["H"] + list(range(1, 21)) + ["H"] + list(range(21, 26)):
        print("FAIL: trace order %s" % order)
        ok = False
    s21 = [r for r in recs if r.get("step") == 21]
    if not s21 or len(s21[0]["persist"]) == 4:
        print("FAIL: step 21 (first after the restore) persisted every layer")
        ok = False
    if THRESHOLDS.get("A") != THRESHOLDS.get("B"):
        print("FAIL: thresholds at lr 1e-3 before/after the restore: %s / %s" %
              (THRESHOLDS.get("A"), THRESHOLDS.get("B")))
        ok = False
    shutil.rmtree(root, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
