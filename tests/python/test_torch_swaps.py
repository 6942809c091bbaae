"""ckpt.torch when the training loop moves tensors, skips steps or captures.

Against a real ckptd, on the CPU, each as a user's loop would do it:
- storage swapped after registration (`p.data = p.data.clone()`,
  `model.share_memory()`, `optimizer.load_state_dict()` of a loaded state):
  the checkpoint of the last step holds the tensors' current values, and a
  restore writes into the tensors' current storage;
- what cannot be followed is refused naming the tensor, before the step
  changes anything: `model.half()`, `load_state_dict(assign=True)` (the old
  optimizer, and a new optimizer over the new parameters);
- a fused AdamW under `torch.amp.GradScaler("cpu")` with an inf gradient:
  the restored step counts and scaler state are the optimizer's and
  scaler's, and training resumed from the restore equals the original bit
  for bit (also with the foreach AdamW);
- BatchNorm buffers: the checkpoint of step K holds step K's running
  statistics when ckptd copies it after the next forward (a delay point
  holds ckptd before the copy until that forward has run);
- a step under CUDA graph capture (the capture state faked) is refused.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch is missing.
"""

import copy
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


def build(seed, batchnorm=False, fused=False, foreach=None):
    torch.manual_seed(seed)
    mid = [nn.BatchNorm1d(16)] if batchnorm else []
    model = nn.Sequential(nn.Linear(8, 16), *mid, nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=foreach)
    return model, opt


def batch(i):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + i))


def train(model, opt, first, n):
    for i in range(first, first + n):
        opt.zero_grad()
        model(batch(i)).pow(2).mean().backward()
        opt.step()


def state_of(model, opt):
    """Every parameter, its optimizer state (step counts too), every buffer."""
    out = []
    for p in model.parameters():
        out.append(p.detach().clone())
        for _, v in sorted(opt.state.get(p, {}).items()):
            out.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
    out += [b.detach().clone() for b in model.buffers()]
    return out


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def restored_state(daemon, job, **kw):
    model, opt = build(2, **kw)  # other weights: the restore must overwrite them
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job)
    restored = run.restore()
    got = state_of(model, opt)
    run.close()
    return restored, got


def swapped(daemon):
    """Storage moved at step 3, trained to step 6: step 6 comes back."""
    swaps = {
        "data-clone": lambda m, o: setattr(m[2].weight, "data", m[2].weight.data.clone()),
        "share-memory": lambda m, o: m.share_memory(),
        # As a resume from a file would: new state tensors.
        "optimizer-load": lambda m, o: o.load_state_dict(copy.deepcopy(o.state_dict())),
    }
    for name, swap in swaps.items():
        model, opt = build(1)
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="swap-" + name)
        train(model, opt, 0, 3)
        swap(model, opt)
        train(model, opt, 3, 3)
        durable = run.wait_durable()
        want = state_of(model, opt)
        run.close()
        restored, got = restored_state(daemon, "swap-" + name)
        check(durable == 6 and restored.target_step == 6 and equal(got, want),
              "%s at step 3: step 6 restored with the values the tensors had" % name)

    # A restore writes into the tensor's storage now, not the registered one.
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="swap-restore")
    train(model, opt, 0, 3)
    run.wait_durable()
    want = state_of(model, opt)
    model[0].weight.data = torch.zeros_like(model[0].weight)
    run.restore()
    check(equal(state_of(model, opt), want),
          "restore after `p.data = zeros`: the live weight gets the checkpoint")
    train(model, opt, 3, 1)  # and training goes on attached
    check(run.wait_durable() == 4, "training went on after that restore")
    run.close()


def refused(daemon):
    """What cannot be followed is refused naming the tensor, unchanged."""
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="refuse-half")
    train(model, opt, 0, 2)
    opt.zero_grad()
    model(batch(2)).pow(2).mean().backward()
    model.half()  # the gradients too: the step would change the weights
    before = state_of(model, opt)
    try:
        opt.step()
        check(False, "model.half() after registration refused")
    except RuntimeError as e:
        check("'0.weight'" in str(e) and "F16" in str(e) and "F32" in str(e),
              "model.half(): refused naming the tensor and both dtypes (%s)" % str(e)[:90])
    check(equal(state_of(model, opt), before), "... before the step changed anything")
    run.close(drain=False)

    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="refuse-assign")
    train(model, opt, 0, 2)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for what, o in (("a new optimizer", torch.optim.AdamW(model.parameters(), lr=1e-2)),
                    ("the attached optimizer", opt)):
        try:
            o.step()
            check(False, "load_state_dict(assign=True), then %s: refused" % what)
        except RuntimeError as e:
            check("job 'refuse-assign'" in str(e),
                  "load_state_dict(assign=True), then a step of %s: refused (%s)"
                  % (what, str(e)[:80]))
    run.close(drain=False)


