"""CkptWriter: a DCP StorageWriter and AsyncStager that saves into ckptd.

In DCP's call order (torch.distributed.checkpoint.state_dict_saver):
- reset(checkpoint_id) names the checkpoint;
- stage(state_dict), from dcp.async_save, copies every CPU tensor into the
  rank's slots in memory ckptd maps (store.py), has ckptd take every CUDA
  tensor where it is into its pinned pool (gpu_store.py), and returns the
  state dict over those slots (meta tensors for the CUDA ones): the trainer
  may change its tensors as soon as it returns, and DCP plans and writes
  from the slots;
- write_data(plan, planner), on every rank, reports the staged tensors as
  one ckptd step (only the tensors whose bytes changed are written again;
  the others name the version ckptd holds) with the bytes items in the
  step's aux, and returns when all of it is durable; under plain dcp.save,
  nothing was staged, so write_data stages the planner's items first;
- finish(metadata, results), on the coordinator, is the commit point: the
  Metadata, with where ckptd holds every item, goes into the job's catalog
  (catalog.py) and is durable before finish returns.

The writer holds a RankStore, a GpuStore (its CUDA tensors) and a Catalog;
each has its own lock, so stage() on the trainer's thread and write_data()
on DCP's upload thread (async_save's thread executor) are safe.
async_save's PROCESS executor runs write_data() and finish() in a process
of DCP's: a writer made with process_executor=True pickles into a
ChildWriter that asks this one (process.py); any other is refused when
pickled."""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections import Counter
from concurrent.futures import Future as StagingFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .catalog import Catalog, check_job_id
from .gpu_store import GpuStore, HandoverRefused, marks_of, wait_for_marks
from .process import ChildWriter, PlainPlans, ProcessLink, check_collectives
from .store import GivenUp, RankStore, Stored, dumps, nbytes_of

_log = logging.getLogger("ckpt.dcp")

