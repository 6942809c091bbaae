"""ckpt.torch through a node loss: a small model trains with AdamW and a
scheduler under a ckptd whose remote tier is a shared directory; the run
waits until its last step is in the remote tier (wait_durable(tier="remote"));
the ckptd is SIGKILLed and its data directory deleted; a fresh ckptd on an
empty directory, with the same remote tier, serves a new process that
restores: parameters, optimizer state, scheduler, RNG and data position
equal the first run's at that step, bit for bit, and training goes on.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ckpt  # noqa: E402
from ckpt import torch as ckpt_torch  # noqa: E402

STEPS = 12


def make():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def state(model, opt):
    out = {k: v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            out["opt.%d.%s" % (i, k)] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def main():
    torch.set_num_threads(1)
    root = harness.tempdir("ckpt-torch-remote-")
    shared = os.path.join(root, "shared")
    extra = ["--remote_kind=posix", "--remote_path=" + shared,
             "--remote_key_file=" + harness.remote_key(root)]
    try:
        a = harness.Daemon(os.path.join(root, "a"), extra=extra).start()
        model, opt, sched = make()
        run = ckpt_torch.attach(model, opt, ckpt.Client(a.socket), job_id="torch-remote",
                                scheduler=sched)
        train(model, opt, sched, STEPS)
        remote = run.wait_durable(tier="remote")
        check(remote == STEPS, "step %d is in the remote tier (got %d)" % (STEPS, remote))
        want = state(model, opt)
        want_lr = opt.param_groups[0]["lr"]
        want_rng = torch.get_rng_state()
        a.kill()  # the node is lost with its disk
        shutil.rmtree(os.path.join(root, "a"))

        b = harness.Daemon(os.path.join(root, "b"), extra=extra).start()
        model2, opt2, sched2 = make()
        torch.manual_seed(99)  # the new process's RNG differs until restored
        run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(b.socket), job_id="torch-remote",
                                 scheduler=sched2)
        restored = run2.restore()
        check(restored.target_step == STEPS,
              "restored step %d on the replacement node" % restored.target_step)
        got = state(model2, opt2)
        check(sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
              "parameters and optimizer state are bit-exact")
        check(opt2.param_groups[0]["lr"] == want_lr, "the scheduler's learning rate")
        check(torch.equal(torch.get_rng_state(), want_rng), "the RNG state")
        train(model2, opt2, sched2, 3)
        check(run2.wait_durable(tier="remote") == STEPS + 3, "training goes on and uploads")
        run2.close()
        b.stop()
        print("ckpt.torch node loss through the remote tier: OK")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
