"""GpuStore: one rank's CUDA tensors of a DCP state dict, handed to ckptd
where they are.

The rank's CUDA tensors are registered with ckptd through the GPU handover
(CUDA IPC, as ckpt.torch's GpuMemory does) as a ckptd job of one rank, one
layer per tensor, named like RankStore's jobs with a `g` for the device:
`<job_id>.g<rank>.<layout>`. A stage is then one ckptd step of every layer:
StepDone records an event on the stream the caller gave (the trainer's),
ckptd copies each tensor into its pinned pool once the event has completed,
and stage() returns when WaitSnapshot says the bytes are there. The trainer
makes no copy, and may change the tensors as soon as stage() returns (DCP's
contract). commit() waits until the step is durable.

Registration is by identity: the store keeps a reference to every tensor
it registered, so an address ckptd maps cannot be freed and handed to
another tensor; a stage whose tensors are other storages (or other keys,
dtypes or sizes) registers again. The same layout keeps the same job, so
its steps go on.

Every CUDA tensor is written at every save: whether its bytes changed is
not known without reading them on the device, so the frozen base of a
LoRA fine-tune is written again each time (RankStore, for CPU tensors,
writes only what changed). When the handover is refused (a ckptd or
client built without CUDA, memory that cannot be exported), the writer
copies the CUDA tensors into host slots instead (writer.py).

Its lock guards everything below: stage() runs on the trainer's thread or
the writer's staging thread, commit() on DCP's upload thread."""

from __future__ import annotations

import hashlib
import threading
from typing import Dict, List, Optional, Tuple

import torch

import ckpt

from .store import Stored, check_snapshot, client_for, layout_digest, layer_spec, nbytes_of
from .store import unregister, wait_idle


def identity(tensors: Dict[str, torch.Tensor]) -> str:
    """What a registration of `tensors` depends on: the layout and where
    each tensor's bytes are."""
    h = hashlib.sha256()
    for key, t in tensors.items():
        h.update(f"{key}\0{t.dtype}\0{nbytes_of(t)}\0{t.device}\0{t.data_ptr()}\n".encode())
    return h.hexdigest()


def stream_of(tensors: Dict[str, torch.Tensor]) -> int:
    """The current CUDA stream of the calling thread on the device of the
    tensors (0 without a CUDA tensor)."""
    for t in tensors.values():
        if t.is_cuda:
            return torch.cuda.current_stream(t.device).cuda_stream
    return 0


# What a client or ckptd that cannot take CUDA tensors in place answers
# (built without CUDA, no device, memory that allows no export); any other
# error (ckptd not running, a quota) is the save's.
_REFUSALS = ("UNIMPLEMENTED", "FAILED_PRECONDITION", "INVALID_ARGUMENT")


class HandoverRefused(RuntimeError):
    """ckptd or the client did not take the CUDA tensors where they are."""


class GpuStore:
    """One rank's CUDA tensors in ckptd (see the module's doc)."""

    def __init__(self, socket_path: Optional[str], job_id: str, rank: int,
                 call_timeout_s: float = 60.0, wait_timeout_s: float = 600.0):
        self._socket = socket_path
        self._job_id = job_id
        self._rank = rank
        self._timeouts = (call_timeout_s, wait_timeout_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._client = None
        self._job = ""
        self._identity = ""
        self._held: Dict[str, torch.Tensor] = {}  # registered; kept so none is freed
        self._next_step = 1
        self._last_step = 0
        self._staged = 0  # the step staged and not yet committed; 0: none

    def _open(self, tensors: Dict[str, torch.Tensor], ident: str) -> None:
        """Registers `tensors` where they are. HandoverRefused when the
        client or ckptd does not take them so; the store is then closed."""
        self._close_locked()
        client = client_for(self._socket, *self._timeouts)
        layers: List[dict] = []
        job = f"{self._job_id}.g{self._rank}.{layout_digest(tensors)}"
        try:
            for key, t in tensors.items():
                region, offset = client.add_gpu_tensor(t.data_ptr(), nbytes_of(t), key)
                layers.append(layer_spec(key, t, region, offset))
            client.register({"job_id": job, "rank": 0, "world_size": 1,
                             "policy": {"kind": "EXPLICIT"}, "layers": layers})
        except ckpt.Error as e:
            if e.code not in _REFUSALS:
                raise
            raise HandoverRefused(f"ckptd job {job}: {e.message}") from e
        self._client, self._job, self._identity = client, job, ident
        self._held = dict(tensors)
        self._last_step = client.latest_durable_step_at_register
        self._next_step = self._last_step + 1

    def stage(self, tensors: Dict[str, torch.Tensor], stream: int) -> None:
        """Has ckptd take `tensors` (CUDA, contiguous, of one device, none
        of zero size) into its pinned pool once the work queued on
        `stream` (a cudaStream_t) has run; returns when they are there."""
        with self._lock:
            try:
                wait_idle(self._idle, lambda: self._staged != 0, self._job, self._timeouts[1])
            except TimeoutError:
                self._staged = 0
                raise
            ident = identity(tensors)
            if ident != self._identity:
                self._open(tensors, ident)
            # The number is used up before the call, as RankStore.commit's.
            step = self._next_step
            self._next_step = step + 1
            self._client.set_cuda_stream(stream)
            self._client.step_done(step, 0.0, b"", list(range(len(self._held))))
            self._last_step = step
            check_snapshot(self._job, step, self._client.wait_snapshot(step))
            self._staged = step

    def commit(self) -> Tuple[int, Dict[str, Stored]]:
        """Waits until the staged step is durable; returns it and where
        each tensor's bytes are."""
        with self._lock:
            try:
                step = self._staged
                if step == 0 or self._client is None:
                    raise RuntimeError(f"job {self._job_id} rank {self._rank}: no CUDA tensors "
                                       "were staged, or the writer was closed during the save")
                self._client.wait_durable(step)
                return step, {key: Stored(self._job, key, step, step, nbytes_of(t))
                              for key, t in self._held.items()}
            finally:
                self._staged = 0
                self._idle.notify_all()

    def abandon(self) -> None:
        """The staged step is not committed (the rest of its save failed):
        the next stage goes ahead. The step stays in ckptd, named by no
        checkpoint."""
        with self._lock:
            self._staged = 0
            self._idle.notify_all()

    def staged(self) -> bool:
        with self._lock:
            return self._staged != 0

    def wait_durable(self, tier: str) -> int:
        """As RankStore.wait_durable."""
        with self._lock:
            if self._client is None or self._last_step == 0:
                return 0
            return self._client.wait_durable(self._last_step, tier)

    @property
    def job(self) -> str:
        return self._job

    def _close_locked(self) -> None:
        if self._client is not None:
            unregister(self._client)
        self._client, self._identity, self._held = None, "", {}

    def close(self) -> None:
        with self._lock:
            self._close_locked()
