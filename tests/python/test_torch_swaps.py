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
- a step under CUDA graph capture (the capture state faked) is refused;
- an LR scheduler made after attach() and not handed over: a warning that
  says how to hand it over, and with `run.scheduler = ...` the restored
  learning rate is the one the uninterrupted run has;
- hold_reports: a step reported by report() after the loop drew from the
  RNG (an evaluation's data loader) is restored with the RNG of that moment.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch is missing.
"""

import copy
import os
import shutil
import sys
import threading
import warnings

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


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def restored_state(daemon, job, **kw):
    model, opt = build(2, **kw)  # other weights: the restore must overwrite them
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job)
    restored = run.restore()
    got = harness.model_state(model, opt)
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
        want = harness.model_state(model, opt)
        run.close()
        restored, got = restored_state(daemon, "swap-" + name)
        check(durable == 6 and restored.target_step == 6 and equal(got, want),
              "%s at step 3: step 6 restored with the values the tensors had" % name)

    # A restore writes into the tensor's storage now, not the registered one.
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="swap-restore")
    train(model, opt, 0, 3)
    run.wait_durable()
    want = harness.model_state(model, opt)
    model[0].weight.data = torch.zeros_like(model[0].weight)
    run.restore()
    check(equal(harness.model_state(model, opt), want),
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
    before = harness.model_state(model, opt)
    try:
        opt.step()
        check(False, "model.half() after registration refused")
    except RuntimeError as e:
        check("'0.weight'" in str(e) and "F16" in str(e) and "F32" in str(e),
              "model.half(): refused naming the tensor and both dtypes (%s)" % str(e)[:90])
    check(equal(harness.model_state(model, opt), before), "... before the step changed anything")
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
        want, want_scaler = harness.model_state(model, opt), scaler.state_dict()
        run.close()
        steps = int(opt.state[model[0].weight]["step"])

        model2, opt2 = build(2, **kw)
        scaler2 = torch.amp.GradScaler("cpu", init_scale=4.0)
        run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id=job,
                                 scaler=scaler2)
        run2.restore()
        check(steps == 6 and equal(harness.model_state(model2, opt2), want),
              "%s AdamW, inf gradient at 4 of 7: the optimizer's step count (%d) and state "
              "restored" % (name, steps))
        check(scaler2.state_dict() == want_scaler,
              "%s: the scaler's state after its last update restored (%s)" % (name, want_scaler))
        for i in range(7, 10):
            iteration(model, opt, scaler, i)
            iteration(model2, opt2, scaler2, i)
        check(equal(harness.model_state(model2, opt2), harness.model_state(model, opt)),
              "%s: three steps after the restore equal the original run's bit for bit" % name)
        run2.close()


def unplaced(daemon):
    """Entries of a layout that another replica writes are not placed where
    ckptd reads: one that moved is followed, not copied back (it raised
    KeyError: it has no place)."""
    from ckpt.torch.guard import StorageGuard
    from ckpt.torch.host_memory import HostMemory
    from ckpt.torch.layout import Entry
    model, opt = build(1)
    train(model, opt, 0, 1)
    guard = StorageGuard(model, opt, "unplaced", HostMemory(ckpt.Client(daemon.socket)))
    named = list(model.named_parameters())
    entries = [Entry(n, p, "l", {}, None, ("param", n)) for n, p in named]
    entries += [Entry(n + ".exp_avg", opt.state[p]["exp_avg"], "l", {}, None,
                      ("state", n, "exp_avg")) for n, p in named]
    guard.watch(entries, [])
    model[0].weight.data = model[0].weight.data.clone()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    def followed():
        return all(e.tensor is opt.state[p]["exp_avg"]
                   for e, (_, p) in zip(entries[len(named):], named))

    guard.check()
    after_one = followed()
    guard.check()  # and, checked again, nothing more moves
    check(after_one and followed(),
          "unplaced entries follow moved tensors (parameters and loaded optimizer state)")


def scaler_not_updated(daemon):
    """attach(scaler=) with a loop that never updates that scaler: each step
    is reported at the next one, still with its own buffers (they were
    taken at the next step's pre-hook, after its forward), and a warning."""
    k = 4
    model, opt = build(1, batchnorm=True)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="scaler-missed",
                            scaler=torch.amp.GradScaler("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(k + 1):
            opt.zero_grad()
            model(batch(i)).pow(2).mean().backward()
            opt.step()
            if i == k - 1:
                want = harness.model_state(model, opt)
    run.close()  # reports step k + 1
    warned = [w for w in caught if "was not updated" in str(w.message)]
    model2, opt2 = build(2, batchnorm=True)
    run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id="scaler-missed",
                             scaler=torch.amp.GradScaler("cpu"))
    restored = run2.restore(step=k)
    got = harness.model_state(model2, opt2)
    run2.close()
    check(len(warned) == 1, "a scaler never updated: warned once (%d)" % len(warned))
    check(restored.target_step == k and equal(got, want),
          "... and step %d restored with its own buffers and state" % k)


def loaded_step_counts(daemon):
    """optimizer.load_state_dict() of a state whose step counts were changed
    and whose moments came through as the same tensors (load_state_dict
    keeps a tensor that needs no cast): new state dicts and new step
    tensors, nothing of what ckptd reads moved. The counts go on from the
    loaded ones."""
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="loaded-steps")
    train(model, opt, 0, 2)
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = st["step"] + 10
    opt.load_state_dict(sd)
    train(model, opt, 2, 2)
    want = [float(opt.state[p]["step"]) for p in model.parameters()]
    run.wait_durable()
    run.close()
    model2, opt2 = build(2)
    run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id="loaded-steps")
    run2.restore()
    got = [float(opt2.state[p]["step"]) for p in model2.parameters()]
    run2.close()
    check(want == [14.0] * 4 and got == want,
          "step counts loaded into the optimizer go on from there (%s)" % got)


