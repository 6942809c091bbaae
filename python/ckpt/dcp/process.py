"""async_save's PROCESS executor: the writer in DCP's checkpoint process
asks the trainer's writer, which holds the ckptd registration.

DCP's process executor pickles the storage writer and the staged state dict
into a process of its own (spawned once, with a gloo group of its own) and
runs dcp.save there. ckptd's data path cannot move with it: the tensors are
in a region the trainer's process registered. So a CkptWriter made with
process_executor=True

- stages as always (the tensors go into the region ckptd maps), but hands
  DCP a state dict of meta tensors of the same shapes, dtypes and
  placements, so that nothing of the tensors' bytes is pickled;
- pickles itself as a ChildWriter: the path of a Unix socket in a directory
  only its user can enter, and a random token (multiprocessing's HMAC
  handshake: a process that does not hold the token is turned away before
  anything it sends is read);
- serves, on a thread of its own (ProcessLink), the child's two requests:
  write (the child's plan items and the bytes items it resolved; the
  trainer's writer reports the staged step to ckptd and returns the
  WriteResults once it is durable) and finish (the coordinator's Metadata,
  stored in the job's catalog).

The child never talks to ckptd."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from multiprocessing.connection import Client as _Dial
from multiprocessing.connection import Listener, answer_challenge, deliver_challenge
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

# A request the trainer's writer serves: ("write", checkpoint_id, tensor
# items [(MetadataIndex, nbytes)], {fqn: bytes}, bytes items [MetadataIndex])
# or ("finish", checkpoint_id, Metadata, results). The reply: ("ok", value)
# or ("error", message).
Handler = Callable[[tuple], Any]


def check_collectives(kwargs: Dict[str, Any]) -> None:
    if kwargs.get("use_collectives") is False:
        raise ValueError("ckpt.dcp.CkptWriter needs DCP's collectives (use_collectives=True): "
                         "its coordinator's finish() stores the metadata of every rank")


class PlainPlans:
    """What both writers leave to DCP: the plans as DCP makes them, and the
    checkpoint id as the storage meta (never a path to validate)."""

    checkpoint_id: Union[str, os.PathLike, None]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return False  # chosen by passing a writer, never from an id alone

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans


class ProcessLink:
    """The trainer's side: a listener on a private Unix socket, its
    accepting thread, and a thread per connection that checks the token
    and then serves its requests in order (DCP's process keeps one
    connection and runs one save at a time). A connection that stalls in
    the handshake holds up its own thread only. Thread-safe: its lock
    guards the listener's start and stop."""

    def __init__(self, handler: Handler):
        self._handler = handler
        self._lock = threading.Lock()
        self._listener: Optional[Listener] = None
        self._thread: Optional[threading.Thread] = None
        self._dir = ""
        self._token = b""

    def address(self) -> Tuple[str, bytes]:
        """(socket path, token), the listener started at the first call."""
        with self._lock:
            if self._listener is None:
                self._dir = tempfile.mkdtemp(prefix="ckpt-dcp-")  # mode 0700
                self._token = os.urandom(32)
                path = os.path.join(self._dir, "writer.sock")
                self._listener = Listener(path, family="AF_UNIX")  # the token: _serve_one
                self._thread = threading.Thread(target=self._serve, args=(self._listener,),
                                                name="ckpt-dcp-process", daemon=True)
                self._thread.start()
            return self._listener.address, self._token

    def _serve(self, listener: Listener) -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_one, args=(conn,), name="ckpt-dcp-process-conn",
                             daemon=True).start()

    def _serve_one(self, conn: Any) -> None:
        with conn:
            try:
                deliver_challenge(conn, self._token)  # as Listener(authkey=) does
                answer_challenge(conn, self._token)
            except Exception:  # noqa: BLE001 - no token: nothing of it is read
                return
            while True:
                try:
                    req = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", self._handler(req))
                except Exception as e:  # noqa: BLE001 - goes back to the save
                    reply = ("error", f"{type(e).__name__}: {e}")
                try:
                    conn.send(reply)
                except OSError:
                    return

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            thread, self._thread = self._thread, None
        if listener is not None:
            listener.close()
            if thread is not None:
                thread.join(timeout=10)
            shutil.rmtree(self._dir, ignore_errors=True)


class ChildWriter(PlainPlans, StorageWriter):
    """The CkptWriter as DCP's checkpoint process sees it: each write and
    finish is a request to the trainer's writer (see the module's doc)."""

    def __init__(self, address: str, token: bytes, job_id: str, timeout_s: float):
        super().__init__()
        self.job_id = job_id
        self._address = address
        self._token = token
        self._timeout_s = timeout_s
        self._conn: Any = None
        self._lock = threading.Lock()
        self.checkpoint_id: Union[str, os.PathLike, None] = None
        self.is_coordinator = False

    def __reduce__(self):
        return (ChildWriter, (self._address, self._token, self.job_id, self._timeout_s))

    def _ask(self, req: tuple) -> Any:
        with self._lock:
            if self._conn is None:
                try:
                    self._conn = _Dial(self._address, family="AF_UNIX", authkey=self._token)
                except OSError as e:
                    raise RuntimeError(
                        f"ckpt.dcp: the trainer's CkptWriter of job {self.job_id} does not "
                        f"answer at {self._address} ({e}): was it closed, or its process "
                        "ended?") from e
            self._conn.send(req)
            if not self._conn.poll(self._timeout_s):
                raise TimeoutError(f"ckpt.dcp: the trainer's CkptWriter of job {self.job_id} "
                                   f"did not answer within {self._timeout_s} s")
            status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"ckpt.dcp (in the trainer's process): {value}")
        return value

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.checkpoint_id = checkpoint_id

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_collectives(kwargs)
        self.is_coordinator = is_coordinator

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        tensors: List[Tuple[Any, int]] = []
        blobs: Dict[str, bytes] = {}
        byte_items: List[Any] = []
        for i in plan.items:
            if i.type == WriteItemType.BYTE_IO:
                blobs[i.index.fqn] = planner.resolve_data(i).getvalue()
                byte_items.append(i.index)
            else:
                t = planner.resolve_data(i)  # a meta tensor: its size only
                tensors.append((i.index, t.numel() * t.element_size()))
        results = self._ask(("write", self.checkpoint_id, tensors, blobs, byte_items))
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        self._ask(("finish", self.checkpoint_id, metadata, results))
