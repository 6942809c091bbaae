"""ckpt.lightning: Lightning checkpoints saved into ckptd.

    import lightning as L
    from ckpt.lightning import CkptCheckpointIO

    io = CkptCheckpointIO("resnet-ft")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt", ...)])
    trainer.fit(model, ckpt_path=io.latest_path())   # None on the first run

A CheckpointIO plugin, for the strategies that save through one (single
device, DDP: rank 0 saves the whole checkpoint). save_checkpoint() hands
Lightning's checkpoint dict to ckptd through ckpt.dcp on this process
alone: the tensors are copied into memory ckptd maps and training goes on
while DCP's save runs on the plugin's thread and ckptd writes them; a tensor whose bytes
ckptd already holds is not written again. The checkpoint's path is only its
name in ckptd (no file is written there); load_checkpoint() rebuilds the
dict from ckptd without a template, verifying every checksum. A save waits
for the one before it, and teardown() for the last, so Lightning's end of
fit is durable. remove_checkpoint() leaves the bytes to ckptd's retention.

One save in flight at a time; the plugin's lock orders Lightning's calls
with the upload thread's completion."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional

import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .dcp import CkptReader, CkptWriter
from .dcp.catalog import Catalog


class CkptCheckpointIO(CheckpointIO):
    """Lightning's checkpoints in ckptd (see the module's doc)."""

    def __init__(self, job_id: str, socket_path: Optional[str] = None,
                 wait_timeout_s: float = 600.0):
        self.job_id = job_id
        self._socket = socket_path
        self._wait_s = wait_timeout_s
        self._writer = CkptWriter(job_id, socket_path, rank=0, wait_timeout_s=wait_timeout_s)
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-lightning-save")
        self._pending: Any = None  # the future of the save in flight

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO takes no storage_options")
        with self._lock:
            self._wait()
            # Staged here (the trainer may change its tensors once this
            # returns), written by DCP's save on the plugin's own thread, on
            # this process alone: dcp.async_save would insist on a CPU
            # backend in the default process group (NCCL-only under GPU DDP)
            # and only rank 0 saves.
            staged = self._writer.stage(checkpoint)
            self._pending = self._thread.submit(
                dcp.save, staged, checkpoint_id=os.fspath(path), storage_writer=self._writer,
                no_dist=True)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result(timeout=self._wait_s)  # a timeout keeps it pending
            self._pending = None

    def wait(self) -> None:
        """Returns once the last save is durable (raising its error)."""
        with self._lock:
            self._wait()

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        self.wait()  # a checkpoint saved just now is loadable
        reader = CkptReader(self.job_id, self._socket, wait_timeout_s=self._wait_s)
        out: Dict[str, Any] = {}
        try:
            reader.reset(os.fspath(path))
            # DCP's own way to load without a template (format_utils does
            # the same): the planner builds the dict from the metadata.
            _load_state_dict(out, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
        finally:
            reader.close()
        for opt in out.get("optimizer_states", []):
            # DCP names the optimizer's per-parameter state by str(index).
            if isinstance(opt, dict) and isinstance(opt.get("state"), dict):
                opt["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                for k, v in opt["state"].items()}
        return out

    def latest_path(self) -> Optional[str]:
        """The path of the newest durable checkpoint in ckptd, or None."""
        catalog = Catalog(self._socket, self.job_id)
        try:
            _, path, _ = catalog.get(None)
        except FileNotFoundError:
            return None
        finally:
            catalog.close()
        return path

    def remove_checkpoint(self, path: Any) -> None:
        pass  # ckptd's retention keeps or drops the job's versions

    def teardown(self) -> None:
        self.wait()
