"""ckpt.lightning against a real ckptd, on the CPU: a LightningModule (an MLP
with BatchNorm, AdamW, a StepLR schedule) trained by Lightning's Trainer
with CkptCheckpointIO and ModelCheckpoint saving every epoch.
- a run killed with SIGKILL at the start of its third epoch and resumed
  from ckptd's newest checkpoint (io.latest_path()) ends with the same
  weights, optimizer state and BatchNorm statistics, bitwise, as a run
  never killed;
- the checkpoint dict Lightning loads back has its epoch, global step,
  loops, optimizer and scheduler state;
- nothing is written at the checkpoint paths (ckptd holds them).

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or lightning
is missing.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch("lightning")
import torch  # noqa: E402

EPOCHS = 4


def train(a):
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt.lightning import CkptCheckpointIO

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 3))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    class KillAt(Callback):
        def on_train_start(self, trainer, _):
            print("start_step", trainer.global_step, flush=True)

        def on_train_epoch_start(self, trainer, _):
            if trainer.current_epoch == a.kill_at_epoch:
                os.kill(os.getpid(), signal.SIGKILL)

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g))
    io = CkptCheckpointIO(a.job, a.socket)
    callbacks = [ModelCheckpoint(dirpath=a.dir, every_n_epochs=1, save_top_k=-1)]
    callbacks.append(KillAt())
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, plugins=[io],
                        callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    model = Net()
    resume = io.latest_path() if a.resume else None
    if a.resume:
        print("resuming from", resume, flush=True)
        ckpt = io.load_checkpoint(resume)
        for key in ("epoch", "global_step", "loops", "optimizer_states", "lr_schedulers",
                    "state_dict"):
            if key not in ckpt:
                print("the loaded checkpoint lacks", key, flush=True)
                sys.exit(4)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False), ckpt_path=resume)
    opt = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()["state"],
                "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()}, a.out)


def run(daemon, root, job, name, *extra):
    out = os.path.join(root, name + ".pt")
    cmd = [sys.executable, __file__, "--train", "--job", job, "--socket", daemon.socket,
           "--dir", os.path.join(root, "paths-" + job), "--out", out] + list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p, out


def same_weights(a, b):
    x = torch.load(a, weights_only=True)
    y = torch.load(b, weights_only=True)
    for part in ("model", "opt"):
        flat_x = harness_flat(x[part])
        flat_y = harness_flat(y[part])
        if flat_x.keys() != flat_y.keys():
            return "%s: keys differ" % part
        for k in flat_x:
            if not torch.equal(flat_x[k], flat_y[k]):
                return "%s %s differs" % (part, k)
    return None if x["lr"] == y["lr"] else "lr %s != %s" % (x["lr"], y["lr"])


def harness_flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(harness_flat(v, "%s%s." % (prefix, k)))
        elif isinstance(v, torch.Tensor):
            out[prefix + str(k)] = v
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", action="store_true")
    p.add_argument("--job")
    p.add_argument("--socket")
    p.add_argument("--dir")
    p.add_argument("--out")
    p.add_argument("--kill-at-epoch", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    if a.train:
        train(a)
        return
    root = harness.tempdir("ckpt-lightning-")
    daemon = harness.Daemon(root).start()
    try:
        whole, whole_out = run(daemon, root, "pl-whole", "whole")
        check(whole.returncode == 0, "the uninterrupted run: %s" % whole.stderr[-2000:])
        killed, _ = run(daemon, root, "pl-killed", "killed", "--kill-at-epoch", "2")
        check(killed.returncode == -signal.SIGKILL, "the run was killed in its third epoch: "
              "%d %s" % (killed.returncode, killed.stderr[-2000:]))
        resumed, resumed_out = run(daemon, root, "pl-killed", "resumed", "--resume")
        check(resumed.returncode == 0, "the resumed run: %s%s" % (resumed.stdout[-1000:],
                                                                 resumed.stderr[-3000:]))
        print(resumed.stdout.strip().splitlines()[0])
        check("epoch=" in resumed.stdout, "it resumed from a saved epoch")
        start = [int(line.split()[1]) for line in resumed.stdout.splitlines()
                 if line.startswith("start_step")]
        check(start and start[0] >= 8, "the resumed Trainer started past its first epoch "
              "(global step %s), so the final weights compare a resume" % start)
        d = same_weights(whole_out, resumed_out)
        check(d is None, "killed and resumed ends as never killed, bitwise: %s" % d)
        paths = os.path.join(root, "paths-pl-whole")
        files = [n for n in os.listdir(paths)] if os.path.isdir(paths) else []
        check(not any(n.endswith(".ckpt") for n in files),
              "no checkpoint file at the paths: %s" % files)
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