def pending_then_restore_or_close(root):
    """With a scaler, a step left pending (update() not called yet) when
    restore() or close() comes. restore() reports it and waits for ckptd to
    copy it before restoring (ckptd refused a restore while it was copying:
    a delay point holds that copy); close() with ckptd gone still detaches,
    so the model can be attached again."""
    log, release = os.path.join(root, "pending.log"), os.path.join(root, "pending-go")
    daemon = harness.Daemon(os.path.join(root, "pending"), env={
        "CKPT_DELAY_AT": "snapshot.before_copy:60000:2", "CKPT_DELAY_LOG": log,
        "CKPT_DELAY_UNTIL": release}).start()

    def attached_with_a_step_pending(job):
        """Two scaled steps, the second without its update()."""
        model, opt = build(1)
        scaler = torch.amp.GradScaler("cpu")
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job,
                                scaler=scaler)
        for i in range(2):
            opt.zero_grad()
            scaler.scale(model(batch(i)).pow(2).mean()).backward()
            scaler.step(opt)
            if i == 0:
                scaler.update()
        return model, opt, run

    def release_when_held():
        harness.wait_for(lambda: os.path.exists(log), 30, "ckptd held at step 2's copy")
        open(release, "w").close()

    try:
        _, _, run = attached_with_a_step_pending("pending")
        releaser = threading.Thread(target=release_when_held)
        releaser.start()
        restored = run.restore()
        releaser.join()
        check(restored.target_step in (1, 2),
              "restore() with a step pending: reported, copied, then restored (step %d)"
              % restored.target_step)
        run.close()
        model, opt, run = attached_with_a_step_pending("pending-close")
        daemon.stop()
        try:
            run.close()
            check(False, "close() with ckptd gone and a step pending raises")
        except ckpt.Error as e:
            check(e.code == "UNAVAILABLE", "close() with ckptd gone: %s" % e.code)
        # attach() with ckptd still gone: a client that goes on unprotected
        # is only warned (the default one is refused, UNAVAILABLE).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = ckpt_torch.attach(model, opt,
                                      ckpt.Client(daemon.socket, on_daemon_loss="continue"),
                                      job_id="pending-2")
        again.close()
        check(True, "... and the model can be attached again")
    finally:
        daemon.stop()


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
        want = harness.model_state(model, opt)
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


def late_scheduler(daemon):
    """A scheduler made after attach(): warned about once at the next step;
    handed over with run.scheduler, it is saved and restored."""
    def steps(job, hand_over):
        model, opt = build(1)
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if hand_over:
            run.scheduler = sched
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                train(model, opt, i, 1)
                sched.step()
        run.close()
        return [w for w in caught if "scheduler" in str(w.message)], opt.param_groups[0]["lr"]

    warned, _ = steps("late-sched", hand_over=False)
    check(len(warned) == 1 and "run.scheduler" in str(warned[0].message),
          "a scheduler made after attach() and not handed over: one warning naming "
          "run.scheduler (%s)" % [str(w.message)[:120] for w in warned])
    warned, lr = steps("late-sched-given", hand_over=True)
    model, opt = build(2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="late-sched-given",
                            scheduler=sched)
    run.restore()
    got = opt.param_groups[0]["lr"]
    run.close()
    check(not warned and got == lr,
          "... handed over with run.scheduler: no warning, the restored lr %g is the "
          "uninterrupted run's %g" % (got, lr))


def held_reports(daemon):
    """hold_reports + report(): the RNG saved with a step is the one when
    report() ran, after the loop drew from it (as an evaluation's data
    loader draws its seed), not the one of the post-step hook."""
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="held")
    run.hold_reports = True
    for i in range(3):
        train(model, opt, i, 1)
        torch.rand(5)  # the "evaluation" of the step just taken
        run.report()
    want = torch.rand(7)  # what the next step draws first
    run.close()
    model2, opt2 = build(2)
    run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id="held")
    restored = run2.restore()
    got = torch.rand(7)
    run2.close()
    check(restored.target_step == 3 and torch.equal(got, want),
          "held reports: step 3 restored with the RNG taken at report(), after the draw")


def main():
    root = harness.tempdir("ckpt-swaps-")
    daemon = harness.Daemon(root).start()
    try:
        swapped(daemon)
        refused(daemon)
        scaled(daemon)
        graph_capture(daemon)
        unplaced(daemon)
        scaler_not_updated(daemon)
        loaded_step_counts(daemon)
        pending_then_restore_or_close(root)
        batchnorm(root)
        late_scheduler(daemon)
        held_reports(daemon)
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
