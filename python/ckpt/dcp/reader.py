"""CkptReader: a DCP StorageReader that loads checkpoints from ckptd.

read_metadata() takes the checkpoint's Metadata from the job's catalog
(catalog.py): the one named by the checkpoint id reset() was given, else
the newest. read_data() asks ckptd for each rank job's step the plan
names (ckptd's Export: every layer verified against its checksum before a
byte is sent, so a damaged version fails the load, naming it, and is never
served) and copies each requested chunk, or the part of it the request
names, into its destination. A request for a whole chunk whose destination
is a contiguous CPU tensor of its dtype gets the bytes straight into that
tensor. DCP's planner decides what each rank reads, so a checkpoint saved
by 4 ranks loads onto 2 or 8, or another parallelism, through the same
path. Bytes items come from the aux of their rank job's step.

Every rank job the checkpoint names must be in this node's ckptd. Used by
one thread (DCP's load runs on the caller's)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import ckpt

from .catalog import Catalog, check_job_id
from .store import Stored, client_for, loads

_log = logging.getLogger("ckpt.dcp")


def _chunk_sizes(md: Metadata, index: MetadataIndex) -> Tuple[torch.dtype, List[int]]:
    """The dtype and sizes of the saved chunk `index` names."""
    tmd = md.state_dict_metadata[index.fqn]
    for chunk in tmd.chunks:
        if list(chunk.offsets) == list(index.offset):
            return tmd.properties.dtype, list(chunk.sizes)
    raise RuntimeError(f"the checkpoint has no chunk of '{index.fqn}' at {list(index.offset)}")


def _whole(req: ReadItem, sizes: List[int]) -> bool:
    return all(o == 0 for o in req.storage_offsets) and list(req.lengths) == sizes


def _bytes_of(t: torch.Tensor):
    """A writable buffer over the bytes of the contiguous CPU tensor `t`."""
    return t.reshape(-1).view(torch.uint8).numpy()


class CkptReader(StorageReader):
    """Loads DCP checkpoints from ckptd (see the module's doc)."""

    def __init__(self, job_id: str, socket_path: Optional[str] = None,
                 call_timeout_s: float = 60.0, wait_timeout_s: float = 600.0):
        super().__init__()
        check_job_id(job_id)
        self.job_id = job_id
        self._socket = socket_path
        self._kwargs = {"call_timeout_s": call_timeout_s, "wait_timeout_s": wait_timeout_s}
        self._catalog = Catalog(socket_path, job_id, call_timeout_s, wait_timeout_s)
        self._client: Optional[ckpt.Client] = None
        self.checkpoint_id: Union[str, os.PathLike, None] = None
        self.loaded_id: Optional[str] = None  # the checkpoint read_metadata() found
        self._step = 0  # and its catalog step
        self._md: Optional[Metadata] = None
        self._found: Optional[Tuple[int, str, Metadata]] = None  # by reset()

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        # DCP calls reset() only with an id, and swallows what read_metadata()
        # raises (it then fails an assertion): an unknown id is refused here.
        self.checkpoint_id = checkpoint_id
        self._md = None
        self._found = self._catalog.get(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        found, self._found = self._found, None
        if found is None:
            try:
                found = self._catalog.get(self.checkpoint_id)
            except FileNotFoundError as e:
                _log.error("%s", e)  # DCP hides the exception
                raise
        self._step, self.loaded_id, self._md = found
        return self._md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._md = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Each rank reads the metadata on its own: without a checkpoint id,
        # a save that lands between two ranks' reads would have them load
        # different checkpoints. The coordinator compares what each found.
        return dataclasses.replace(plan, storage_data=(self._step, self.loaded_id))

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        found = [p.storage_data for p in plans]
        if any(f != found[0] for f in found):
            by_rank = ", ".join(f"rank {r}: {f[1]!r} (catalog step {f[0]})"
                                for r, f in enumerate(found))
            msg = (f"the ranks found different newest checkpoints of job {self.job_id} "
                   f"({by_rank}), as a save landed between their reads: load again, or "
                   "pass checkpoint_id= to dcp.load")
            _log.error("%s", msg)  # DCP wraps the exception
            raise RuntimeError(msg)
        return [dataclasses.replace(p, storage_data=None) for p in plans]

    def _client_now(self) -> ckpt.Client:
        if self._client is None:
            self._client = client_for(self._socket, self._kwargs["call_timeout_s"],
                                      self._kwargs["wait_timeout_s"])
        return self._client

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        md = self._md
        stored: Dict[MetadataIndex, Stored] = md.storage_data
        by_step: Dict[Tuple[str, int], List[ReadItem]] = {}
        for req in plan.items:
            s = stored[req.storage_index]
            by_step.setdefault((s.job, s.step), []).append(req)
        for (job, step), reqs in by_step.items():
            self._read_step(job, step, reqs, planner)
        # DCP calls reset() only with an id: a next load without one is of
        # the newest checkpoint, not of this one again.
        self.checkpoint_id = None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_step(self, job: str, step: int, reqs: List[ReadItem], planner: LoadPlanner) -> None:
        md, client = self._md, self._client_now()
        stored: Dict[MetadataIndex, Stored] = md.storage_data
        where = f"checkpoint {self.loaded_id!r} of job {self.job_id}: ckptd job {job} step {step}"
        try:
            plan = client.plan(step, job_id=job, rank=0)
        except ckpt.Error as e:
            hint = ""
            if e.code == "NOT_FOUND" and "does not exist" in e.message:
                # This node's ckptd holds none of the rank job, and none of
                # its tiers had a copy to pull (or it is another user's).
                hint = ("; if it was saved through another node's ckptd, this node's ckptd "
                        "can pull it only from its peer or remote tier: give it one (and "
                        "wait_durable for that tier when saving), or load on the node that "
                        "saved it")
            raise RuntimeError(f"{where} cannot be read: {e.message}{hint}") from e
        if plan["target_step"] != step:
            raise RuntimeError(f"{where} is gone (ckptd's newest step at or below it is "
                               f"{plan['target_step']}); the checkpoint cannot be loaded")
        tensor_reqs = [r for r in reqs if r.type != LoadItemType.BYTE_IO]
        if tensor_reqs:
            self._read_tensors(job, step, plan, tensor_reqs, planner, where)
        byte_reqs = [r for r in reqs if r.type == LoadItemType.BYTE_IO]
        if byte_reqs:
            # The step's aux: {fqn: bytes} in a rank job, {fqn: (offset,
            # length)} into the one tensor of a bytes job (writer.py).
            blobs = loads(plan["aux"]) if plan["aux"] else {}
            buf = None
            for r in byte_reqs:
                key = stored[r.storage_index].key
                if key not in blobs:
                    raise RuntimeError(f"{where} holds no bytes item '{key}'")
                blob = blobs[key]
                if isinstance(blob, tuple):
                    if buf is None:
                        buf = torch.empty(plan["layers"][0]["bytes"], dtype=torch.uint8)
                        try:
                            self._export(job, step, {"bytes": _bytes_of(buf)})
                        except ckpt.Error as e:
                            raise RuntimeError(f"{where} cannot be read, so the checkpoint is "
                                               f"not loaded: {e.message}") from e
                    off, n = blob
                    blob = buf[off:off + n].numpy().tobytes()
                planner.load_bytes(r, io.BytesIO(blob))

    def _read_tensors(self, job: str, step: int, plan: dict, reqs: List[ReadItem],
                      planner: LoadPlanner, where: str) -> None:
        stored: Dict[MetadataIndex, Stored] = self._md.storage_data
        layers = {layer["name"]: layer for layer in plan["layers"]}
        dests: Dict[str, torch.Tensor] = {}  # a destination per layer of the step
        direct: Dict[str, ReadItem] = {}
        targets: Dict[int, torch.Tensor] = {}
        wanted = Counter(stored[r.storage_index].key for r in reqs)
        chunks: Dict[int, Tuple[torch.dtype, List[int]]] = {}  # request -> its chunk
        for i, r in enumerate(reqs):
            s = stored[r.storage_index]
            if s.nbytes == 0:
                continue
            layer = layers.get(s.key)
            if layer is None or layer["step"] != s.version:
                have = "none" if layer is None else f"step {layer['step']}"
                raise RuntimeError(f"{where}: tensor '{r.storage_index.fqn}' was written at "
                                   f"step {s.version}, and ckptd's version is {have}")
            dtype, sizes = chunks[i] = _chunk_sizes(self._md, r.storage_index)
            target = planner.resolve_tensor(r).detach()
            targets[i] = target
            if wanted[s.key] == 1 and _whole(r, sizes) and target.device.type == "cpu" and \
                    target.dtype == dtype and target.is_contiguous() and \
                    target.numel() * target.element_size() == s.nbytes:
                dests[s.key] = target
                direct[s.key] = r
        for name, layer in layers.items():
            if name not in dests:
                dests[name] = torch.empty(layer["bytes"], dtype=torch.uint8)
        try:
            client_dests = {name: _bytes_of(t) for name, t in dests.items()}
            self._export(job, step, client_dests)
        except ckpt.Error as e:
            raise RuntimeError(f"{where} cannot be read, so the checkpoint is not loaded: "
                               f"{e.message}") from e
        for i, r in enumerate(reqs):
            s = stored[r.storage_index]
            if s.nbytes == 0:
                target = planner.resolve_tensor(r).detach()
                planner.commit_tensor(r, target)
                continue
            target = targets[i]
            if direct.get(s.key) is not r:
                dtype, sizes = chunks[i]
                src = dests[s.key].view(dtype).view(sizes)
                for d, (off, n) in enumerate(zip(r.storage_offsets, r.lengths)):
                    src = src.narrow(d, off, n)
                target.copy_(src)
            planner.commit_tensor(r, target)

    def _export(self, job: str, step: int, dests: Dict[str, Any]) -> None:
        """export_into, retried while ckptd turns it away for running as
        many reads as it allows at once (RESOURCE_EXHAUSTED without a
        reason: every rank of a load asks at the same time), up to
        wait_timeout_s; and once more after ckptd replaced a damaged
        version by a tier's intact copy of it (ABORTED)."""
        deadline = time.monotonic() + self._kwargs["wait_timeout_s"]
        pause = 0.01
        repaired = False
        while True:
            try:
                self._client_now().export_into(job, 0, step, dests)
                return
            except ckpt.Error as e:
                if e.reason == "REPAIRED" and not repaired:
                    _log.warning("%s", e.message)
                    repaired = True
                    continue
                if e.code != "RESOURCE_EXHAUSTED" or e.reason is not None or \
                        time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def close(self) -> None:
        self._catalog.close()
        self._client = None
