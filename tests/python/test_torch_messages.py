"""What ckpt.torch and ckptd say when a user's loop does something they
cannot follow, against a real ckptd, on the CPU: each message must name
what differs and say what to do, and following its advice must work.
- a restore into a model of other sizes, or of another dtype: the tensor,
  and its shape and dtype in the checkpoint and as registered;
- a model with one module more than the checkpoint: the layer it lacks;
- an AdamW checkpoint restored with SGD: the tensors only the checkpoint
  has, and that the optimizer differs;
- no ckptd at the socket: attach() says so (not the first step), naming
  the socket and asking whether ckptd runs (a warning for a client that
  goes on unprotected);
- a numpy scalar as data position: a TypeError naming the value's type and
  what to use, without PyTorch's unpickler advice or "damaged";
- another optimizer stepping an attached model: the advice (close(),
  attach() the new optimizer and resume()) works when followed, and an
  attachment of a job with history that neither restores nor resumes is
  told so at its first step;
- a layer's newest version damaged on disk with no intact copy anywhere:
  restore() fails with DATA_LOSS, reason LOST_VERSION, naming the layer,
  on every try; restore(older_within=1) takes the layer's previous version
  and says so per layer.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch is missing.
"""

import glob
import os
import shutil
import sys
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


def mlp(width=16, extra=False, dtype=torch.float32):
    torch.manual_seed(1)
    layers = [nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4)]
    if extra:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers).to(dtype)


def train(daemon, job, model, opt, steps=2):
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job)
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8, dtype=next(model.parameters()).dtype)).pow(2).mean().backward()
        opt.step()
    run.close()


def restore_error(daemon, job, model, opt):
    """The error restoring `job` into `model`/`opt` raises (None if it works)."""
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=job)
    try:
        run.restore()
        return None
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return e
    finally:
        run.close(drain=False)


def adam(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def mismatches(daemon):
    m = mlp()
    train(daemon, "msg-shape", m, adam(m))
    wide = mlp(width=32)
    e = restore_error(daemon, "msg-shape", wide, adam(wide))
    msg = str(e)
    check(e is not None and "0.weight" in msg and "[16, 8]" in msg and "[32, 8]" in msg,
          "other sizes: the tensor and both shapes are named: %s" % msg[:300])
    d = mlp(dtype=torch.float64)
    e = restore_error(daemon, "msg-shape", d, adam(d))
    msg = str(e)
    check(e is not None and "F32" in msg and "F64" in msg,
          "another dtype: both dtypes are named: %s" % msg[:300])

    more = mlp(extra=True)
    e = restore_error(daemon, "msg-shape", more, adam(more))
    msg = str(e)
    check(e is not None and "'3'" in msg and "module" in msg,
          "a module more: the layer without a version is named: %s" % msg[:300])

    sgd = mlp()
    e = restore_error(daemon, "msg-shape", sgd, torch.optim.SGD(sgd.parameters(), lr=0.1))
    msg = str(e)
    check(e is not None and "exp_avg" in msg and "optimizer" in msg,
          "AdamW restored with SGD: the optimizer state only the checkpoint has, and the "
          "optimizer, are named: %s" % msg[:300])


def no_daemon(root):
    m = mlp()
    socket = os.path.join(root, "nobody-here.sock")
    try:
        ckpt_torch.attach(m, adam(m), ckpt.Client(socket, wait_timeout_s=2), job_id="msg-none")
        e = None
    except Exception as err:  # noqa: BLE001
        e = err
    msg = str(e)
    check(e is not None and socket in msg and "ckptd running" in msg and ".fds" not in msg,
          "no ckptd: attach() names the socket and asks whether ckptd runs: %s" % msg[:300])
    # A client that goes on unprotected when ckptd is lost is warned instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = ckpt_torch.attach(m, adam(m), ckpt.Client(socket, wait_timeout_s=2,
                                                        on_daemon_loss="continue"),
                                job_id="msg-none")
    run.close(drain=False)
    check(any("ckptd running" in str(w.message) for w in caught),
          "... with on_daemon_loss='continue': a warning, and the attachment is made")


def numpy_position(daemon):
    import numpy as np
    m = mlp()
    opt = adam(m)
    run = ckpt_torch.attach(m, opt, ckpt.Client(daemon.socket), job_id="msg-numpy")
    run.set_data_position({"epoch": 1, "index": np.int64(5)})
    m(torch.randn(3, 8)).pow(2).mean().backward()
    try:
        opt.step()
        e = None
    except TypeError as err:
        e = err
    run.close(drain=False)
    msg = str(e)
    check(e is not None and "numpy.int64" in msg and "'index'" in msg and "int(" in msg and
          "weights_only" not in msg and "\x1b" not in msg and "damaged" not in msg,
          "a numpy scalar as data position: the type, where it is and what to use: %s"
          % msg[:400])


