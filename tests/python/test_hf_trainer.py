"""ckpt.hf: a Hugging Face Trainer fine-tune of a tiny randomly initialised
GPT-2 (built from a config in code; nothing is downloaded) on the CPU,
protected by CkptCallback with policy `all`, SIGKILLed in its second epoch
and resumed by a new process from the composite checkpoint: every step after
the restore and the final weights equal a failure-free run bit for bit
(model, optimizer, scheduler, RNG, epoch and data position restored).
A second run does the same with the base frozen and only the last block and
the head trained (frozen layers, written once). A third logs every step and
evaluates every 4 steps, and is killed right after the evaluation of a
durable step: the resumed Trainer keeps its logging and evaluation steps,
and the random state it resumes with is the one after that evaluation. A
fourth swaps only the Trainer class for CkptTrainer (its save_steps left
on) and resumes with resume_from_checkpoint=True: bit-exact, and no
checkpoint folder is written.

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when torch,
transformers or the module is missing. `--worker` runs one trainer process.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch("transformers", "transformers.utils")
import torch  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)
from transformers.utils import logging as hf_logging  # noqa: E402

import ckpt  # noqa: E402
from ckpt.hf import CkptCallback, CkptTrainer  # noqa: E402

STEPS, PER_EPOCH = 30, 16  # 64 samples, batch 4: the kill falls in epoch 2


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(500 + i)
        ids = torch.randint(0, 96, (24,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def weights_hash(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepLog(TrainerCallback):
    """One line per optimizer step: the weights' hash after it; one per log
    of the Trainer (its step and what it logged); SIGKILL at step `kill_at`,
    or, with `after_eval`, right after that step's evaluation once ckptd has
    it durable."""

    def __init__(self, path, kill_at, after_eval=None):
        self.log = open(path, "a")
        self.kill_at = kill_at
        self.after_eval = after_eval  # the CkptCallback, when killing after an evaluation

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.log.write(json.dumps({"step": state.global_step, "hash": weights_hash(model)}) + "\n")
        self.log.flush()
        if state.global_step == self.kill_at and self.after_eval is None:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_log(self, args, state, control, logs=None, **kwargs):
        keys = sorted(k for k in (logs or {}) if k in ("loss", "eval_loss"))
        self.log.write(json.dumps({"logged": state.global_step, "keys": keys}) + "\n")
        self.log.flush()

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.kill_at and self.after_eval is not None:
            self.after_eval.run.wait_durable()
            os.kill(os.getpid(), signal.SIGKILL)


class ResumedRow(TrainerCallback):
    """The step a resumed run starts from, as a row of the log."""

    def __init__(self, path):
        self.path = path

    def write(self, protect):
        if protect.restored is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"resumed": protect.restored.target_step,
                                    "frozen_layers": protect.run.frozen_layers}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        trainer_ckpt = getattr(self, "trainer_ckpt", None)
        if trainer_ckpt is not None:
            self.write(trainer_ckpt)


def worker(a):
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(11)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # dropout 0.1: the RNG matters
    if a.frozen_base:
        for name, p in model.named_parameters():
            if not name.startswith(("transformer.h.1.", "transformer.ln_f")):
                p.requires_grad_(False)
    # Either max_steps, or epochs with gradient accumulation (the Trainer
    # then sizes its schedule from the data: ceil(16 batches / 5) = 4 steps
    # per epoch).
    steps = dict(max_steps=STEPS) if not a.epochs else dict(
        num_train_epochs=a.epochs, gradient_accumulation_steps=a.ga)
    # With --eval: loss logged every step, an evaluation every 4 (it draws
    # from the RNG: its data loader's seed).
    logs = dict(logging_strategy="no") if not a.eval else dict(
        logging_strategy="steps", logging_steps=1, eval_strategy="steps", eval_steps=4)
    args = TrainingArguments(output_dir=a.out, **steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=4,
                             weight_decay=0.01, save_strategy="no", **logs,
                             report_to=[], use_cpu=True, seed=3, dataloader_num_workers=0,
                             disable_tqdm=True)
    if a.ckpt_trainer and a.socket:
        # The Trainer class swapped, its own periodic saves left on.
        args.save_strategy, args.save_steps = "steps", 5
        row = ResumedRow(a.log)
        trainer = CkptTrainer(model=model, args=args, train_dataset=Samples(),
                              callbacks=[StepLog(a.log, a.kill_at), row], ckpt_job_id=a.job,
                              ckpt_client=ckpt.Client(a.socket, wait_timeout_s=60))
        row.trainer_ckpt = trainer.ckpt
        trainer.train(resume_from_checkpoint=True if a.resume else None)
        with open(a.log, "a") as f:
            f.write(json.dumps({"final": weights_hash(model)}) + "\n")
        return
    protect = None
    if a.socket:
        protect = CkptCallback(ckpt.Client(a.socket, wait_timeout_s=60), a.job)
    callbacks = [c for c in (protect, StepLog(a.log, a.kill_at, protect if a.eval else None))
                 if c is not None]
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=callbacks,
                      eval_dataset=Samples() if a.eval else None)
    resume = protect.resume(trainer) if protect is not None and a.resume else None
    if a.resume:
        ResumedRow(a.log).write(protect)
    trainer.train(resume_from_checkpoint=resume)
    with open(a.log, "a") as f:
        f.write(json.dumps({"final": weights_hash(model)}) + "\n")


def spawn(args, expect_kill=False):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"] + args,
                       capture_output=True, text=True, timeout=600)
    if expect_kill:
        assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
    else:
        assert p.returncode == 0, (p.returncode, p.stderr[-3000:])


def case(daemon, root, name, extra, kill_at, first_epoch_steps=PER_EPOCH):
    ref = os.path.join(root, name + "-ref.jsonl")
    spawn(["--log", ref, "--out", os.path.join(root, name + "-ref")] + extra)
    ref_rows = harness.read_jsonl(ref)
    ref_hash = {r["step"]: r["hash"] for r in ref_rows if "step" in r}
    total = max(ref_hash)

    log = os.path.join(root, name + ".jsonl")
    common = ["--log", log, "--out", os.path.join(root, name), "--socket", daemon.socket,
              "--job", name] + extra
    spawn(common + ["--kill-at", str(kill_at)], expect_kill=True)
    spawn(common + ["--resume"])
    rows = harness.read_jsonl(log)
    resumed = [r for r in rows if "resumed" in r][0]
    restored = resumed["resumed"]
    check(first_epoch_steps < restored <= kill_at,
          "%s: resumed from durable step %d in epoch 2 (killed after %d)"
          % (name, restored, kill_at))
    after = [r for r in rows[rows.index(resumed):] if "step" in r]
    check([r["step"] for r in after] == list(range(restored + 1, total + 1)),
          "%s: the Trainer continued at step %d" % (name, restored + 1))
    check(all(r["hash"] == ref_hash[r["step"]] for r in after),
          "%s: weights after every resumed step equal the failure-free run's" % name)
    check(rows[-1]["final"] == ref_rows[-1]["final"],
          "%s: final weights equal the failure-free run bit for bit" % name)
    ref_logs = [(r["logged"], r["keys"]) for r in ref_rows
                if "logged" in r and r["logged"] > restored]
    logs = [(r["logged"], r["keys"]) for r in rows[rows.index(resumed):] if "logged" in r]
    check(logs == ref_logs, "%s: the resumed Trainer logged and evaluated at the steps the "
          "failure-free run did (%d logs)" % (name, len(logs)))
    return resumed


def main():
    root = harness.tempdir("ckpt-hf-")
    daemon = harness.Daemon(root).start()
    try:
        case(daemon, root, "gpt2", [], kill_at=21)
        resumed = case(daemon, root, "gpt2-frozen", ["--frozen-base"], kill_at=19)
        check(len(resumed["frozen_layers"]) > 0,
              "frozen base: %d frozen layers %s" % (len(resumed["frozen_layers"]),
                                                   resumed["frozen_layers"]))
        # Epochs and gradient accumulation 5: the resumed Trainer's own
        # scheduler takes the restored state (it used to be sized by a
        # different count, and the first resumed step used lr 0).
        case(daemon, root, "gpt2-ga5", ["--epochs", "2", "--ga", "5"], kill_at=6,
             first_epoch_steps=4)
        # Killed right after the evaluation of step 20, once it is durable.
        resumed = case(daemon, root, "gpt2-eval", ["--eval"], kill_at=20)
        check(resumed["resumed"] == 20, "eval: resumed from step 20, the step evaluated "
              "before the kill (%d)" % resumed["resumed"])
        # CkptTrainer: only the Trainer class changed (save_steps=5 left
        # on), resumed with resume_from_checkpoint=True; no folder written.
        case(daemon, root, "gpt2-trainer", ["--ckpt-trainer"], kill_at=21)
        out = os.path.join(root, "gpt2-trainer")
        written = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) \
            if os.path.isdir(out) else []
        check(written == [], "CkptTrainer wrote no checkpoint folder: %s" % written)
        layers = daemon.ctl("layers", "gpt2-frozen")["layers"]
        frozen = [l for l in layers if l["frozen"]]
        check(frozen and all(l["versions"] <= 2 for l in frozen),
              "frozen layers have at most one version per registration (%s)"
              % sorted(set(l["versions"] for l in frozen)))
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--socket")
        p.add_argument("--job", default="job")
        p.add_argument("--log", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--kill-at", type=int, default=0)
        p.add_argument("--resume", action="store_true")
        p.add_argument("--frozen-base", action="store_true")
        p.add_argument("--epochs", type=int, default=0)
        p.add_argument("--ga", type=int, default=1)
        p.add_argument("--eval", action="store_true")
        p.add_argument("--ckpt-trainer", action="store_true")
        worker(p.parse_args())
    else:
        main()