# The bytes items a rank's step carries in its aux (ckptd's max_aux_bytes is
# 1 MiB by default); larger ones go into the rank's bytes job.
AUX_BUDGET = 512 << 10


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _restaged(orig: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`slot` in the place of `orig`: a DTensor keeps its mesh and placements."""
    if is_dtensor(orig):
        from torch.distributed.tensor import DTensor
        # Not DTensor.from_local: it would move the slot to the mesh's device
        # (a GPU copy of the whole staged state).
        return DTensor(slot, orig._spec, requires_grad=False)
    return slot


def item_keys(indices) -> Dict[Any, str]:
    """The slot key of each tensor write item's MetadataIndex: its FQN,
    with its chunk's offsets where one rank writes two chunks of one
    tensor."""
    count = Counter(i.fqn for i in indices)
    return {i: i.fqn if count[i.fqn] == 1 else f"{i.fqn}@{','.join(str(o) for o in i.offset)}"
            for i in indices}


def _tag(checkpoint_id: Any) -> Optional[str]:
    """A save's checkpoint id as the stores tell saves apart (store.Turn)."""
    return None if checkpoint_id is None else str(checkpoint_id)


def _need_id(checkpoint_id: Any) -> None:
    if checkpoint_id is None:
        raise ValueError("ckpt.dcp.CkptWriter needs a checkpoint_id for each save (it names "
                         "the checkpoint in ckptd): pass checkpoint_id= to dcp.save/async_save")


class CkptWriter(PlainPlans, StorageWriter, AsyncStager):
    """Saves DCP checkpoints into ckptd (see the module's doc).

    job_id: the job, [A-Za-z0-9._-], at most 100 characters; its ckptd jobs
    are `<job_id>.dcp` (the catalog) and `<job_id>.r<rank>.<layout>`.
    socket_path: ckptd's socket (ckpt.Client's default when None).
    rank: this rank in the checkpoint (torch.distributed's, else 0).
    async_staging: stage on the writer's own thread: async_save then returns
    an AsyncSaveResponse at once, and the trainer waits for its
    staging_completion before it changes the tensors (its next optimizer
    step), so that the copy overlaps the forward and backward passes.
    process_executor: for async_save(async_checkpointer_type=PROCESS): the
    staged state dict DCP sends to its process holds meta tensors (ckptd
    has the bytes), and the writer pickles into a ChildWriter that asks
    this one to commit (process.py).
    gpu_in_place: CUDA tensors (of one device) are handed to ckptd where
    they are, through CUDA IPC, instead of being copied into host slots;
    when the handover is refused (no CUDA in ckptd or the client, memory
    that cannot be exported) the writer says so once and copies them.
    """

    _synchronize_after_execute = False  # nothing to synchronize: see stage()

    def __init__(self, job_id: str, socket_path: Optional[str] = None,
                 rank: Optional[int] = None, call_timeout_s: float = 60.0,
                 wait_timeout_s: float = 600.0, async_staging: bool = False,
                 process_executor: bool = False, gpu_in_place: bool = True):
        super().__init__()
        check_job_id(job_id)
        self.job_id = job_id
        self._socket = socket_path
        self._rank = rank
        self._timeouts = (call_timeout_s, wait_timeout_s)
        self._store: Optional[RankStore] = None
        self._bytes_store: Optional[RankStore] = None  # bytes items beyond AUX_BUDGET
        self._gpu_store: Optional[GpuStore] = None  # CUDA tensors, in place
        self._gpu_in_place = gpu_in_place
        self._catalog: Optional[Catalog] = None
        self._ids = threading.local()  # the checkpoint id of this thread's save
        self._async_staging = async_staging
        self._staging: Optional[ThreadPoolExecutor] = None  # its one thread
        self._process_executor = process_executor
        self._link = ProcessLink(self._serve_child)  # started when pickled
        self.checkpoint_id: Union[str, os.PathLike, None] = None  # the last reset()'s
        self.is_coordinator = False

    def __reduce__(self):
        if not self._process_executor:
            raise TypeError("ckpt.dcp.CkptWriter hands tensors to the ckptd of its own process "
                            "and cannot be pickled as it is: for async_save's PROCESS executor "
                            "make it with CkptWriter(..., process_executor=True)")
        address, token = self._link.address()
        return (ChildWriter, (address, token, self.job_id, sum(self._timeouts)))

    def _rank_now(self) -> int:
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _store_now(self) -> RankStore:
        if self._store is None:
            call, wait = self._timeouts
            self._store = RankStore(self._socket, self.job_id, self._rank_now(), call, wait)
        return self._store

    # ---- StorageWriter ----

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        # DCP calls reset() on the caller's thread and, for async_save, again
        # on the upload thread, whose write_data() and finish() follow: the id
        # is kept per thread, so that a next save's reset() on the trainer's
        # thread does not rename the save still uploading.
        self.checkpoint_id = checkpoint_id
        self._ids.checkpoint_id = checkpoint_id
        self._ids.stage_id = checkpoint_id  # for a stage() that follows on this thread

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_collectives(kwargs)
        self.is_coordinator = is_coordinator
        if self._rank is None and "rank" in kwargs:
            self._rank = int(kwargs["rank"])

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        store = self._store_now()
        cid = getattr(self._ids, "checkpoint_id", None)
        _need_id(cid)
        self._ids.stage_id = None  # this thread's save is being written: a later stage() is not it
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        keys = item_keys([i.index for i in tensor_items])
        data = {i.index: planner.resolve_data(i) for i in tensor_items}
        slot_key = {idx: keys[idx] if _local(t).is_meta else store.slot_of(_local(t))
                    for idx, t in data.items()}
        if any(k is None for idx, k in slot_key.items() if nbytes_of(data[idx]) > 0):
            # dcp.save, or items the planner made anew: stage them now, all
            # of the planner's tensors (not only this rank's plan, from which
            # DCP took the items another rank saves), so that the layout is
            # the one async_save's stage() registers.
            full = getattr(planner, "state_dict", None)
            whole = {k: _local(v) for k, v in full.items() if isinstance(v, torch.Tensor)} \
                if isinstance(full, dict) and all(keys[i] == i.fqn for i in data) else None
            if whole is None or any(keys[i] not in whole for i in data):
                whole = {keys[idx]: _local(t) for idx, t in data.items()}
            self._stage_tensors({k: t for k, t in whole.items() if nbytes_of(t) > 0},
                                tag=_tag(cid))
            slot_key = {idx: keys[idx] for idx in data}
        blobs = {i.index.fqn: planner.resolve_data(i).getvalue()
                 for i in plan.items if i.type == WriteItemType.BYTE_IO}
        results = self._commit_items([(idx, nbytes_of(t)) for idx, t in data.items()], slot_key,
                                     blobs, [i.index for i in plan.items
                                             if i.type == WriteItemType.BYTE_IO], _tag(cid))
        if not self.is_coordinator:
            self._ids.checkpoint_id = None  # used; DCP calls reset() only with an id
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _commit_items(self, tensors: List[tuple], slot_key: Dict[Any, Optional[str]],
                      blobs: Dict[str, bytes], byte_items: List[Any],
                      tag: Optional[str]) -> List[WriteResult]:
        """Commits what save `tag` staged with `blobs` (bytes items by FQN)
        and returns the WriteResults of `tensors` ([(MetadataIndex,
        nbytes)], each staged in its `slot_key`) and of `byte_items`."""
        store = self._store_now()
        large = self._large_blobs(blobs)
        aux = dumps(blobs) if blobs else b""
        # The CUDA tensors' step first; the host step is committed (and its
        # stage released) whether or not that fails.
        gpu_where: Dict[str, Stored] = {}
        failed: Optional[BaseException] = None
        if self._gpu_store is not None and self._gpu_store.staged_as(tag):
            try:
                gpu_where = self._gpu_store.commit(tag)[1]
            except Exception as e:  # noqa: BLE001 - raised below, after the host commit
                failed = e
        step, where = store.commit(aux, tag)
        if failed is not None:
            raise failed
        if where.keys() & gpu_where.keys():  # each save's stores hold disjoint keys
            raise RuntimeError(f"ckpt.dcp: tensors {sorted(where.keys() & gpu_where.keys())[:3]} "
                               f"of job {self.job_id} were staged both in place and in host "
                               "slots; this checkpoint is not saved")
        where.update(gpu_where)
        keys = item_keys([idx for idx, _ in tensors])
        results = []
        for idx, n in tensors:
            stored = where.get(slot_key[idx]) if n > 0 else Stored(store.job, keys[idx], step, 0, 0)
            if stored is None:
                raise RuntimeError(f"ckpt.dcp: tensor '{idx.fqn}' of job {self.job_id} was not "
                                   "staged by this writer's stage() (a planner that makes new "
                                   "tensors needs async_save's THREAD executor or dcp.save)")
            results.append(WriteResult(index=idx, size_in_bytes=n, storage_data=stored))
        for idx in byte_items:
            fqn = idx.fqn
            job, at, n = (large[0], large[1], large[2][fqn]) if fqn in large[2] else \
                (store.job, step, len(blobs[fqn]))
            results.append(WriteResult(index=idx, size_in_bytes=n, storage_data=Stored(
                job, fqn, at, at, n, is_bytes=True)))
        return results

    def _serve_child(self, req: tuple) -> Any:
        """A request of the ChildWriter in DCP's checkpoint process."""
        if req[0] == "write":
            _, cid, tensors, blobs, byte_items = req
            _need_id(cid)
            keys = item_keys([idx for idx, _ in tensors])
            return self._commit_items(tensors, keys, blobs, byte_items, _tag(cid))
        if req[0] == "finish":
            _, cid, metadata, results = req
            self._finish(cid, metadata, results)
            return None
        raise ValueError(f"unknown request {req[0]!r}")

    def _large_blobs(self, blobs: Dict[str, bytes]) -> tuple:
        """Moves the largest bytes items out of `blobs` until the rest fits
        the step's aux (AUX_BUDGET), into one U8 tensor of the rank's bytes
        job (`<job_id>.bytes.r<rank>.<capacity>`: its capacity a power of
        two, so that it is registered again only when it grows), committed
        as that job's next step with their (offset, length) in its aux.
        Returns (bytes job, its step, {fqn: length}) of those moved."""
        kept = sum(len(b) for b in blobs.values())
        if kept <= AUX_BUDGET:
            return ("", 0, {})
        moved: Dict[str, bytes] = {}
        for fqn in sorted(blobs, key=lambda k: -len(blobs[k])):
            if kept <= AUX_BUDGET:
                break
            moved[fqn] = blobs.pop(fqn)
            kept -= len(moved[fqn])
        total = sum(len(b) for b in moved.values())
        buf = torch.zeros(max(1 << 20, 1 << (total - 1).bit_length()), dtype=torch.uint8)
        index, off = {}, 0
        for fqn, b in moved.items():
            buf[off:off + len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
            index[fqn] = (off, len(b))
            off += len(b)
        if self._bytes_store is None:
            call, wait = self._timeouts
            self._bytes_store = RankStore(self._socket, f"{self.job_id}.bytes", self._rank_now(),
                                          call, wait)
        self._bytes_store.stage({"bytes": buf})
        step, _ = self._bytes_store.commit(dumps(index))
        return (self._bytes_store.job, step, {fqn: n for fqn, (_, n) in index.items()})

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        cid, self._ids.checkpoint_id = self._ids.checkpoint_id, None
        self._finish(cid, metadata, results)

    def _finish(self, cid: Any, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        if self._catalog is None:
            call, wait = self._timeouts
            self._catalog = Catalog(self._socket, self.job_id, call, wait)
        self._catalog.put(cid, metadata)

    # ---- AsyncStager ----

    def stage(self, state_dict: Dict[str, Any]) -> Union[Dict[str, Any], StagingFuture]:
        """The state dict over ckptd's slots (see the module's doc), or
        with async_staging a future of it, staged on the writer's thread."""
        flat, mapping = flatten_state_dict(state_dict)
        tensors = {k: _local(v) for k, v in flat.items()
                   if isinstance(v, torch.Tensor) and nbytes_of(_local(v)) > 0}
        # Events on the trainer's streams, recorded on its thread now: the
        # CUDA tensors are taken (in place or copied) as the work queued
        # before this call left them, also when the stage runs later on the
        # writer's thread. The save's id is known here when DCP called
        # reset() on this thread just before (async_save up to PyTorch 2.9;
        # from 2.10 it resets on its upload thread only); a reset() that a
        # write_data() or stage() on this thread has used since is another
        # save's. A stage without an id is written by the next save.
        marks = marks_of(tensors)
        tag = _tag(getattr(self._ids, "stage_id", None))
        self._ids.stage_id = None  # this save's: a stage() by hand later knows none
        if not self._async_staging:
            return self._stage_now(flat, mapping, tensors, marks, tag)
        if self._staging is None:
            self._staging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-dcp-stage")
        return self._staging.submit(self._stage_now, flat, mapping, tensors, marks, tag)

    def _in_place(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors of `tensors` that GpuStore takes where they are: the
        contiguous CUDA ones, when they are on one device (a rank's GPU
        registration is of one device) and the handover was not refused."""
        if not self._gpu_in_place:
            return {}
        gpu = {k: t for k, t in tensors.items()
               if t.is_cuda and t.is_contiguous() and not t.is_conj() and not t.is_neg()}
        return gpu if len({t.device for t in gpu.values()}) <= 1 else {}

    def _stage_tensors(self, tensors: Dict[str, torch.Tensor], marks: Optional[dict] = None,
                       tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """Stages `tensors` (none of zero size) for save `tag` (its
        checkpoint id): CUDA ones in place (_in_place), the others into
        host slots. Returns each key's staged tensor: its slot, or a meta
        tensor of its shape and dtype for one ckptd took in place. `marks`:
        the events after whose work the CUDA tensors are taken (marks_of();
        no wait when None). A failed stage releases the stores it staged;
        one that gave up the previous save (GivenUp) gives it up in both."""
        gpu = self._in_place(tensors)
        marks = marks or {}
        staged = []
        try:
            if gpu:
                if self._gpu_store is None:
                    call, wait = self._timeouts
                    self._gpu_store = GpuStore(self._socket, self.job_id, self._rank_now(),
                                               call, wait)
                try:
                    device = next(iter(gpu.values())).device
                    self._gpu_store.stage(gpu, marks.get(device), tag)
                    staged.append(self._gpu_store)
                except HandoverRefused as e:
                    _log.warning("ckpt.dcp: %s; CUDA tensors are copied into host memory from "
                                 "now on (CkptWriter(gpu_in_place=False) does so without "
                                 "trying)", e)
                    self._gpu_in_place = False
                    gpu = {}
            wait_for_marks(marks)  # before a CUDA tensor is copied to its slot
            slots = self._store_now().stage({k: t for k, t in tensors.items() if k not in gpu},
                                            tag)
        except GivenUp:
            for store in (self._gpu_store, self._store):
                if store is not None:
                    store.abandon() if store in staged else store.give_up()
            raise
        except BaseException:
            for store in staged:
                store.abandon()
            raise
        # Detached: a meta tensor of a tensor that requires grad would not
        # pickle into DCP's process (and would say requires_grad).
        slots.update({k: t.detach().to("meta") for k, t in gpu.items()})
        return slots

    def _stage_now(self, flat: Dict[str, Any], mapping: Any, tensors: Dict[str, torch.Tensor],
                   marks: dict, tag: Optional[str]) -> Dict[str, Any]:
        slots = self._stage_tensors(tensors, marks, tag)
        staged: Dict[str, Any] = {}
        for k, v in flat.items():
            if k in slots:
                # For DCP's process, the slot's shape and dtype only.
                staged[k] = _restaged(v, slots[k].to("meta") if self._process_executor
                                      else slots[k])
            elif isinstance(v, torch.Tensor):
                staged[k] = v.detach().clone()
            else:
                staged[k] = copy.deepcopy(v)
        return unflatten_state_dict(staged, mapping)

    def synchronize_staging(self) -> None:
        pass  # DCP's staging_completion says when an async stage is done

    def wait_durable(self, tier: str = "local") -> None:
        """Waits until this rank's last save (and, on the coordinator, its
        catalog entry) is durable in `tier`: "local" (every save already
        is when it returns), "peer" or "remote" (a replacement node, or
        any other node of the cluster, can load it: docs/dcp.md).
        ckpt.Error DEADLINE_EXCEEDED after the writer's wait_timeout_s."""
        for part in (self._store, self._gpu_store, self._bytes_store, self._catalog):
            if part is not None:
                part.wait_durable(tier)

    def close(self) -> None:
        self._link.close()
        if self._staging is not None:
            self._staging.shutdown(wait=True)
            self._staging = None
        for part in (self._store, self._gpu_store, self._bytes_store, self._catalog):
            if part is not None:
                part.close()
        self._store = self._gpu_store = self._bytes_store = self._catalog = None
