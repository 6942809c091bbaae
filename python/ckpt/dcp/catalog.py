"""Catalog: the DCP checkpoints of a job, as ckptd steps of one job of its own.

The coordinator's finish() is DCP's commit point. It stores the checkpoint's
`Metadata` (every item's chunks, and where ckptd holds each: the rank jobs'
versions and bytes) with its checkpoint id as the aux of the next step of
the job `<job_id>.dcp`, and waits until that step is durable. Every rank's
write_data() waited for its own bytes to be durable before finish() runs, so
a checkpoint the catalog names is whole; one whose finish() never completed
is not in it. A step needs a layer: the catalog's job has one of one byte,
written once.

The aux is zlib-compressed torch.save data, at most ckptd's max_aux_bytes
(1 MiB by default, up to 64 MiB): a few thousand tensors' metadata. It is read back
only by ckpt.dcp.CkptReader of the same uid: ckptd serves a job's steps to
its owner only, and it is plain data (store.plain_metadata) read with
torch.load(weights_only=True), which builds nothing else.

Used by one thread at a time (DCP calls finish() and read_metadata() on one
thread); its lock makes that so."""

from __future__ import annotations

import re
import threading
import zlib
from typing import Any, Optional, Tuple

import ckpt

from .store import client_for, dumps, loads, metadata_of, plain_metadata, unregister

FORMAT = 1
MAX_INDEX = 10_000  # checkpoint ids an entry indexes


def catalog_job(job_id: str) -> str:
    return f"{job_id}.dcp"


def check_job_id(job_id: str) -> None:
    if not isinstance(job_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,100}", job_id):
        raise ValueError(f"job_id must be 1 to 100 characters of [A-Za-z0-9._-], not {job_id!r}")


class Catalog:
    """The checkpoints of `job_id` (see the module's doc)."""

    def __init__(self, socket_path: Optional[str], job_id: str, call_timeout_s: float = 60.0,
                 wait_timeout_s: float = 600.0):
        check_job_id(job_id)
        self._socket = socket_path
        self._job_id = job_id
        self._kwargs = {"call_timeout_s": call_timeout_s, "wait_timeout_s": wait_timeout_s}
        self._lock = threading.Lock()
        self._writer: Optional[ckpt.Client] = None
        self._next_step = 1
        self._last_put = 0  # the last catalog step put, durable locally
        self._reader: Optional[ckpt.Client] = None
        self._index: Optional[dict] = None  # {checkpoint id: catalog step}, as last put

    def _client(self) -> ckpt.Client:
        return client_for(self._socket, self._kwargs["call_timeout_s"],
                          self._kwargs["wait_timeout_s"])

    def put(self, checkpoint_id: Any, metadata: Any) -> int:
        """Stores `metadata` as checkpoint `checkpoint_id`; returns the
        catalog step once it is durable. Each entry carries the index of
        the checkpoints before it ({id: catalog step}, the newest
        MAX_INDEX), so that any id is found with two calls, across steps
        that never became durable."""
        with self._lock:
            index = self._index_now()
            index.pop(str(checkpoint_id), None)
            if self._writer is None:
                client = self._client()
                region = client.allocate_region(64)
                client.register({"job_id": catalog_job(self._job_id), "rank": 0,
                                 "world_size": 1, "policy": {"kind": "EXPLICIT"},
                                 "layers": [{"name": "catalog", "kind": "OTHER", "tensors": [
                                     {"name": "catalog", "shape": [1], "dtype": "U8",
                                      "role": "OTHER", "region": region.index,
                                      "offset": 0}]}]})
                self._writer = client
                self._next_step = client.latest_durable_step_at_register + 1
            step = self._next_step
            self._next_step = step + 1  # used up, also when the reply is lost
            index[str(checkpoint_id)] = step
            while len(index) > MAX_INDEX:
                index.pop(next(iter(index)))
            blob = zlib.compress(dumps(
                {"format": FORMAT, "checkpoint_id": str(checkpoint_id),
                 "metadata": plain_metadata(metadata), "index": index}))
            try:
                self._writer.step_done(step, 0.0, blob, [])
            except ckpt.Error as e:
                if e.code == "INVALID_ARGUMENT" and "aux" in e.message:
                    raise RuntimeError(
                        f"the DCP metadata of checkpoint {checkpoint_id!r} is {len(blob)} bytes "
                        "compressed, more than ckptd's max_aux_bytes: raise it in ckptd's "
                        "configuration (up to 64 MiB)") from e
                raise
            self._writer.wait_durable(step)
            self._index = index
            self._last_put = step
            return step

    def wait_durable(self, tier: str) -> int:
        """Waits until the last entry put is durable in `tier`."""
        with self._lock:
            if self._writer is None or self._last_put == 0:
                return 0
            return self._writer.wait_durable(self._last_put, tier)

    def _entry(self, target: int) -> Optional[Tuple[int, dict]]:
        """(step, entry) of catalog step `target` (0: the newest durable),
        or None when the catalog has none."""
        if self._reader is None:
            self._reader = self._client()
        try:
            plan = self._reader.plan(target, job_id=catalog_job(self._job_id), rank=0)
        except ckpt.Error as e:
            if e.code == "NOT_FOUND":
                return None
            raise
        step = plan["target_step"]
        if step == 0 or not plan["aux"]:
            return None
        entry = loads(zlib.decompress(plan["aux"]))
        if entry.get("format") != FORMAT:
            raise RuntimeError(f"catalog step {step} of job {self._job_id} has format "
                               f"{entry.get('format')}; this ckpt.dcp reads format {FORMAT}: "
                               "load it with the ckpt release that saved it")
        return step, entry

    def _index_now(self) -> dict:
        if self._index is None:
            newest = self._entry(0)
            self._index = dict(newest[1].get("index", {})) if newest else {}
        return dict(self._index)

    def get(self, checkpoint_id: Any = None) -> Tuple[int, str, Any]:
        """(catalog step, checkpoint id, Metadata) of the newest durable
        checkpoint named `checkpoint_id` (the newest of all when None);
        FileNotFoundError when there is none."""
        with self._lock:
            want = None if checkpoint_id is None else str(checkpoint_id)
            found = self._entry(0)
            if found is not None and want is not None and found[1]["checkpoint_id"] != want:
                at = found[1].get("index", {}).get(want)
                found = self._entry(at) if at is not None else None
                if found is not None and found[1]["checkpoint_id"] != want:
                    found = None  # that step was collected, or is another's
            if found is None:
                what = "no checkpoint" if want is None else f"no checkpoint {want!r}"
                raise FileNotFoundError(f"ckptd holds {what} of job {self._job_id} (DCP "
                                        f"catalog {catalog_job(self._job_id)})")
            step, entry = found
            return step, entry["checkpoint_id"], metadata_of(entry["metadata"])

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                unregister(self._writer)
                self._writer = None
            self._reader = None
