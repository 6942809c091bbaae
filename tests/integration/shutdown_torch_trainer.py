"""A ckpt.torch trainer for test_shutdown.py that stops at named points of
the per-step protocol, so the test can stop, kill or restart ckptd exactly
there. The same command line and output as ckpt_shutdown_trainer (C++):

  --pause=POINT:STEP  print "pause POINT STEP", wait for a line on stdin.
                      before_step_done: inside optimizer.step(), after the
                      optimizer ran, before ckpt.torch reports StepDone;
                      before_fence: optimizer.step() of STEP returned; the
                      next one starts with the fence WaitSnapshot(STEP).

Every call that does not simply succeed prints "call ..."; the end prints
"done {json}". Exit codes: 0 trained every step; 3 ckpt.Error UNAVAILABLE
(on_daemon_loss="error": the trainer stops cleanly); anything else is a
failure (an uncaught exception exits 1).

Runs under the interpreter that has torch, with PYTHONPATH=<build>/python.
"""

import argparse
import json
import sys

import torch
import torch.nn as nn

import ckpt
from ckpt import torch as ckpt_torch

STOPPED_ON_LOSS = 3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="shutdown-torch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--on-daemon-loss", choices=("error", "continue"), default="error")
    p.add_argument("--reconnect-ms", type=int, default=100)
    p.add_argument("--pause", action="append", default=[])
    args = p.parse_args()
    pauses = set()
    for spec in args.pause:
        point, step = spec.rsplit(":", 1)
        assert point in ("before_step_done", "before_fence"), point
        pauses.add((point, int(step)))

    def maybe_pause(point, step):
        if (point, step) in pauses:
            print("pause %s %d" % (point, step), flush=True)
            sys.stdin.readline()

    torch.manual_seed(3)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    client = ckpt.Client(args.socket, call_timeout_s=10, wait_timeout_s=60,
                         on_daemon_loss=args.on_daemon_loss,
                         reconnect_interval_s=args.reconnect_ms / 1000.0)
    # A post-step hook registered before attach() runs before ckpt.torch's:
    # between the optimizer step (after the fence) and StepDone.
    counter = {"t": 0}

    def after_step(optimizer, args_, kwargs):
        counter["t"] += 1
        maybe_pause("before_step_done", counter["t"])

    opt.register_step_post_hook(after_step)
    run = ckpt_torch.attach(model, opt, client, job_id=args.job, policy="all")
    x = torch.randn(8, 16)
    y = torch.randn(8, 4)
    try:
        for t in range(1, args.steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # fence of t-1, the optimizer step, StepDone(t)
            maybe_pause("before_fence", t)
        durable = None
        try:
            durable = run.wait_durable()
        except ckpt.Error as e:
            if e.code != "ABORTED":  # the documented answer for a lost step
                raise
            print("call WaitDurable %d %s" % (run.step, e), flush=True)
        unprotected = client.unprotected
        run.close()
    except ckpt.Error as e:
        print("call %s" % e, flush=True)
        return STOPPED_ON_LOSS if e.code == "UNAVAILABLE" else 1
    print("done " + json.dumps({"steps": run.step, "unprotected": unprotected,
                                "durable": durable, "generation": client.generation}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