def other_optimizer(daemon):
    m = mlp()
    opt = adam(m)
    run = ckpt_torch.attach(m, opt, ckpt.Client(daemon.socket), job_id="msg-opt")
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
    other = adam(m)  # the loop made its optimizer again
    try:
        other.step()
        msg = ""
    except RuntimeError as e:
        msg = str(e)
    check("resume()" in msg, "another optimizer: the advice names resume(): %s" % msg[:300])
    # As told: close, attach the new optimizer, resume, train on.
    run.close()
    run2 = ckpt_torch.attach(m, other, ckpt.Client(daemon.socket), job_id="msg-opt")
    restored = run2.resume()
    other.zero_grad()
    m(torch.randn(3, 8)).pow(2).mean().backward()
    other.step()
    check(restored is not None and run2.step == restored.target_step + 1 == 4,
          "... followed: resume() then a step goes on at step %d" % run2.step)
    run2.close()

    # Attached to a job with history, no restore: the first step says what to do.
    opt4 = adam(m)
    run4 = ckpt_torch.attach(m, opt4, ckpt.Client(daemon.socket), job_id="msg-opt")
    opt4.zero_grad()
    m(torch.randn(3, 8)).pow(2).mean().backward()
    try:
        opt4.step()
        msg = ""
    except RuntimeError as e:
        msg = str(e)
    run4.close(drain=False)
    check("resume()" in msg and "msg-opt" in msg and "step is 4" in msg,
          "a job with history attached without resume(): told at its first step: %s" % msg[:300])


def lost_version(daemon):
    m = mlp()
    opt = adam(m)
    run = ckpt_torch.attach(m, opt, ckpt.Client(daemon.socket), job_id="msg-lost")
    after = []
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
        after.append({k: v.clone() for k, v in m.state_dict().items()})
    run.wait_durable()
    run.close()
    # ckptd restarted (its memory tier empty), layer 0's step 3 truncated.
    daemon.stop()
    newest = sorted(glob.glob(os.path.join(daemon.data, "jobs", "msg-lost", "rank-00000000",
                                           "L00000000-S*.ckv")))[-1]
    check("-S%016x-" % 3 in newest, "layer 0 has a version of step 3: %s" % newest)
    os.truncate(newest, os.path.getsize(newest) // 2)
    daemon.start()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    for attempt in range(2):
        e = restore_error(daemon, "msg-lost", m, adam(m))
        check(isinstance(e, ckpt.Error) and e.code == "DATA_LOSS" and
              e.reason == "LOST_VERSION" and "'0' lost its version of step 3" in str(e) and
              "older_within" in str(e),
              "restore %d of a lost version is refused, naming the layer and the way out: %r"
              % (attempt + 1, e))
    # A step that does not need the lost version restores as ever (the
    # lookup of the newest step once refused with it).
    run1 = ckpt_torch.attach(m, adam(m), ckpt.Client(daemon.socket), job_id="msg-lost")
    at2 = run1.restore(step=2)
    check(at2.target_step == 2 and torch.equal(m.state_dict()["0.weight"], after[1]["0.weight"]),
          "restore(step=2) is untouched by step 3's loss")
    run1.close(drain=False)
    opt2 = adam(m)
    run2 = ckpt_torch.attach(m, opt2, ckpt.Client(daemon.socket), job_id="msg-lost")
    restored = run2.restore(older_within=1)
    lost = {l.name: (l.step, l.lost_step) for l in restored.layers}
    check(lost == {"0": (2, 3), "2": (3, 0)}, "the layer's previous version, said so: %s" % lost)
    sd = m.state_dict()
    check(torch.equal(sd["0.weight"], after[1]["0.weight"]) and
          torch.equal(sd["2.weight"], after[2]["2.weight"]),
          "layer 0 holds its step 2 bytes, layer 2 its step 3 bytes")
    run2.close(drain=False)


def main():
    root = harness.tempdir("ckpt-messages-")
    daemon = harness.Daemon(root).start()
    try:
        mismatches(daemon)
        no_daemon(root)
        numpy_position(daemon)
        other_optimizer(daemon)
        lost_version(daemon)
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
