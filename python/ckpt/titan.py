"""ckpt.titan: torchtitan's checkpoints saved into ckptd.

torchtitan builds its checkpoint manager from the class of its checkpoint
configuration (``config.checkpoint.build(...)``: selecting the Config
selects the manager), so a job selects ckptd with

    from ckpt.titan import CkptCheckpointManager
    checkpoint = CkptCheckpointManager.Config(enable=True, job_id="llama3-8b", interval=500)

and torchtitan's trainer drives it as its own DCP manager: ``load(step)``
before the loop, ``maybe_wait_for_staging()`` before each optimizer step,
``save(step, last_step)`` after it, ``close()`` at the end. A save is a
ckpt.dcp ``async_save`` (or a ``dcp.save`` with ``async_save=False``, and
on the last step): the rank's tensors are copied, on a thread of the writer
while the next forward and backward passes run, into memory ckptd maps
(``maybe_wait_for_staging`` waits for that copy before the optimizer
step); ckptd writes only the tensors whose bytes changed. A save
waits for the one before it. ``load(-1)`` loads ckptd's newest checkpoint
of the job (False when there is none), ``load(step)`` checkpoint
``step-<step>``. Checkpoints are kept by ckptd's retention
(``keep_last_events``), not by ``keep_latest_k``; the ``folder`` is not
written. Not supported: ``last_save_in_hf`` and the initial loads from a
path (``initial_load_path``): refused at construction.

Imported only with torchtitan (0.3) installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import (DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER,
                                                      BaseCheckpointManager, ModelWrapper)

from .dcp import CkptReader, CkptWriter
from .dcp.catalog import Catalog


class CkptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager for ckptd (see the module's doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        job_id: str = ""
        """The ckptd job: [A-Za-z0-9._-], at most 100 characters."""

        socket_path: str = ""
        """ckptd's socket; empty: ckpt.Client's default."""

        async_save: bool = True
        """Save with DCP's async_save (the step goes on once staged)."""

        async_staging: bool = True
        """Stage on a thread of the writer, overlapping the next forward and
        backward passes; maybe_wait_for_staging() waits for it before the
        optimizer step."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list,
                 optimizers: Any, lr_schedulers: Any, states: dict, sd_adapter: Any = None,
                 base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        if not config.job_id:
            raise ValueError("CkptCheckpointManager.Config needs a job_id")
        if config.last_save_in_hf or config.initial_load_path:
            raise ValueError("CkptCheckpointManager saves and loads ckptd's checkpoints only: "
                             "last_save_in_hf and initial_load_path are not supported")
        self.save_future: Any = None
        self.config = config
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self._socket: Optional[str] = config.socket_path or None
        self._writer = CkptWriter(config.job_id, self._socket,
                                  async_staging=config.async_staging and config.async_save)
        self._staging: Any = None  # the staging future of the save in flight
        # DCP's collectives on a CPU group of their own, as torchtitan's DCP
        # manager does: async_save needs one, and the trainer's group may be
        # NCCL only. Every rank builds the manager, so every rank makes it.
        self._pg = dist.new_group(backend="gloo") \
            if dist.is_available() and dist.is_initialized() else None

    def __del__(self) -> None:
        self.close()

    def _flat_states(self, model_only: bool = False, loading: bool = False) -> dict:
        """The model's tensors at the top level, the other states beside
        them, as torchtitan's DCP manager saves them."""
        if model_only:
            return self.states[MODEL].state_dict()
        skip = set(self.config.exclude_from_loading) if loading else set()
        sd = {k: v for k, v in self.states.items() if k != MODEL and k not in skip}
        sd.update(self.states[MODEL].state_dict())
        return sd

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        model_only = last_step and self.config.last_save_model_only
        states = self._flat_states(model_only=model_only)
        cid = f"step-{curr_step}"
        if self.config.async_save and not last_step:
            out = dcp.async_save(states, checkpoint_id=cid, storage_writer=self._writer,
                                 process_group=self._pg)
            if hasattr(out, "upload_completion"):  # staged on the writer's thread
                self._staging, out = out.staging_completion, out.upload_completion
            self.save_future = out
        else:
            dcp.save(states, checkpoint_id=cid, storage_writer=self._writer,
                     process_group=self._pg)
        return True

    def _load(self, step: int = -1) -> bool:
        cid = None if step == -1 else f"step-{step}"
        catalog = Catalog(self._socket, self.config.job_id)
        try:
            catalog.get(cid)
        except FileNotFoundError:
            if step == -1:
                return False  # no checkpoint yet: train from scratch
            raise
        finally:
            catalog.close()
        reader = CkptReader(self.config.job_id, self._socket)
        try:
            dcp.load(self._flat_states(loading=True), checkpoint_id=cid, storage_reader=reader,
                     process_group=self._pg)
        finally:
            reader.close()
        return True

    def _maybe_wait_for_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:
            self._wait_for_saving()
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
            self._writer = None
