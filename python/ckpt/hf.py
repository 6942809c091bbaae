"""ckpt.hf: protect a Hugging Face Trainer fine-tune with ckptd.

    import ckpt
    from ckpt.hf import CkptCallback

    protect = CkptCallback(ckpt.Client(), job_id="llama-ft-7")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[protect])
    trainer.train(resume_from_checkpoint=protect.resume(trainer))

Every optimizer step is a ckptd step (ckpt.torch's hooks on the Trainer's
optimizer): the model (frozen weights once: a LoRA fine-tune writes its
adapters), the optimizer state, the scheduler, the RNG states and the
Trainer's step count ride along.

resume(trainer), before train(): when the job has a checkpoint, it creates the
Trainer's optimizer and scheduler, restores the composite checkpoint into
them, the model and the RNG states, and returns a directory for
``resume_from_checkpoint`` that tells the Trainer where it stands (its step
count, from which it skips the data already seen, and the RNG states to take
after skipping). The Trainer insists on reading the model's weights from that
directory, so it holds one copy of them (written once, in a temporary
directory under /dev/shm when there is one; removed after the first step);
the optimizer state is not written (the Trainer keeps the restored one). With
no checkpoint it returns None and training starts from scratch, protected.
The Trainer makes its own scheduler in train(); the callback loads the
restored scheduler state into it. A CkptCallback protects one train() call.
Not saved: an fp16 GradScaler's scale (bf16 needs none).

Without resume(), the callback attaches at the start of training.

CkptTrainer is the Trainer with that callback built in, for a job that
changes only its Trainer class: ``CkptTrainer(..., ckpt_job_id="llama-ft-7")``
then ``train(resume_from_checkpoint=True)`` resumes from ckptd. The Trainer's
own periodic saves (``save_steps``) write nothing: every step is already a
ckptd checkpoint, written asynchronously.

A step is reported to ckptd when the Trainer is done with it: at
on_step_end, or after the evaluation that follows it, so that the random
state saved with it is the one the next step starts from (an evaluation's
data loader draws its seed from it).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import tempfile
import warnings
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback, TrainerState

import ckpt
from ckpt import torch as ckpt_torch

__all__ = ["CkptCallback", "CkptTrainer"]


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper, if any."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _unwrap_scheduler(scheduler: Any) -> Any:
    return getattr(scheduler, "scheduler", scheduler)


class CkptCallback(TrainerCallback):
    """A TrainerCallback that makes every optimizer step a ckptd checkpoint;
    ckpt.torch.attach's arguments pass through (policy, layercheck, layers,
    rank, world_size)."""

    def __init__(self, client: "ckpt.Client", job_id: str, **attach_args: Any):
        self.client = client
        self.job_id = job_id
        self.attach_args = attach_args
        self.run: Optional[ckpt_torch.Attached] = None
        self.restored: Optional[ckpt_torch.Restored] = None
        self._resume_dir: Optional[str] = None

    # ---- resume ----

    def resume(self, trainer: Any) -> Optional[str]:
        """Restores the job's composite checkpoint into `trainer` (see the
        module's doc) and returns the directory for
        trainer.train(resume_from_checkpoint=...), or None when the job has
        no checkpoint."""
        if trainer.optimizer is None or trainer.lr_scheduler is None:
            trainer.create_optimizer_and_scheduler(num_training_steps=self._max_steps(trainer))
        self._attach(trainer.model, trainer.optimizer, trainer.lr_scheduler)
        self.restored = self.run.resume()
        if self.restored is None:
            return None
        position = self.restored.data_position or {}
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._resume_dir = tempfile.mkdtemp(prefix="ckpt-hf-resume-", dir=base)
        state = TrainerState()
        # The Trainer takes its logging, evaluation and save steps from this
        # file over its arguments: the arguments' own, as its train() works
        # them out (a ratio is of the total steps).
        state.compute_steps(trainer.args, self._max_steps(trainer))
        state.global_step = int(position.get("global_step", self.restored.target_step))
        state.num_input_tokens_seen = int(position.get("num_input_tokens_seen", 0))
        state.total_flos = float(position.get("total_flos", 0.0))
        state.train_batch_size = position.get("train_batch_size")
        state.save_to_json(os.path.join(self._resume_dir, "trainer_state.json"))
        rng = {"python": random.getstate(), "cpu": torch.random.get_rng_state()}
        if "numpy" in sys.modules:
            rng["numpy"] = sys.modules["numpy"].random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.random.get_rng_state_all()
        torch.save(rng, os.path.join(self._resume_dir, "rng_state.pth"))
        from safetensors.torch import save_model
        save_model(trainer.model, os.path.join(self._resume_dir, "model.safetensors"))
        return self._resume_dir

    @staticmethod
    def _max_steps(trainer: Any) -> int:
        args = trainer.args
        if args.max_steps > 0:
            return args.max_steps
        # The Trainer's own count (its scheduler replaces the one made here).
        per_epoch = max(math.ceil(len(trainer.get_train_dataloader()) /
                                  args.gradient_accumulation_steps), 1)
        return math.ceil(per_epoch * args.num_train_epochs)

    def _attach(self, model, optimizer, scheduler) -> None:
        if self.run is None:
            self.run = ckpt_torch.attach(model, _unwrap(optimizer), self.client, self.job_id,
                                         scheduler=_unwrap_scheduler(scheduler),
                                         **self.attach_args)
            # Reported once the Trainer is done with the step (on_step_end,
            # or after its evaluation), with the RNG as the next step finds it.
            self.run.hold_reports = True

    # ---- TrainerCallback ----

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        if self.run is not None and self.run.closed:
            raise RuntimeError("a CkptCallback protects one train() call; give another train() "
                               "a new CkptCallback with a new ckpt.Client")
        self._attach(model, optimizer, lr_scheduler)
        scheduler = _unwrap_scheduler(lr_scheduler)
        if scheduler is not None and scheduler is not self.run.scheduler:
            # The Trainer made a new scheduler for this train() (it does not
            # keep one made before it, and sizes it itself): load the
            # restored state into it and replay the step the Trainer takes
            # after each optimizer step, with its own schedule.
            if self.run.restored_scheduler_state is not None:
                scheduler.load_state_dict(self.run.restored_scheduler_state)
                if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        scheduler.step()
            self.run.scheduler = scheduler

    def on_step_begin(self, args, state, control, **kwargs):
        # Saved with the step about to be taken: where the Trainer will be
        # after it (its step count decides the data it skips on resume).
        self.run.set_data_position({"global_step": state.global_step + 1,
                                    "num_input_tokens_seen": int(state.num_input_tokens_seen),
                                    "total_flos": float(state.total_flos),
                                    "train_batch_size": state.train_batch_size})

    def on_step_end(self, args, state, control, **kwargs):
        # The Trainer has read the resume directory (weights before the
        # loop, RNG states before its first step): it is not needed again.
        self._remove_resume_dir()
        # The step is reported now unless an evaluation follows it (its data
        # loader draws from the RNG): then once that evaluation is done.
        # (DefaultFlowCallback, first in the list, has set control already;
        # an evaluation at the end of an epoch is decided later, at
        # on_epoch_end.)
        epoch_eval = args.eval_strategy == "epoch" and float(state.epoch).is_integer()
        if not (control.should_evaluate or epoch_eval):
            self.run.report()

    def on_evaluate(self, args, state, control, **kwargs):
        if self.run is not None and not self.run.closed:
            self.run.report()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    def close(self, drain: bool = True) -> None:
        """Waits until every step is durable (with `drain`), unregisters and
        removes the resume directory."""
        if self.run is not None and not self.run.closed:
            if drain and self.run.registered:
                self.run.wait_durable()
            self.run.close(drain)
        self._remove_resume_dir()


class CkptTrainer(Trainer):
    """A Trainer whose checkpoints are ckptd's (see the module's doc).

    ckpt_job_id: the ckptd job; ckpt_client: a ckpt.Client (the default
    socket's when None); ckpt_attach: ckpt.torch.attach's arguments
    (policy, layercheck, ...). The rest is the Trainer's."""

    def __init__(self, *args: Any, ckpt_job_id: str, ckpt_client: Optional["ckpt.Client"] = None,
                 ckpt_attach: Optional[dict] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise ValueError("CkptTrainer writes no checkpoint folders, so load_best_model_at_end "
                             "has none to load: turn it off")
        self.ckpt = CkptCallback(ckpt_client or ckpt.Client(), ckpt_job_id, **(ckpt_attach or {}))
        self.add_callback(self.ckpt)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        """resume_from_checkpoint=True: from ckptd's newest checkpoint of the
        job (from scratch when it has none); a path: as the Trainer does."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self.ckpt.resume(self)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The Trainer's periodic save (its documented override point): every
        # step is already in ckptd, so no folder is written.
        return None