def scaled(daemon):
    """GradScaler("cpu"): an inf gradient at iteration 4, stop after 7."""
    def iteration(model, opt, scaler, i):
        opt.zero_grad()
        scaler.scale(model(batch(i)).pow(2).mean()).backward()
        if i == 3:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        job = "scaler-" + name
        model, opt = build(1, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job,
                                scaler=scaler)
        for i in range(7):
            iteration(model, opt, scaler, i)
        run.wait_durable()
        want, want_scaler = state_of(model, opt), scaler.state_dict()
        run.close()
        steps = int(opt.state[model[0].weight]["step"])

        model2, opt2 = build(2, **kw)
        scaler2 = torch.amp.GradScaler("cpu", init_scale=4.0)
        run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id=job,
                                 scaler=scaler2)
        run2.restore()
        check(steps == 6 and equal(state_of(model2, opt2), want),
              "%s AdamW, inf gradient at 4 of 7: the optimizer's step count (%d) and state "
              "restored" % (name, steps))
        check(scaler2.state_dict() == want_scaler,
              "%s: the scaler's state after its last update restored (%s)" % (name, want_scaler))
        for i in range(7, 10):
            iteration(model, opt, scaler, i)
            iteration(model2, opt2, scaler2, i)
        check(equal(state_of(model2, opt2), state_of(model, opt)),
              "%s: three steps after the restore equal the original run's bit for bit" % name)
        run2.close()


def batchnorm(root):
    """K steps, then the forward and backward of step K+1 while ckptd is
    held before copying step K (its K-th snapshot), then durable = K."""
    k = 5
    log, release = os.path.join(root, "delay.log"), os.path.join(root, "release")
    daemon = harness.Daemon(os.path.join(root, "bn"), env={
        "CKPT_DELAY_AT": "snapshot.before_copy:60000:%d" % k, "CKPT_DELAY_LOG": log,
        "CKPT_DELAY_UNTIL": release}).start()
    try:
        model, opt = build(1, batchnorm=True)
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="bn")
        train(model, opt, 0, k)
        want = state_of(model, opt)
        harness.wait_for(lambda: os.path.exists(log) and "snapshot.before_copy" in open(log).read(),
                         30, "ckptd held before copying step %d" % k)
        model(batch(k)).pow(2).mean().backward()  # changes the running statistics
        open(release, "w").close()
        durable = run.wait_durable()
        run.close()
        restored, got = restored_state(daemon, "bn", batchnorm=True)
    finally:
        daemon.stop()
    buffers = [n for n, _ in model.named_buffers()]
    check(durable == k and restored.target_step == k and equal(got, want),
          "BatchNorm: step %d restored with its own running statistics (%s)" % (k, buffers))


def graph_capture(daemon):
    """A step under CUDA graph capture is refused (the capture state faked)."""
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="graph")
    train(model, opt, 0, 1)
    saved = torch.cuda.is_initialized, torch.cuda.is_current_stream_capturing
    torch.cuda.is_initialized = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        train(model, opt, 1, 1)
        check(False, "a step under CUDA graph capture refused")
    except RuntimeError as e:
        check("CUDA graph" in str(e), "a step under CUDA graph capture refused (%s)"
              % str(e)[:70])
    finally:
        torch.cuda.is_initialized, torch.cuda.is_current_stream_capturing = saved
    train(model, opt, 1, 1)
    check(run.wait_durable() == 2, "after the capture, steps are protected again")
    run.close()


def main():
    root = harness.tempdir("ckpt-swaps-")
    daemon = harness.Daemon(root).start()
    try:
        swapped(daemon)
        refused(daemon)
        scaled(daemon)
        graph_capture(daemon)
        batchnorm(root)
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
